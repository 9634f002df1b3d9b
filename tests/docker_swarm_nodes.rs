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
//! Two tests. In the first each node's docker-plugin manages its own bundled plugin, which keeps
//! its own volumes, so the volume Y's task gets is another one with the same name: it proves the
//! scheduling and the cleanup (every namespace, veth, dockerd, mount and process gone, the host's
//! network and mounts as before). In the second the bundled plugin runs as a small multi-node
//! driver: one `--mode controller` plugin whose work dir holds the volumes, one `--mode node`
//! plugin per node (`--node-id node-x|node-y`, `--shared-dir` the controller's work dir), and each
//! node's docker-plugin drives its node plugin (`--plugin-endpoint`) and the controller
//! (`--controller-endpoint`) with no unpublish delay: the task on X appends to a file in the
//! volume, X is drained, the last Unmount on X unpublishes (ControllerUnpublish for node-x), the
//! task on Y appends to the same file, and the controller lists the volume published to node-x,
//! then node-y, then none; `volume rm` deletes it at the controller.
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
    mount_points_under, plugin_bin, processes_mentioning, recorded_volumes, require_root,
    DockerPluginProcess, PluginProcess, Sandbox,
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

/// The two nodes, X (10.213.0.1) and Y (10.213.0.2), their namespaces joined by a veth pair.
fn two_nodes() -> (SwarmNode, SwarmNode) {
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
    (x, y)
}

