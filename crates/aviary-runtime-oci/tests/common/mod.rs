//! The fixture the runtime's integration tests share: a busybox template, a
//! state dir and a stand-in envd in a temp dir under /var/tmp, checks that
//! skip (with the reason printed) on a machine that cannot run the test, and
//! a `Drop` that destroys whatever a failed test left running.
#![allow(dead_code)]

use aviary_runtime::{conformance, Runtime};
use aviary_runtime_oci::{OciBinary, OciConfig, OciRuntime};
use std::path::{Path, PathBuf};

/// The busybox applets any of the tests run inside a sandbox.
pub const APPLETS: &[&str] = &[
    "sh",
    "sleep",
    "cat",
    "ls",
    "ip",
    "hostname",
    "grep",
    "wc",
    "echo",
    "true",
    "false",
    "id",
    "touch",
    "mkdir",
    "rm",
    "head",
    "tail",
    "dd",
    "mount",
    "unshare",
    "nc",
    "ping",
    "stat",
    "sed",
    "awk",
    "env",
    "kill",
    "seq",
    "chown",
    "chmod",
    "df",
    "find",
    "sha256sum",
    "tr",
    "cut",
    "sync",
];

pub struct Fixture {
    pub dir: tempfile::TempDir,
    /// A read-only busybox root file system.
    pub template: PathBuf,
    pub state: PathBuf,
    /// A shell script bind-mounted where envd would be.
    pub envd: PathBuf,
}

/// `None`, with the reason printed, when this machine cannot run the test:
/// not root, or a host path in `needs` (with the command that installs it)
/// is missing. `what` names the suite in the message and the temp dir.
pub fn fixture(what: &str, needs: &[(&str, &str)]) -> Option<Fixture> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIP: the {what} tests need root (mounts, cgroups, loop devices)");
        return None;
    }
    for (path, install) in needs
        .iter()
        .chain([("/bin/busybox", "apt-get install busybox-static")].iter())
    {
        if !Path::new(path).exists() {
            eprintln!("SKIP: {path} missing ({install})");
            return None;
        }
    }
    let dir = tempfile::Builder::new()
        .prefix(&format!("aviary-{what}-"))
        .tempdir_in("/var/tmp")
        .unwrap();
    let template = dir.path().join("template");
    let bin = template.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for d in ["etc", "proc", "sys", "dev", "tmp", "root", "srv"] {
        std::fs::create_dir_all(template.join(d)).unwrap();
    }
    std::fs::write(
        template.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(template.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", bin.join(a)).unwrap();
    }
    let envd = dir.path().join("fake-envd");
    std::fs::write(&envd, "#!/bin/sh\necho envd\n").unwrap();
    let state = dir.path().join("state");
    Some(Fixture {
        template,
        state,
        envd,
        dir,
    })
}

/// What `fixture` needs for one OCI runtime binary.
pub fn binary_needs(binary: OciBinary) -> (&'static str, &'static str) {
    match binary {
        OciBinary::Crun => ("/usr/bin/crun", "apt-get install crun"),
        OciBinary::Runc => ("/usr/bin/runc", "apt-get install runc"),
    }
}

impl Fixture {
    pub fn runtime(&self, binary: OciBinary) -> OciRuntime {
        OciRuntime::new(OciConfig::new(binary, &self.state)).unwrap()
    }
}

impl Drop for Fixture {
    /// A failed test must not leave sandboxes, mounts or loop devices on the
    /// host: destroy whatever is left in the state dir, for both binaries.
    fn drop(&mut self) {
        let state = self.state.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for binary in [OciBinary::Crun, OciBinary::Runc] {
                    if !state.exists() {
                        return;
                    }
                    let oci = OciRuntime::new(OciConfig::new(binary, &state)).unwrap();
                    for id in oci.list().await.unwrap() {
                        if let Err(e) = oci.destroy(&id).await {
                            eprintln!("fixture cleanup of {id}: {}", conformance::chain(&e));
                        }
                    }
                }
            });
        })
        .join()
        .unwrap();
    }
}
