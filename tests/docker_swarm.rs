//! `csi-isolator docker-plugin` serving a Docker Swarm service (issue 12): a single-node swarm
//! whose task mounts a volume of the plugin's driver through `--mount
//! type=volume,volume-driver=D`, the way every node of a cluster runs it (Docker 20.10 has no
//! Swarm cluster volumes: a legacy socket plugin serves the tasks of its own node).
//!
//! Swarm makes bridges (`docker_gwbridge`, the ingress network's) with addresses in dockerd's
//! network namespace, so the test never runs it in the host's (`../shared/ENGINES.md`): it makes
//! a network namespace of its own, pinned on a file in its sandbox (`unshare --net=FILE`; `ip
//! netns add` would add mounts at `/run/netns` that other tests see in the host's mount table),
//! starts a private dockerd in it with `nsenter --net=FILE` ([`Dockerd::start_in_netns`]) and
//! reaches it over its Unix socket, as it reaches the plugin's socket in `/run/docker/plugins`
//! (sockets are files: the namespace does not hide them). After the swarm is left and dockerd
//! stopped, the namespace is deleted however the test ends ([`NetNs`] is a drop guard; a failing
//! test also removes its services and containers first, [`RemoveTasks`]), and the test checks
//! that nothing is left and that the host's network is as it was: the same interfaces and
//! addresses, the same `ip_forward`, the same firewall rules (`iptables-save`, `nft list
//! ruleset`, when installed).
//!
//! Runs under the machine-wide engine-test lock (`HostPaths`) and in the `docker-engine` test
//! group. Needs root, `dockerd`, `ip` (iproute2), `unshare` and `nsenter`: without them it fails,
//! it never skips.

use std::path::Path;

use csi_isolator_testing::engines::{
    require_engine, unique, Dockerd, EngineCli, HostPaths, DOCKER_HOST_PATHS, DOCKER_PLUGINS_DIR,
};
use csi_isolator_testing::swarm::{
    require_namespace_tools, wait_for, HostNetwork, NetNs, RemoveTasks,
};
use csi_isolator_testing::{
    mount_points_under, processes_mentioning, recorded_volumes, require_root, DockerPluginProcess,
    Sandbox,
};
use nix::sys::signal::Signal;

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");

