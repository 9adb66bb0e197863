//! Prometheus text metrics, kept as plain atomics: the hot paths only bump
//! counters, `/metrics` formats them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the reconciler did (`aviary_reconciler_actions_total{action=...}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReconcileAction {
    /// A live sandbox whose compute is gone (or whose node stopped
    /// answering) was marked `Lost`.
    Lost,
    /// A lost sandbox was recreated from its last snapshot.
    Recovered,
    /// A lost user-managed sandbox without a snapshot got new compute from
    /// its template (its data is gone).
    Recreated,
    /// A lost sandbox whose node answers again, compute intact, was
    /// attached again.
    Reattached,
    /// A lost sandbox has nothing to be recovered from: it stays `Lost`.
    Unrecoverable,
    /// A recovery from a snapshot was tried and failed (the sandbox is `Failed`).
    RecoveryFailed,
    /// A pooled (tenant-less) sandbox that died was destroyed.
    PooledDestroyed,
    /// Compute the registry does not know was destroyed after the grace.
    OrphanDestroyed,
    /// A node agent stopped answering for longer than allowed.
    NodeUnhealthy,
    /// An unhealthy node agent answers again.
    NodeHealthy,
}

impl ReconcileAction {
    pub const ALL: [ReconcileAction; 10] = [
        ReconcileAction::Lost,
        ReconcileAction::Recovered,
        ReconcileAction::Recreated,
        ReconcileAction::Reattached,
        ReconcileAction::Unrecoverable,
        ReconcileAction::RecoveryFailed,
        ReconcileAction::PooledDestroyed,
        ReconcileAction::OrphanDestroyed,
        ReconcileAction::NodeUnhealthy,
        ReconcileAction::NodeHealthy,
    ];

    /// The `action` label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReconcileAction::Lost => "lost",
            ReconcileAction::Recovered => "recovered",
            ReconcileAction::Recreated => "recreated",
            ReconcileAction::Reattached => "reattached",
            ReconcileAction::Unrecoverable => "unrecoverable",
            ReconcileAction::RecoveryFailed => "recovery_failed",
            ReconcileAction::PooledDestroyed => "pooled_destroyed",
            ReconcileAction::OrphanDestroyed => "orphan_destroyed",
            ReconcileAction::NodeUnhealthy => "node_unhealthy",
            ReconcileAction::NodeHealthy => "node_healthy",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Default)]
pub struct Metrics {
    reconciler: [AtomicU64; ReconcileAction::ALL.len()],
    reconcile_passes: AtomicU64,
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

    /// One action of the reconciler.
    pub fn inc_reconcile(&self, action: ReconcileAction) {
        self.reconciler[action.index()].fetch_add(1, Ordering::Relaxed);
    }
    /// One reconciler pass ran to its end.
    pub fn inc_reconcile_pass(&self) {
        self.reconcile_passes.fetch_add(1, Ordering::Relaxed);
    }
    /// How often the reconciler did `action` in this process.
    pub fn reconcile_count(&self, action: ReconcileAction) -> u64 {
        self.reconciler[action.index()].load(Ordering::Relaxed)
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
        let name = "aviary_reconciler_passes_total";
        let _ = writeln!(
            s,
            "# HELP {name} Reconciler passes run to their end.\n# TYPE {name} counter\n{name} {}",
            self.reconcile_passes.load(Ordering::Relaxed)
        );
        let name = "aviary_reconciler_actions_total";
        let _ = writeln!(
            s,
            "# HELP {name} What the reconciler did, by action.\n# TYPE {name} counter"
        );
        for action in ReconcileAction::ALL {
            let _ = writeln!(
                s,
                "{name}{{action=\"{}\"}} {}",
                action.as_str(),
                self.reconcile_count(action)
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciler_actions_render_one_labelled_counter_each() {
        for (i, a) in ReconcileAction::ALL.into_iter().enumerate() {
            assert_eq!(a.index(), i, "{a:?} is out of place in ALL");
        }
        let m = Metrics::default();
        m.inc_reconcile(ReconcileAction::Recovered);
        m.inc_reconcile(ReconcileAction::Recovered);
        m.inc_reconcile(ReconcileAction::OrphanDestroyed);
        m.inc_reconcile_pass();
        let text = m.render(0);
        assert!(text.contains("# TYPE aviary_reconciler_actions_total counter\n"));
        assert!(text.contains("aviary_reconciler_actions_total{action=\"recovered\"} 2\n"));
        assert!(text.contains("aviary_reconciler_actions_total{action=\"orphan_destroyed\"} 1\n"));
        assert!(text.contains("aviary_reconciler_actions_total{action=\"node_unhealthy\"} 0\n"));
        assert!(text.contains("aviary_reconciler_passes_total 1\n"));
    }
}
