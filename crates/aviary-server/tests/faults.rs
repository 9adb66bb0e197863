//! Distributed mode under service faults, with real processes: a private
//! PostgreSQL, Redis (and s3s-fs) per test from scripts/services.sh on their
//! own ports and directory, so restarting them disturbs no other test.
//! Each test counts what must never happen and asserts the count is zero.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_config::{DistributedSettings, ServiceKind, ServiceUrl};
use aviary_core::ErrorCode;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A free loopback port (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Private services: their directory and ports; stopped on drop.
struct Services {
    dir: PathBuf,
    redis_port: u16,
    pg_port: u16,
    s3_port: u16,
}

impl Services {
    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/services.sh")
    }

    fn run(&self, what: &str) {
        let out = Command::new(Self::script())
            .arg(what)
            .env("AVIARY_SERVICES_DIR", &self.dir)
            // dockerd is shared by the whole run: a private set never starts or stops it
            .env("AVIARY_SERVICES_DOCKERD", "0")
            .env("AVIARY_REDIS_PORT", self.redis_port.to_string())
            .env("AVIARY_PG_PORT", self.pg_port.to_string())
            .env("AVIARY_S3_PORT", self.s3_port.to_string())
            .output()
            .expect("run scripts/services.sh");
        assert!(
            out.status.success(),
            "services.sh {what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts them, or `None` (loudly) where the shared ones are absent,
    /// i.e. outside scripts/test.sh, which installs what this needs.
    fn start(tag: &str) -> Option<Services> {
        if std::env::var("AVIARY_TEST_POSTGRES_URL").is_err() {
            let why = "SKIPPED: AVIARY_TEST_POSTGRES_URL not set (scripts/test.sh installs and starts the services)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            return None;
        }
        let s = Services {
            dir: PathBuf::from(format!("/tmp/aviary-faults-{tag}-{}", std::process::id())),
            redis_port: free_port(),
            pg_port: free_port(),
            s3_port: free_port(),
        };
        s.run("start");
        Some(s)
    }

    fn pg_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/aviary_test", self.pg_port)
    }

    fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.redis_port)
    }

    /// kill -9 of Redis; it comes back empty (no persistence) on `restart`.
    fn kill_redis(&self) {
        let pid = std::fs::read_to_string(self.dir.join("redis/redis.pid")).unwrap();
        let ok = Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap();
        assert!(ok.success());
        // its pid file stays; wait until the process is gone
        for _ in 0..100 {
            if !Path::new(&format!("/proc/{}", pid.trim())).exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis did not die");
    }

    fn pg_ctl(&self, args: &[&str]) {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin/pg_ctl"))
            .find(|p| p.exists())
            .expect("pg_ctl");
        let data = self.dir.join("pg/data");
        let st = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin)
            .arg("-D")
            .arg(&data)
            .args(args)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "pg_ctl {args:?}: {}",
            String::from_utf8_lossy(&st.stderr)
        );
    }

    /// Brings back whatever is down (idempotent).
    fn restart(&self) {
        self.run("start");
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        let _ = Command::new(Self::script())
            .arg("stop")
            .env("AVIARY_SERVICES_DIR", &self.dir)
            // dockerd is shared by the whole run: a private set never starts or stops it
            .env("AVIARY_SERVICES_DOCKERD", "0")
            .env("AVIARY_PG_PORT", self.pg_port.to_string())
            .output();
    }
}

fn distributed(cfg: &mut aviary_server::config::ServerConfig, s: &Services) {
    cfg.control.settings.distributed = DistributedSettings {
        registry: Some(ServiceUrl::parse(ServiceKind::Registry, &s.pg_url()).unwrap()),
        coordination: Some(ServiceUrl::parse(ServiceKind::Coordination, &s.redis_url()).unwrap()),
        schema: Some("aviary".into()),
        key_prefix: "aviary".into(),
        node_name: Some("replica-1".into()),
    };
    cfg.control.local_node = "replica-1".into();
}

