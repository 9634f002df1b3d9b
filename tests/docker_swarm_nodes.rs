//! A two-node Docker Swarm on this machine (issue 13, item 6): a service whose task mounts a
//! volume of a `csi-isolator docker-plugin` driver runs on node X, X is drained, and the task
//! comes up on node Y.
//!
//! Each node is a private dockerd in a network namespace of its own and a mount namespace of its
//! own ([`SwarmNode`], [`Dockerd::start_on_node`]); the namespaces are joined by a veth pair with
//! test addresses (10.213.0.1/30 and 10.213.0.2/30, nothing routed anywhere else). Each node runs
//! its own docker-plugin (own work dir, own bundled plugin) under the same driver name: its
//! socket is in a per-node directory that dockerd's mount namespace sees at
//! `/run/docker/plugins`, and the plugin's mounts reach dockerd through a shared bind of the
//! node's dir (the host's root is private). Docker 20.10 has no Swarm cluster volumes: a legacy
//! volume plugin serves the tasks of its own node, under the name the service gives.
//!
//! In this test each node's bundled plugin keeps its own volumes, so the volume Y's task gets is
//! another one with the same name: it proves the scheduling and the cleanup (every namespace,
//! veth, dockerd, mount and process gone, the host's network as before). Data moving with the
//! task needs one controller plugin for both nodes (issue 13 items 1 and 2).
//!
//! Runs under the machine-wide engine-test lock (`HostPaths`) and in the `docker-engine` test
//! group. Needs root, `dockerd`, `ip`, `unshare`, `nsenter`: without them it fails, never skips.

use std::path::Path;

use csi_isolator_testing::engines::{
    busybox_tar, require_engine, unique, Dockerd, EngineCli, HostPaths, DOCKER_HOST_PATHS,
};
use csi_isolator_testing::swarm::{
    host_mounts_outside_temp, require_namespace_tools, veth_pair, wait_for, HostNetwork,
    RemoveTasks, SwarmNode,
};
use csi_isolator_testing::{
    mount_points_under, processes_mentioning, recorded_volumes, require_root, DockerPluginProcess,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// The swarm's node id of `e`'s node.
fn node_id(e: &Dockerd) -> String {
    e.ok(&["info", "--format", "{{.Swarm.NodeID}}"])
}

/// `CONTAINER-ID` of the running containers of `service` on `e`'s node.
fn task_containers(e: &Dockerd, service: &str) -> Vec<String> {
    e.ok(&[
        "ps",
        "-q",
        "--filter",
        &format!("label=com.docker.swarm.service.name={service}"),
    ])
    .lines()
    .map(str::to_string)
    .collect()
}

/// The current states of the tasks the manager `m` places on `node` for `service` that should
/// run, failing the test at once if one failed or was rejected.
fn running_on(m: &Dockerd, node: &str, service: &str, logs: &dyn Fn() -> String) -> bool {
    let states = m.ok(&[
        "node",
        "ps",
        "--no-trunc",
        "--filter",
        "desired-state=running",
        "--filter",
        &format!("name={service}"),
        "--format",
        "{{.CurrentState}}|{{.Error}}",
        node,
    ]);
    let failed = states
        .lines()
        .find(|l| l.starts_with("Failed") || l.starts_with("Rejected"));
    assert!(failed.is_none(), "a task failed: {states}\n{}", logs());
    states.lines().any(|l| l.starts_with("Running"))
}

/// Reads `f` in the volume's mount point on `e`'s node (through its plugin's mount).
fn written(e: &Dockerd, volume: &str, plugin: &DockerPluginProcess) -> Result<String, String> {
    let out = e.docker(&["volume", "inspect", "--format", "{{.Mountpoint}}", volume]);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let mountpoint = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        Path::new(&mountpoint).starts_with(&plugin.work),
        "mount point {mountpoint} is not under the node's plugin work dir {}",
        plugin.work.display()
    );
    match std::fs::read_to_string(Path::new(&mountpoint).join("f")) {
        Ok(s) if !s.is_empty() => Ok(s),
        Ok(_) => Err("an empty file".to_string()),
        Err(e) => Err(format!("{mountpoint}/f: {e}")),
    }
}