/// Gives both dockerds `image` and a look at their plugins, checks each has its own engine ID
/// and offers `driver`, makes X a manager (`swarm init` on its veth address) and Y a worker,
/// and waits until both are Ready and offer the driver to Swarm: the node ids of X and Y.
fn form_swarm(
    nodes: [(&SwarmNode, &Dockerd); 2],
    driver: &str,
    image: &str,
    logs: &dyn Fn() -> String,
) -> (String, String) {
    let [(x, ex), (y, ey)] = nodes;
    // Each dockerd has its own engine ID (its own /etc/docker).
    assert_ne!(
        ex.ok(&["info", "--format", "{{.ID}}"]),
        ey.ok(&["info", "--format", "{{.ID}}"])
    );
    let tar = busybox_tar(&x.sb);
    for e in [ex, ey] {
        SwarmNode::import_image(e, &tar, image);
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
    let (idx, idy) = (node_id(ex), node_id(ey));
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
    (idx, idy)
}

/// Creates `service` on the manager `m`: one task of `image` running `script` with the volume
/// `volume` of `driver` (16 MiB) at /data.
fn create_service(
    m: &Dockerd,
    service: &str,
    volume: &str,
    driver: &str,
    image: &str,
    script: &str,
) {
    m.ok(&[
        "service",
        "create",
        "--detach",
        "--name",
        service,
        "--no-resolve-image",
        "--stop-grace-period",
        "1s",
        "--restart-delay",
        "1s",
        "--mount",
        &format!(
            "type=volume,source={volume},target=/data,volume-driver={driver},volume-opt=size=16M"
        ),
        image,
        "sh",
        "-c",
        script,
    ]);
}

/// Waits until the manager `m` has a task of `service` running on `node`. A task that failed or
/// was rejected fails the test at once, unless its error contains `refused` (the attempts a
/// node makes while another one still holds the volume): how many such attempts there were.
fn wait_running(
    m: &Dockerd,
    node: &str,
    service: &str,
    refused: Option<&str>,
    logs: &dyn Fn() -> String,
) -> usize {
    wait_for(
        &format!("a task of {service} runs on node {node}"),
        || {
            let states = m.ok(&[
                "node",
                "ps",
                "--no-trunc",
                "--filter",
                &format!("name={service}"),
                "--format",
                "{{.DesiredState}}|{{.CurrentState}}|{{.Error}}",
                node,
            ]);
            let mut tolerated = 0;
            for l in states.lines() {
                let failed = l.contains("|Failed") || l.contains("|Rejected");
                let allowed = refused.is_some_and(|r| l.contains(r));
                assert!(
                    !failed || allowed,
                    "a task failed: {l}\n{states}\n{}",
                    logs()
                );
                tolerated += usize::from(failed);
            }
            match states.lines().any(|l| l.starts_with("Running|Running")) {
                true => Ok(tolerated),
                false => Err(states),
            }
        },
        logs,
    )
}

/// Waits until nothing is mounted under `plugin`'s work dir any more.
fn wait_unpublished(what: &str, plugin: &DockerPluginProcess, logs: &dyn Fn() -> String) {
    wait_for(
        what,
        || match mount_points_under(&plugin.work) {
            m if m.is_empty() => Ok(()),
            m => Err(format!("{m:?}")),
        },
        logs,
    );
}

/// Waits until `e`'s node runs no container of `service`.
fn wait_no_task(what: &str, e: &Dockerd, service: &str, logs: &dyn Fn() -> String) {
    wait_for(
        what,
        || match task_containers(e, service) {
            c if c.is_empty() => Ok(()),
            c => Err(format!("{c:?}")),
        },
        logs,
    );
}

/// After `service rm`: removes the service's stopped containers on both nodes (they hold the
/// volume's name), then the volume on Y and on X.
fn remove_volume(nodes: [&Dockerd; 2], service: &str, volume: &str) {
    for e in nodes.iter().rev() {
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
}

/// Y leaves, X leaves (the last manager: `--force`), both drop `image`.
fn leave_swarm(ex: &Dockerd, ey: &Dockerd, image: &str) {
    ey.ok(&["swarm", "leave"]);
    ex.ok(&["swarm", "leave", "--force"]);
    for e in [ex, ey] {
        assert_eq!(
            e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
            "inactive"
        );
        e.ok(&["rmi", image]);
    }
}

/// Stops a node's docker-plugin (SIGTERM; it must exit 0) and checks its work dir records no
/// volume any more.
fn stop_plugin(node: &SwarmNode, plugin: DockerPluginProcess) {
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

/// Tears a node's namespace and shared dir down and checks its sandbox holds no mount, loop
/// device or process.
fn finish_node(node: SwarmNode) {
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

    let (x, y) = two_nodes();
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
    let image = format!("csi-isolator-test/busybox:{id}");
    let (idx, idy) = form_swarm([(&x, &ex), (&y, &ey)], &driver, &image, &logs);

    // Y paused: the task can only go to X.
    ex.ok(&["node", "update", "--availability", "pause", &idy]);
    let service = format!("csi2n-{id}");
    let volume = "swarmvol";
    create_service(
        &ex,
        &service,
        volume,
        &driver,
        &image,
        "echo run >> /data/f; sleep 3600",
    );
    wait_running(&ex, &idx, &service, None, &logs);
    assert_eq!(task_containers(&ex, &service).len(), 1);
    assert_eq!(task_containers(&ey, &service), Vec::<String>::new());
    assert_eq!(
        wait_for("X's task writes", || written(&ex, volume, &plugin_x), logs),
        "run\n"
    );
    assert_eq!(ex.volume_status(volume)["state"], "PUBLISHED");

    // Drain X with Y active: the task is shut down on X (Docker's Unmount: the last use
    // unpublishes X's volume) and its replacement runs on Y.
    ex.ok(&["node", "update", "--availability", "active", &idy]);
    ex.ok(&["node", "update", "--availability", "drain", &idx]);
    wait_running(&ex, &idy, &service, None, &logs);
    wait_no_task("X's task container goes", &ex, &service, &logs);
    wait_unpublished("X's volume is unpublished", &plugin_x, &logs);
    assert_eq!(task_containers(&ey, &service).len(), 1);
    // Y's task got a volume of Y's plugin: its own, not X's data (that needs one controller).
    assert_eq!(
        wait_for("Y's task writes", || written(&ey, volume, &plugin_y), logs),
        "run\n"
    );
    assert_eq!(ey.volume_status(volume)["state"], "PUBLISHED");
    assert_eq!(ex.volume_status(volume)["state"], "CREATED");

    // Remove the service: Y's task goes and Y's volume is unpublished.
    ex.ok(&["service", "rm", &service]);
    wait_no_task("Y's task container goes", &ey, &service, &logs);
    wait_unpublished("Y's volume is unpublished", &plugin_y, &logs);
    remove_volume([&ex, &ey], &service, volume);
    leave_swarm(&ex, &ey, &image);
    drop(reap_y);
    drop(reap_x);
    ey.stop(&y.sb);
    ex.stop(&x.sb);
    stop_plugin(&x, plugin_x);
    stop_plugin(&y, plugin_y);
    finish_node(x);
    finish_node(y);
    host.assert_restored();
    assert_eq!(
        HostNetwork::read(),
        network_before,
        "the host's network namespace changed"
    );
    assert_eq!(host_mounts_outside_temp(), mounts_before);
}

use csi_isolator_testing::block_on;

/// The node ids the controller plugin `ctl` lists its volume as published to, sorted (the
/// test makes one volume); `None` when it lists none.
fn published_nodes(ctl: &PluginProcess) -> Option<Vec<String>> {
    let entries = block_on(ctl.listed());
    assert!(entries.len() <= 1, "the controller lists {entries:?}");
    let entry = entries.into_iter().next()?;
    let mut nodes = entry
        .status
        .map(|s| s.published_node_ids)
        .unwrap_or_default();
    nodes.sort();
    Some(nodes)
}

#[test]
fn a_service_drained_from_node_x_reads_on_node_y_what_it_wrote_on_x_through_one_controller() {
    require_root();
    require_engine("dockerd", "docker.io");
    require_namespace_tools();
    let id = unique();
    let driver = format!("csi2n-{id}");
    let host = HostPaths::claim(DOCKER_HOST_PATHS);
    let network_before = HostNetwork::read();
    let mounts_before = host_mounts_outside_temp();

    let (x, y) = two_nodes();
    // One controller plugin for the cluster, its volumes in its work dir, which both nodes'
    // plugins reach at the same path (the host's file system); a node plugin per node.
    let ctl_sb = Sandbox::new("sw-c");
    let ctl = block_on(PluginProcess::start_named(
        &ctl_sb,
        "ctl",
        plugin_bin(),
        &["--mode", "controller"],
    ));
    let shared = ctl.work_dir().display().to_string();
    let node_plugin = |node: &SwarmNode, node_id: &str| {
        block_on(PluginProcess::start_named(
            &node.sb,
            "np",
            plugin_bin(),
            &[
                "--mode",
                "node",
                "--node-id",
                node_id,
                "--shared-dir",
                &shared,
            ],
        ))
    };
    let np_x = node_plugin(&x, "node-x");
    let np_y = node_plugin(&y, "node-y");
    let ctl_endpoint = ctl.endpoint();
    let plugin_x = x.start_plugin(
        BIN,
        &driver,
        &[
            "--plugin-endpoint",
            &np_x.endpoint(),
            "--controller-endpoint",
            &ctl_endpoint,
        ],
    );
    let plugin_y = y.start_plugin(
        BIN,
        &driver,
        &[
            "--plugin-endpoint",
            &np_y.endpoint(),
            "--controller-endpoint",
            &ctl_endpoint,
        ],
    );
    let ex = x.start_dockerd();
    let reap_x = RemoveTasks(&ex);
    let ey = y.start_dockerd();
    let reap_y = RemoveTasks(&ey);
    let logs = || {
        format!(
            "dockerd x:\n{}\ndockerd y:\n{}\ndocker-plugin x:\n{}\ndocker-plugin y:\n{}\n\
             controller plugin:\n{}\nnode plugin x:\n{}\nnode plugin y:\n{}",
            ex.log(),
            ey.log(),
            plugin_x.log(),
            plugin_y.log(),
            ctl.stderr(),
            np_x.stderr(),
            np_y.stderr()
        )
    };
    let image = format!("csi-isolator-test/busybox:{id}");
    let (idx, idy) = form_swarm([(&x, &ex), (&y, &ey)], &driver, &image, &logs);

    ex.ok(&["node", "update", "--availability", "pause", &idy]);
    let service = format!("csi2n-{id}");
    let volume = "swarmvol";
    create_service(
        &ex,
        &service,
        volume,
        &driver,
        &image,
        "echo run >> /data/f; sleep 3600",
    );
    wait_running(&ex, &idx, &service, None, &logs);
    assert_eq!(
        wait_for("X's task writes", || written(&ex, volume, &plugin_x), logs),
        "run\n"
    );
    assert_eq!(
        published_nodes(&ctl),
        Some(vec!["node-x".to_string()]),
        "{}",
        logs()
    );

    // Drain X: its task stops, X's docker-plugin unpublishes the volume at its last Unmount
    // (ControllerUnpublish for node-x), and the task on Y gets the same volume. Y's attempts
    // while X still holds it are refused naming node-x (the controller's FAILED_PRECONDITION);
    // Swarm retries them.
    ex.ok(&["node", "update", "--availability", "active", &idy]);
    ex.ok(&["node", "update", "--availability", "drain", &idx]);
    let refused = wait_running(&ex, &idy, &service, Some("node-x"), &logs);
    eprintln!("Y's attempts refused while X held the volume: {refused}");
    wait_no_task("X's task container goes", &ex, &service, &logs);
    wait_unpublished("X's volume is unpublished", &plugin_x, &logs);
    // Y's task appended to what X's wrote: the same data.
    assert_eq!(
        wait_for(
            "Y's task writes",
            || match written(&ey, volume, &plugin_y) {
                Ok(s) if s.lines().count() >= 2 => Ok(s),
                Ok(s) => Err(format!("only {s:?}")),
                Err(e) => Err(e),
            },
            logs
        ),
        "run\nrun\n"
    );
    assert_eq!(
        published_nodes(&ctl),
        Some(vec!["node-y".to_string()]),
        "{}",
        logs()
    );

    ex.ok(&["service", "rm", &service]);
    wait_no_task("Y's task container goes", &ey, &service, &logs);
    wait_unpublished("Y's volume is unpublished", &plugin_y, &logs);
    assert_eq!(published_nodes(&ctl), Some(Vec::new()), "{}", logs());
    remove_volume([&ex, &ey], &service, volume);
    assert_eq!(published_nodes(&ctl), None, "{}", logs());
    leave_swarm(&ex, &ey, &image);
    drop(reap_y);
    drop(reap_x);
    ey.stop(&y.sb);
    ex.stop(&x.sb);
    stop_plugin(&x, plugin_x);
    stop_plugin(&y, plugin_y);
    drop(np_x);
    drop(np_y);
    drop(ctl);
    ctl_sb.assert_no_mounts_under();
    ctl_sb.assert_no_loop_devices();
    drop(ctl_sb);
    finish_node(x);
    finish_node(y);
    host.assert_restored();
    assert_eq!(
        HostNetwork::read(),
        network_before,
        "the host's network namespace changed"
    );
    assert_eq!(host_mounts_outside_temp(), mounts_before);
}