#[test]
fn a_swarm_service_task_writes_into_a_volume_of_the_driver_and_the_host_network_is_untouched() {
    require_root();
    require_engine("dockerd", "docker.io");
    require_namespace_tools();
    let id = unique();
    let driver = format!("csi-isolator-test-{id}");
    let mut host = HostPaths::claim(DOCKER_HOST_PATHS);
    let network_before = HostNetwork::read();
    let socket = Path::new(DOCKER_PLUGINS_DIR).join(format!("{driver}.sock"));
    host.remove_at_end(&socket);
    let sb = Sandbox::new("swarm");
    let netns = NetNs::add(&sb.join("netns"));
    let plugin = DockerPluginProcess::start(&sb, BIN, &sb.join("work"), &socket, &[]);
    let e = Dockerd::start_in_netns(&sb, netns.path());
    let in_netns = netns.processes();
    assert!(
        in_netns.contains(&e.pid()),
        "dockerd {} is not in netns {}: {in_netns:?}",
        e.pid(),
        netns.path().display()
    );
    let reap = RemoveTasks(&e);
    let image = e.import_busybox(&sb);
    let logs = || format!("dockerd:\n{}\ndocker-plugin:\n{}", e.log(), plugin.log());

    // Swarm places a task only on a node whose description lists its volume driver, and dockerd
    // lists a socket plugin only once something made it look in /run/docker/plugins (moby#32380:
    // the task stays Pending with "missing plugin"). `volume ls` asks every plugin there.
    e.ok(&["volume", "ls"]);
    let drivers = e.ok(&["info", "--format", "{{json .Plugins.Volume}}"]);
    assert!(drivers.contains(&format!("\"{driver}\"")), "{drivers}");
    e.ok(&[
        "swarm",
        "init",
        "--advertise-addr",
        "127.0.0.1",
        "--listen-addr",
        "127.0.0.1:2377",
    ]);
    assert_eq!(
        e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
        "active"
    );
    let described = e.ok(&[
        "node",
        "inspect",
        "self",
        "--format",
        "{{json .Description.Engine.Plugins}}",
    ]);
    assert!(
        described.contains(&format!("\"Type\":\"Volume\",\"Name\":\"{driver}\"")),
        "the node does not offer the driver: {described}"
    );

    let service = format!("csi-swarm-{id}");
    let volume = "swarmvol";
    e.ok(&[
        "service",
        "create",
        "--detach",
        "--name",
        &service,
        "--no-resolve-image",
        "--restart-condition",
        "none",
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
        "the task runs",
        || {
            let states = e.ok(&[
                "service",
                "ps",
                "--no-trunc",
                "--format",
                "{{.CurrentState}}|{{.Error}}",
                &service,
            ]);
            let failed = states
                .lines()
                .find(|l| l.starts_with("Failed") || l.starts_with("Rejected"));
            assert!(failed.is_none(), "the task failed: {states}\n{}", logs());
            match states.lines().any(|l| l.starts_with("Running")) {
                true => Ok(()),
                false => Err(states),
            }
        },
        logs,
    );

    // Docker made the volume through the plugin (its driver; the plugin's record, published for
    // one Mount ID, 16 MiB).
    assert_eq!(
        e.ok(&[
            "volume",
            "inspect",
            "--format",
            "{{.Driver}} {{.Scope}}",
            volume
        ]),
        format!("{driver} local")
    );
    let status = e.volume_status(volume);
    assert_eq!(status["capacity_bytes"], 16 << 20, "{status}");
    assert_eq!(
        status["users"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    assert_eq!(status["state"], "PUBLISHED", "{status}");

    // The task wrote into the plugin's mount, and a plain container reads it back.
    let mountpoint = e.ok(&["volume", "inspect", "--format", "{{.Mountpoint}}", volume]);
    assert!(
        Path::new(&mountpoint).starts_with(&plugin.work),
        "mount point {mountpoint} is not under the plugin's work dir"
    );
    let written = wait_for(
        "the task writes",
        || match std::fs::read_to_string(Path::new(&mountpoint).join("f")) {
            Ok(s) if !s.is_empty() => Ok(s),
            Ok(_) => Err("an empty file".to_string()),
            Err(e) => Err(e.to_string()),
        },
        logs,
    );
    assert_eq!(written, "from-swarm\n");
    assert_eq!(
        e.ok(&[
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            &format!("{volume}:/data"),
            &image,
            "cat",
            "/data/f",
        ]),
        "from-swarm"
    );

    // Removing the service stops and removes its task's container: Docker sends its Unmount and
    // the last use unpublishes the volume.
    e.ok(&["service", "rm", &service]);
    let label = format!("label=com.docker.swarm.service.name={service}");
    wait_for(
        "the task's container goes",
        || match e.ok(&["ps", "-a", "--filter", &label]) {
            ps if ps.lines().count() <= 1 => Ok(()),
            ps => Err(ps),
        },
        logs,
    );
    wait_for(
        "the volume is unpublished",
        || match mount_points_under(&plugin.work) {
            mounts if mounts.is_empty() => Ok(()),
            mounts => Err(format!("{mounts:?}")),
        },
        logs,
    );
    e.ok(&["volume", "rm", volume]);
    assert_eq!(
        e.ok(&[
            "volume",
            "ls",
            "-q",
            "--filter",
            &format!("driver={driver}")
        ]),
        ""
    );
    e.ok(&["swarm", "leave", "--force"]);
    assert_eq!(
        e.ok(&["info", "--format", "{{.Swarm.LocalNodeState}}"]),
        "inactive"
    );
    e.ok(&["rmi", &image]);
    drop(reap);
    e.stop(&sb);

    let work = plugin.work.clone();
    let log = plugin.log();
    let status = plugin.stop(&sb, Signal::SIGTERM);
    assert!(status.success(), "docker-plugin: {status}\n{log}");
    // DeleteVolume ran: the work dir records no volume any more.
    assert_eq!(recorded_volumes(BIN, &work), Vec::<String>::new(), "{log}");

    netns.delete();
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
    let left = processes_mentioning(sb.path());
    assert!(left.is_empty(), "processes left: {left:?}");
    drop(sb);
    host.assert_restored();
    assert_eq!(
        HostNetwork::read(),
        network_before,
        "the host's network namespace changed"
    );
}
