//! Prometheus text metrics, kept as plain atomics: the hot paths only bump
//! counters, `/metrics` formats them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Metrics {
    creates: AtomicU64,
    destroys: AtomicU64,
    execs: AtomicU64,
}

impl Metrics {
    pub fn inc_create(&self) {
        self.creates.fetch_add(1, Ordering::Relaxed);
    }
    pub fn inc_destroy(&self) {
        self.destroys.fetch_add(1, Ordering::Relaxed);
    }
    pub fn inc_exec(&self) {
        self.execs.fetch_add(1, Ordering::Relaxed);
    }

    pub fn render(&self, live: usize) -> String {
        let mut s = String::new();
        for (name, help, kind, v) in [
            (
                "aviary_sandboxes_created_total",
                "Sandboxes created.",
                "counter",
                self.creates.load(Ordering::Relaxed),
            ),
            (
                "aviary_sandboxes_destroyed_total",
                "Sandboxes destroyed.",
                "counter",
                self.destroys.load(Ordering::Relaxed),
            ),
            (
                "aviary_execs_total",
                "Commands started.",
                "counter",
                self.execs.load(Ordering::Relaxed),
            ),
            (
                "aviary_sandboxes_live",
                "Sandboxes with running compute on this server.",
                "gauge",
                live as u64,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        s
    }
}
