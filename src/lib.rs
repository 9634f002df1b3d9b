//! csi-isolator: makes CSI volumes usable by containers.
//!
//! The library holds all logic; the binary in `src/bin/` only parses arguments, sets up logging
//! and maps errors to exit codes. The workspace's other crates build on it and the library never
//! links them: `crates/csi-test-plugin` (the bundled CSI plugin, its own binary) and
//! `crates/testing` (`csi_isolator_testing`, the scaffolding only tests use).
//!
//! Concerns, one module each:
//! - [`resource`]: the Mesos `Resource` model and its mount-point rules.
//! - [`csi`]: the CSI v1 gRPC client (and the generated protocol types).
//! - [`mount`]: every mount syscall, behind one seam.
//! - [`provider`]: resource providers and the volume state machine.
//! - [`isolator`]: prepare / isolate / update / cleanup / recover.
//! - [`launcher`]: the namespace launcher used by `run` and the tests.
//! - [`service`]: `serve`, the isolator as a gRPC service on a Unix socket, with metrics.
//! - [`docker_plugin`]: `docker-plugin`, the Docker (and Podman) volume plugin protocol.
//!
//! Layers, lowest first; a module imports only from lower layers, never from its own or a higher one,
//! so the module graph has no cycle (the `layers_import_only_downward` test checks it):
//! 1. [`shown`], [`error_chain`], [`io_step`], `offload`, `phases`, [`memory`], [`sorted`]:
//!    formatting helpers, the shared I/O-step error, the one way blocking work leaves the async
//!    workers, the timing of a long step's phases for its log line, the process's own memory
//!    (allocator set-up, resident sizes) and the small sorted collections records keep by the
//!    thousand, importing nothing.
//! 2. [`resource`]: the resource model and its syntax (including `--volume` and sizes).
//! 3. [`mount`] (with the description of a volume's bind into a container, which both the isolator
//!    and the launcher use), [`workdir`], [`durable`] (the one atomic file write), [`csi`].
//! 4. [`provider`].
//! 5. [`launcher`]: namespaces and processes (launching, facts about a pid, binds into a running one).
//! 6. [`isolator`]: the lifecycle, using the provider to publish and the launcher to reach containers.
//! 7. [`runner`], [`service`]: the front ends.
//! 8. [`docker_plugin`]: a front end built on `serve`'s socket, admission and accept gate.

pub mod csi;
pub mod docker_plugin;
pub mod durable;
pub mod error_chain;
pub mod io_step;
pub mod isolator;
pub mod launcher;
pub mod memory;
pub mod mount;
mod offload;
mod phases;
pub mod provider;
pub mod resource;
pub mod runner;
pub mod service;
pub mod shown;
pub mod sorted;
pub mod workdir;

#[cfg(test)]
mod layering {
    use std::path::Path;

    /// Each module's layer (see the crate doc); a module may import only from lower layers.
    const LAYERS: &[(&str, u8)] = &[
        ("shown", 1),
        ("error_chain", 1),
        ("io_step", 1),
        ("offload", 1),
        ("phases", 1),
        ("memory", 1),
        ("sorted", 1),
        ("resource", 2),
        ("mount", 3),
        ("workdir", 3),
        ("durable", 3),
        ("csi", 3),
        ("provider", 4),
        ("launcher", 5),
        ("isolator", 6),
        ("runner", 7),
        ("service", 7),
        ("docker_plugin", 8),
    ];

    fn layer(module: &str) -> u8 {
        LAYERS
            .iter()
            .find(|(name, _)| *name == module)
            .map(|(_, layer)| *layer)
            .unwrap_or_else(|| panic!("module {module} has no layer in LAYERS"))
    }

    /// Every `crate::<module>` a file names, its tests included. (The workspace's other crates
    /// need no check here: the library does not depend on the plugin's crate at all, and the
    /// scaffolding is only a dev-dependency.)
    fn arrows(text: &str) -> Vec<String> {
        let mut found = Vec::new();
        for line in text.lines() {
            let mut rest = line;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    found.push(name);
                }
            }
        }
        found
    }

    fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn layers_import_only_downward() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut upward = Vec::new();
        for file in files {
            let rel = file.strip_prefix(&src).expect("under src");
            let first = rel.components().next().expect("a component");
            let module = first.as_os_str().to_string_lossy();
            let module = module.trim_end_matches(".rs");
            if module == "bin" || module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&file).expect("read source");
            for target in arrows(&text) {
                if target == module {
                    continue;
                }
                if layer(&target) >= layer(module) {
                    upward.push(format!("{} -> {target}", rel.display()));
                }
            }
        }
        assert!(upward.is_empty(), "upward imports: {upward:#?}");
    }
}