fn with(token: Option<aviary_core::LeaseToken>, cmd: &str) -> aviary_core::api::ExecRequest {
    aviary_core::api::ExecRequest {
        token,
        ..common::shell(cmd)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_loses_leases_but_never_fencing() {
    let Some(services) = Services::start("redis") else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    distributed(&mut cfg, &services);
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();
    let id = common::new_sandbox(&c).await;
    let first = c.acquire_lease(&id, "agent-1", Some(300)).await.unwrap();
    c.write_file(&id, "/workspace/f", b"one".to_vec(), Some(first.token))
        .await
        .unwrap();

    services.kill_redis();
    // while Redis is down: a clear 503, never a grant
    let e = c.acquire_lease(&id, "agent-2", Some(60)).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
    let e = c
        .write_file(&id, "/workspace/f", b"during".to_vec(), Some(first.token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");

    services.restart();
    // Redis came back empty: the old lease is gone, its token is refused
    let mut stale_accepted = 0;
    let mut refused = None;
    for _ in 0..100 {
        match c
            .write_file(&id, "/workspace/f", b"stale".to_vec(), Some(first.token))
            .await
        {
            Ok(_) => stale_accepted += 1,
            Err(e) if e.code() == Some(ErrorCode::Unavailable) => {
                // the connection is still coming back
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(e) => refused = e.code(),
        }
        break;
    }
    assert_eq!(refused, Some(ErrorCode::StaleToken));
    let second = c.acquire_lease(&id, "agent-2", Some(300)).await.unwrap();
    assert!(
        second.token.fence() > first.token.fence(),
        "the fence after the restart ({}) is above the one before ({})",
        second.token.fence(),
        first.token.fence()
    );
    // no two holders: the second holder works, the first is refused
    // through every path
    c.exec(&id, &with(Some(second.token), "echo two > /workspace/f"))
        .await
        .unwrap();
    for attempt in [
        c.write_file(&id, "/workspace/f", b"stale".to_vec(), Some(first.token))
            .await
            .err(),
        c.exec(&id, &with(Some(first.token), "echo stale > /workspace/f"))
            .await
            .err(),
        c.delete_sandbox(&id, Some(first.token)).await.err(),
    ] {
        match attempt {
            None => stale_accepted += 1,
            Some(e) => assert_eq!(e.code(), Some(ErrorCode::StaleToken), "{e}"),
        }
    }
    assert_eq!(stale_accepted, 0, "stale writes accepted");
    let got = c.read_file(&id, "/workspace/f").await.unwrap();
    assert_eq!(
        got, b"two\n",
        "committed files lost = 0, stale writes landed = 0"
    );
    c.delete_sandbox(&id, Some(second.token)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_answers_503_then_recovers() {
    let Some(services) = Services::start("pg") else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    distributed(&mut cfg, &services);
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();
    let id = common::new_sandbox(&c).await;
    c.write_file(&id, "/workspace/kept", b"committed".to_vec(), None)
        .await
        .unwrap();

    services.pg_ctl(&["-m", "fast", "-w", "stop"]);
    for attempt in [
        c.get_sandbox(&id).await.err(),
        c.list_sandboxes(false).await.err(),
        c.create_sandbox(&Default::default()).await.err(),
    ] {
        let e = attempt.expect("no answer without the registry");
        assert_eq!(e.code(), Some(ErrorCode::Unavailable), "{e}");
    }

    services.restart();
    let mut back = false;
    for _ in 0..200 {
        if c.get_sandbox(&id).await.is_ok() {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "requests work again once PostgreSQL is back");
    let got = c.read_file(&id, "/workspace/kept").await.unwrap();
    assert_eq!(got, b"committed", "committed files lost = 0");
    let lease = c.acquire_lease(&id, "agent", Some(60)).await.unwrap();
    c.exec(&id, &with(Some(lease.token), "true")).await.unwrap();
    c.delete_sandbox(&id, Some(lease.token)).await.unwrap();
}