#[test]
fn a_service_drained_from_node_x_comes_up_on_node_y_with_a_volume_of_each_nodes_plugin() {
    require_root();
    require_engine("dockerd", "docker.io");
    require_namespace_tools();
    let id = unique();
    // Short: the socket path must fit in sun_path.
    let driver = format!("csi2n-{id}");
    let host = HostPaths::claim(DOCKER_HOST_PATHS);
    let network_before = HostNetwork::read();
    let mounts_before = host_mounts_outside_temp();

    let x = SwarmNode::new("x", "10.213.0.1");
    let y = SwarmNode::new("y", "10.213.0.2");
    veth_pair(
        &x.netns,
        "csi2n-x",
        "10.213.0.1/30",
        &y.netns,
        "csi2n-y",
        "10.213.0.2/30",
    );
    let plugin_x = x.start_plugin(BIN, &driver, &[]);
    let plugin_y = y.start_plugin(BIN, &driver, &[]);
    let ex = x.start_dockerd();
    let reap_x = RemoveTasks(&ex);
    let ey = y.start_dockerd();
    let reap_y = RemoveTasks(&ey);
    let logs = || {
        format!(
            "dockerd x:\n{}\ndockerd y:\n{}\ndocker-plugin x:\n{}\ndocker-plugin y:\n{}",
            ex.log(),
            ey.log(),
            plugin_x.log(),
            plugin_y.log()
        )
    };
    // The nodes' binds over /run/docker/plugins and /etc/docker are in their own namespaces.
    assert_eq!(host_mounts_outside_temp(), mounts_before);
    // Each dockerd has its own engine ID (its own /etc/docker) and sees no host socket plugin.
    assert_ne!(
        ex.ok(&["info", "--format", "{{.ID}}"]),
        ey.ok(&["info", "--format", "{{.ID}}"])
    );

    let tar = busybox_tar(&x.sb);
    let image = format!("csi-isolator-test/busybox:{id}");
    for e in [&ex, &ey] {
        SwarmNode::import_image(e, &tar, &image);
        // dockerd offers a socket plugin to Swarm only once it has looked for it (moby#32380).
        e.ok(&["volume", "ls"]);
        let drivers = e.ok(&["info", "--format", "{{json .Plugins.Volume}}"]);
        assert!(drivers.contains(&format!("\"{driver}\"")), "{drivers}");
    }

    ex.ok(&[
        "swarm",
        "init",
        "--advertise-addr",
        &x.addr,
        "--listen-addr",
        &format!("{}:2377", x.addr),
    ]);
    let token = ex.ok(&["swarm", "join-token", "-q", "worker"]);
    ey.ok(&[
        "swarm",
        "join",
        "--token",
        &token,
        "--advertise-addr",
        &y.addr,
        "--listen-addr",
        &format!("{}:2377", y.addr),
        &format!("{}:2377", x.addr),
    ]);
    let (idx, idy) = (node_id(&ex), node_id(&ey));
    assert_ne!(idx, idy);
    wait_for(
        "both nodes are Ready",
        || {
            let nodes = ex.ok(&["node", "ls", "--format", "{{.ID}} {{.Status}}"]);
            let ready = |id: &str| nodes.lines().any(|l| l == format!("{id} Ready"));
            match ready(&idx) && ready(&idy) {
                true => Ok(()),
                false => Err(nodes),
            }
        },
        logs,
    );
    for node in [&idx, &idy] {
        let described = ex.ok(&[
            "node",
            "inspect",
            node,
            "--format",
            "{{json .Description.Engine.Plugins}}",
        ]);
        assert!(
            described.contains(&format!("\"Type\":\"Volume\",\"Name\":\"{driver}\"")),
            "node {node} does not offer the driver: {described}"
        );
    }

    // Y paused: the task can only go to X.
    ex.ok(&["node", "update", "--availability", "pause", &idy]);
    let service = format!("csi2n-{id}");
    let volume = "swarmvol";
    ex.ok(&[
        "service",
        "create",
        "--detach",
        "--name",
        &service,
        "--no-resolve-image",
        "--stop-grace-period",
        "1s",
        "--mount",
        &format!(
            "type=volume,source={volume},target=/data,volume-driver={driver},volume-opt=size=16M"
        ),
        &image,
        "sh",
        "-c",
        "echo from-swarm > /data/f; sleep 3600",
    ]);
    wait_for(
        "the task runs on X",
        || match running_on(&ex, &idx, &service, &logs) {
            true => Ok(()),
            false => Err(ex.ok(&["service", "ps", "--no-trunc", &service])),
        },
        logs,
    );
    assert_eq!(task_containers(&ex, &service).len(), 1);
    assert_eq!(task_containers(&ey, &service), Vec::<String>::new());
    assert_eq!(
        wait_for("X's task writes", || written(&ex, volume, &plugin_x), logs),
        "from-swarm\n"
    );
    assert_eq!(ex.volume_status(volume)["state"], "PUBLISHED");

    // Drain X with Y active: the task is shut down on X (Docker's Unmount: the last use
    // unpublishes X's volume) and its replacement runs on Y.
    ex.ok(&["node", "update", "--availability", "active", &idy]);
    ex.ok(&["node", "update", "--availability", "drain", &idx]);
    wait_for(
        "the task runs on Y",
        || match running_on(&ex, &idy, &service, &logs) {
            true => Ok(()),
            false => Err(ex.ok(&["service", "ps", "--no-trunc", &service])),
        },
        logs,
    );
    wait_for(
        "X's task container goes",
        || match task_containers(&ex, &service) {
            c if c.is_empty() => Ok(()),
            c => Err(format!("{c:?}")),
        },
        logs,
    );
    wait_for(
        "X's volume is unpublished",
        || match mount_points_under(&plugin_x.work) {
            m if m.is_empty() => Ok(()),
            m => Err(format!("{m:?}")),
        },
        logs,
    );
    assert_eq!(task_containers(&ey, &service).len(), 1);
    // Y's task got a volume of Y's plugin (its own: not X's data, which needs one controller).
    assert_eq!(
        wait_for("Y's task writes", || written(&ey, volume, &plugin_y), logs),
        "from-swarm\n"
    );
    assert_eq!(ey.volume_status(volume)["state"], "PUBLISHED");
    assert_eq!(ex.volume_status(volume)["state"], "CREATED");

    // Remove the service: Y's task goes and Y's volume is unpublished.
    ex.ok(&["service", "rm", &service]);
    wait_for(
        "Y's task container goes",
        || match task_containers(&ey, &service) {
            c if c.is_empty() => Ok(()),
            c => Err(format!("{c:?}")),
        },
        logs,
    );
    wait_for(
        "Y's volume is unpublished",
        || match mount_points_under(&plugin_y.work) {
            m if m.is_empty() => Ok(()),
            m => Err(format!("{m:?}")),
        },
        logs,
    );
    // Stopped containers hold the volume's name: remove them, then the volumes.
    for e in [&ex, &ey] {
        let stopped = e.ok(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=com.docker.swarm.service.name={service}"),
        ]);
        for c in stopped.lines() {
            e.ok(&["rm", c]);
        }
        e.ok(&["volume", "rm", volume]);
    }

    ey.ok(&["swarm", "leave"]);
    ex.ok(&["swarm", "leave", "--force"]);
    for e in [&ex, &ey] {
        assert_eq!(
            e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
            "inactive"
        );
        e.ok(&["rmi", &image]);
    }
    drop(reap_y);
    drop(reap_x);
    ey.stop(&y.sb);
    ex.stop(&x.sb);

    for (node, plugin) in [(&x, plugin_x), (&y, plugin_y)] {
        let work = plugin.work.clone();
        let log = plugin.log();
        let status = plugin.stop(&node.sb, Signal::SIGTERM);
        assert!(
            status.success(),
            "docker-plugin {}: {status}\n{log}",
            node.name
        );
        assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");
    }

    for node in [x, y] {
        let SwarmNode {
            netns, shared, sb, ..
        } = node;
        shared.unmount();
        netns.delete();
        sb.assert_no_mounts_under();
        sb.assert_no_loop_devices();
        let left = processes_mentioning(sb.path());
        assert!(left.is_empty(), "processes left: {left:?}");
        drop(sb);
    }
    host.assert_restored();
    assert_eq!(
        HostNetwork::read(),
        network_before,
        "the host's network namespace changed"
    );
    assert_eq!(host_mounts_outside_temp(), mounts_before);
}
