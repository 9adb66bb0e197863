//! Prometheus text metrics, kept as plain atomics: the hot paths only bump
//! counters, `/metrics` formats them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Metrics {
    creates: AtomicU64,
    destroys: AtomicU64,
    execs: AtomicU64,
    connections_open: AtomicU64,
    connections_refused: AtomicU64,
    rate_limited: AtomicU64,
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

    /// A connection was accepted; pair with [`Metrics::connection_closed`].
    pub fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
    }
    pub fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
    /// A connection was refused at the connection cap.
    pub fn inc_connection_refused(&self) {
        self.connections_refused.fetch_add(1, Ordering::Relaxed);
    }
    /// A request was refused by the per-key rate limit.
    pub fn inc_rate_limited(&self) {
        self.rate_limited.fetch_add(1, Ordering::Relaxed);
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
                "aviary_http_connections_open",
                "HTTP connections open now.",
                "gauge",
                self.connections_open.load(Ordering::Relaxed),
            ),
            (
                "aviary_http_connections_refused_total",
                "HTTP connections refused at the connection cap.",
                "counter",
                self.connections_refused.load(Ordering::Relaxed),
            ),
            (
                "aviary_http_rate_limited_total",
                "Requests refused by the per-key rate limit.",
                "counter",
                self.rate_limited.load(Ordering::Relaxed),
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
