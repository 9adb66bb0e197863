//! A real envd with its bridge, standing in for envd in a Pod: the static
//! envd (`AVIARY_ENVD`, or built once with `scripts/build-envd.sh`) started
//! here as an ordinary process with `--socket`, `--bridge 127.0.0.1:<port>`
//! and `--bridge-secret-file`, i.e. the arguments the Pod gives it, on
//! loopback instead of the Pod's address. Killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The static envd the tests start.
pub fn envd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("AVIARY_ENVD") {
        return PathBuf::from(p);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/build-envd.sh"))
        .output()
        .expect("run scripts/build-envd.sh");
    assert!(
        out.status.success(),
        "building envd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A loopback port that was free a moment ago (envd binds it itself).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct BridgeEnvd {
    child: Child,
    _dir: tempfile::TempDir,
    /// envd's `--root` (the file API's root, and the default exec cwd).
    pub root: PathBuf,
}

impl BridgeEnvd {
    /// Starts envd with its bridge on 127.0.0.1:`port`, taking `secret`.
    /// The secret file is written 0600 and removed by envd as it starts.
    pub fn start(port: u16, secret: &str) -> BridgeEnvd {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("workspace")).unwrap();
        let secret_file = dir.path().join("bridge-secret");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&secret_file)
            .unwrap();
        std::io::Write::write_all(&mut f, format!("{secret}\n").as_bytes()).unwrap();
        drop(f);
        let child = Command::new(envd_binary())
            .arg("--socket")
            .arg(dir.path().join("envd.sock"))
            .arg("--root")
            .arg(&root)
            .arg("--bridge")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--bridge-secret-file")
            .arg(&secret_file)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        BridgeEnvd {
            child,
            _dir: dir,
            root,
        }
    }
}

impl Drop for BridgeEnvd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
