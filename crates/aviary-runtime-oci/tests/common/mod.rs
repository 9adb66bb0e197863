//! The fixture the runtime's integration tests share: a busybox template, a
//! state dir and a stand-in envd in a temp dir under /var/tmp, checks that
//! skip (with the reason printed) on a machine that cannot run the test, and
//! a `Drop` that destroys whatever a failed test left running.
#![allow(dead_code)]

use aviary_runtime::{conformance, Runtime, TemplateRef};
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
    "ln",
    "mv",
    "base64",
];

pub struct Fixture {
    pub dir: tempfile::TempDir,
    /// A read-only busybox root file system, in the template store
    /// `templates` (as `rootfs/<digest hex>`).
    pub template: PathBuf,
    pub templates: PathBuf,
    /// How a spec names `template`.
    pub template_ref: TemplateRef,
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
    // Laid out as an `aviary-templates` store; the digest is made up (the
    // runtime only resolves it).
    let hex = "f1".repeat(32);
    let templates = dir.path().join("templates");
    let template = templates.join("rootfs").join(&hex);
    let template_ref = TemplateRef {
        name: "busybox-fixture".into(),
        digest: format!("sha256:{hex}"),
    };
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
        templates,
        template_ref,
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
        OciBinary::Runsc => ("/usr/bin/runsc", "apt-get install runsc"),
    }
}

impl Fixture {
    /// A runtime's configuration with the fixture's state dir and templates.
    pub fn config(&self, binary: OciBinary) -> OciConfig {
        OciConfig::new(binary, &self.state).with_template_store(&self.templates)
    }

    pub fn runtime(&self, binary: OciBinary) -> OciRuntime {
        OciRuntime::new(self.config(binary)).unwrap()
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
                for binary in [OciBinary::Crun, OciBinary::Runc, OciBinary::Runsc] {
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

/// Mount points at or below `dir` in this mount namespace.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let d = dir.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m == d || m.starts_with(&format!("{d}/")))
        .collect()
}
