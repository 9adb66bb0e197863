//! The control plane's metrics on the `prometheus-client` crate: counters,
//! gauges and per-route latency histograms in one registry, encoded as
//! OpenMetrics text for `/metrics`. The hot paths only bump atomics.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use time::OffsetDateTime;

/// How many samples the metrics history keeps (an hour at the default
/// 10 s interval).
pub const HISTORY_LEN: usize = 360;

/// One point of the server's metrics history: the figures the console's
/// charts draw, as they stood at `at`. Counters are totals since the server
/// started; a chart takes differences between points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricsSample {
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub at: OffsetDateTime,
    /// Sandboxes with running compute on this server.
    pub live: u64,
    /// The registry's sandboxes by state (terminated ones not counted).
    pub by_state: BTreeMap<String, u64>,
    /// Creates answered 2xx (`POST /v1/sandboxes`) and their summed latency.
    pub creates_served: u64,
    pub create_seconds_sum: f64,
    /// Creates served from a warm pool, and creates that found it empty.
    pub pool_hits: u64,
    pub pool_misses: u64,
}

/// `GET /v1/metrics/history`: the newest samples, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricsHistory {
    /// How often a sample is taken.
    pub interval_ms: u64,
    pub samples: Vec<MetricsSample>,
}

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

    #[cfg(test)]
    fn index(self) -> usize {
        self as usize
    }
}

/// Labels of one pool's metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub class: String,
    pub template: String,
    pub runtime: String,
}

/// Labels of one HTTP request's latency: the matched route (a template such
/// as `/v1/sandboxes/{id}/exec`, never a raw path) and the status class.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub method: String,
    pub route: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    op: String,
}

/// What a lease operation did (`aviary_lease_operations_total{op=...}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseOp {
    Acquired,
    Renewed,
    Released,
}

impl LeaseOp {
    fn as_str(self) -> &'static str {
        match self {
            LeaseOp::Acquired => "acquired",
            LeaseOp::Renewed => "renewed",
            LeaseOp::Released => "released",
        }
    }
}

/// A label value as the text format needs it: `\\`, `"` and line feeds
/// escaped (the client crate writes values verbatim, and a template or
/// class name must not be able to break a line or forge a sample).
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

type HistogramFamily = Family<RouteLabels, Histogram, fn() -> Histogram>;

fn request_histogram() -> Histogram {
    // 0.5 ms .. ~16 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The control plane's metrics, on the Prometheus client crate: the hot
/// paths bump counters or observe a histogram; `/metrics` encodes the
/// registry (label values escaped by `escape_label`: the crate writes them verbatim).
pub struct Metrics {
    registry: Registry,
    creates: Counter,
    destroys: Counter,
    execs: Counter,
    connections_open: Gauge,
    connections_refused: Counter,
    rate_limited: Counter,
    live: Gauge,
    reconcile_passes: Counter,
    reconciler: Family<ActionLabels, Counter>,
    requests: HistogramFamily,
    sandboxes: Family<StateLabels, Gauge>,
    leases: Family<LeaseLabels, Counter>,
    fence_refusals: Counter,
    pool_hits: Family<PoolLabels, Counter>,
    pool_misses: Family<PoolLabels, Counter>,
    pool_handed_out: Family<PoolLabels, Gauge>,
    /// Every pool's hit and miss counters, for the history's totals (the
    /// family cannot be summed in place).
    pool_counters: Mutex<HashMap<PoolLabels, (Counter, Counter)>>,
    /// 2xx creates and their summed latency, for the history.
    creates_timed: Mutex<(u64, f64)>,
    history: Mutex<VecDeque<MetricsSample>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("aviary");
        macro_rules! reg {
            ($name:expr, $help:expr, $metric:expr) => {{
                let m = $metric;
                registry.register($name, $help, m.clone());
                m
            }};
        }
        let m = Metrics {
            creates: reg!("sandboxes_created", "Sandboxes created", Counter::default()),
            destroys: reg!("sandboxes_destroyed", "Sandboxes destroyed", Counter::default()),
            execs: reg!("execs", "Commands started", Counter::default()),
            connections_open: reg!(
                "http_connections_open",
                "HTTP connections open now",
                Gauge::default()
            ),
            connections_refused: reg!(
                "http_connections_refused",
                "HTTP connections refused at the connection cap",
                Counter::default()
            ),
            rate_limited: reg!(
                "http_rate_limited",
                "Requests refused by the per-key rate limit",
                Counter::default()
            ),
            live: reg!(
                "sandboxes_live",
                "Sandboxes with running compute on this server",
                Gauge::default()
            ),
            reconcile_passes: reg!(
                "reconciler_passes",
                "Reconciler passes run to their end",
                Counter::default()
            ),
            reconciler: reg!(
                "reconciler_actions",
                "What the reconciler did, by action",
                Family::<ActionLabels, Counter>::default()
            ),
            requests: reg!(
                "http_request_duration_seconds",
                "HTTP request latency by method, matched route and status class",
                HistogramFamily::new_with_constructor(request_histogram)
            ),
            sandboxes: reg!(
                "sandboxes",
                "Sandboxes in the registry by state (terminated ones not counted), as of the last scrape",
                Family::<StateLabels, Gauge>::default()
            ),
            leases: reg!(
                "lease_operations",
                "Lease grants, renewals and releases",
                Family::<LeaseLabels, Counter>::default()
            ),
            fence_refusals: reg!(
                "fence_refusals",
                "Writes refused for a missing, stale or foreign lease token",
                Counter::default()
            ),
            pool_hits: reg!(
                "pool_hits",
                "Creates served from a warm pool",
                Family::<PoolLabels, Counter>::default()
            ),
            pool_misses: reg!(
                "pool_misses",
                "Creates that found the matching pool empty",
                Family::<PoolLabels, Counter>::default()
            ),
            pool_handed_out: reg!(
                "pool_handed_out",
                "Pooled sandboxes handed out that still hold compute (as of the last refill pass)",
                Family::<PoolLabels, Gauge>::default()
            ),
            registry,
            pool_counters: Mutex::default(),
            creates_timed: Mutex::default(),
            history: Mutex::default(),
        };
        // every action is shown from the start, at 0
        for action in ReconcileAction::ALL {
            let _ = m.reconciler.get_or_create(&ActionLabels {
                action: action.as_str().to_owned(),
            });
        }
        m
    }
}

impl Metrics {
    pub fn inc_create(&self) {
        self.creates.inc();
    }
    pub fn inc_destroy(&self) {
        self.destroys.inc();
    }
    pub fn inc_exec(&self) {
        self.execs.inc();
    }

    /// A connection was accepted; pair with [`Metrics::connection_closed`].
    pub fn connection_opened(&self) {
        self.connections_open.inc();
    }
    pub fn connection_closed(&self) {
        self.connections_open.dec();
    }
    /// A connection was refused at the connection cap.
    pub fn inc_connection_refused(&self) {
        self.connections_refused.inc();
    }
    /// A request was refused by the per-key rate limit.
    pub fn inc_rate_limited(&self) {
        self.rate_limited.inc();
    }

    /// One action of the reconciler.
    pub fn inc_reconcile(&self, action: ReconcileAction) {
        self.reconciler
            .get_or_create(&ActionLabels {
                action: action.as_str().to_owned(),
            })
            .inc();
    }
    /// One reconciler pass ran to its end.
    pub fn inc_reconcile_pass(&self) {
        self.reconcile_passes.inc();
    }
    /// How often the reconciler did `action` in this process.
    pub fn reconcile_count(&self, action: ReconcileAction) -> u64 {
        self.reconciler
            .get_or_create(&ActionLabels {
                action: action.as_str().to_owned(),
            })
            .get()
    }

    /// One lease operation that succeeded.
    pub fn inc_lease(&self, op: LeaseOp) {
        self.leases
            .get_or_create(&LeaseLabels {
                op: op.as_str().to_owned(),
            })
            .inc();
    }
    /// A write refused by the fence (missing, stale or foreign token).
    pub fn inc_fence_refusal(&self) {
        self.fence_refusals.inc();
    }

    /// One HTTP request's latency. `route` is the matched route template.
    pub fn observe_request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        if method == "POST" && route == "/v1/sandboxes" && (200..300).contains(&status) {
            let mut t = self.creates_timed.lock().expect("metrics lock poisoned");
            t.0 += 1;
            t.1 += seconds;
        }
        self.requests
            .get_or_create(&RouteLabels {
                method: escape_label(method),
                route: escape_label(route),
                status: format!("{}xx", status / 100),
            })
            .observe(seconds);
    }

    /// The counters and gauge of one pool (shared: they count in place).
    pub fn pool_metrics(&self, labels: &PoolLabels) -> (Counter, Counter, Gauge) {
        let labels = &PoolLabels {
            class: escape_label(&labels.class),
            template: escape_label(&labels.template),
            runtime: escape_label(&labels.runtime),
        };
        let (hits, misses) = (
            self.pool_hits.get_or_create(labels).clone(),
            self.pool_misses.get_or_create(labels).clone(),
        );
        self.pool_counters
            .lock()
            .expect("metrics lock poisoned")
            .insert(labels.clone(), (hits.clone(), misses.clone()));
        (
            hits,
            misses,
            self.pool_handed_out.get_or_create(labels).clone(),
        )
    }

    /// Takes one sample of the history (the oldest is dropped past
    /// [`HISTORY_LEN`]) and returns it.
    pub fn record_sample(&self, live: usize, by_state: &[(String, usize)]) -> MetricsSample {
        let (pool_hits, pool_misses) = self
            .pool_counters
            .lock()
            .expect("metrics lock poisoned")
            .values()
            .fold((0, 0), |(h, m), (hc, mc)| (h + hc.get(), m + mc.get()));
        let (creates_served, create_seconds_sum) =
            *self.creates_timed.lock().expect("metrics lock poisoned");
        let sample = MetricsSample {
            at: OffsetDateTime::now_utc(),
            live: live as u64,
            by_state: by_state
                .iter()
                .map(|(s, n)| (s.clone(), *n as u64))
                .collect(),
            creates_served,
            create_seconds_sum,
            pool_hits,
            pool_misses,
        };
        let mut h = self.history.lock().expect("metrics lock poisoned");
        if h.len() == HISTORY_LEN {
            h.pop_front();
        }
        h.push_back(sample.clone());
        sample
    }

    /// The samples taken so far, oldest first.
    pub fn history(&self) -> Vec<MetricsSample> {
        self.history
            .lock()
            .expect("metrics lock poisoned")
            .iter()
            .cloned()
            .collect()
    }

    /// The OpenMetrics text of everything, with the gauges that are read
    /// at scrape time set first: `live` sandboxes with compute here, and
    /// the registry's sandboxes by state.
    pub fn render(&self, live: usize, by_state: &[(String, usize)]) -> String {
        self.live.set(i64::try_from(live).unwrap_or(i64::MAX));
        self.sandboxes.clear();
        for (state, n) in by_state {
            self.sandboxes
                .get_or_create(&StateLabels {
                    state: escape_label(state),
                })
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let mut s = String::new();
        if encode(&mut s, &self.registry).is_err() {
            s.clear();
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_history_sums_pools_and_creates_and_keeps_the_newest() {
        let m = Metrics::default();
        let labels = |class: &str| PoolLabels {
            class: class.into(),
            template: "default".into(),
            runtime: "crun".into(),
        };
        let (a_hits, a_misses, _) = m.pool_metrics(&labels("a"));
        let (b_hits, _, _) = m.pool_metrics(&labels("b"));
        // asking again for a pool's counters does not count it twice
        let _ = m.pool_metrics(&labels("a"));
        a_hits.inc();
        a_hits.inc();
        b_hits.inc();
        a_misses.inc();
        m.observe_request("POST", "/v1/sandboxes", 201, 0.25);
        m.observe_request("POST", "/v1/sandboxes", 403, 9.0);
        m.observe_request("GET", "/v1/sandboxes", 200, 9.0);
        let s = m.record_sample(2, &[("Idle".into(), 3)]);
        assert_eq!((s.pool_hits, s.pool_misses), (3, 1));
        assert_eq!((s.creates_served, s.create_seconds_sum), (1, 0.25));
        assert_eq!(s.live, 2);
        assert_eq!(s.by_state["Idle"], 3);
        for i in 0..HISTORY_LEN + 5 {
            m.record_sample(i, &[]);
        }
        let h = m.history();
        assert_eq!(h.len(), HISTORY_LEN);
        assert_eq!(h.last().unwrap().live, (HISTORY_LEN + 4) as u64);
        assert_eq!(h[0].live, 5, "the oldest were dropped");
    }

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
        let text = m.render(0, &[]);
        assert!(
            text.contains("# TYPE aviary_reconciler_actions counter\n"),
            "{text}"
        );
        assert!(text.contains("aviary_reconciler_actions_total{action=\"recovered\"} 2\n"));
        assert!(text.contains("aviary_reconciler_actions_total{action=\"orphan_destroyed\"} 1\n"));
        assert!(text.contains("aviary_reconciler_actions_total{action=\"node_unhealthy\"} 0\n"));
        assert!(text.contains("aviary_reconciler_passes_total 1\n"));
        assert!(text.ends_with("# EOF\n"), "OpenMetrics text");
    }

    #[test]
    fn latency_states_leases_and_escaped_labels() {
        let m = Metrics::default();
        m.observe_request("GET", "/v1/sandboxes/{id}", 200, 0.002);
        m.observe_request("GET", "/v1/sandboxes/{id}", 404, 0.001);
        m.inc_lease(LeaseOp::Acquired);
        m.inc_fence_refusal();
        let (hits, _, handed) = m.pool_metrics(&PoolLabels {
            class: "python-small".into(),
            template: "tricky\"name\n".into(),
            runtime: "crun".into(),
        });
        hits.inc();
        handed.set(3);
        let text = m.render(2, &[("Idle".into(), 5), ("Running".into(), 1)]);
        assert!(text.contains(
            "aviary_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/sandboxes/{id}\",status=\"2xx\"} 1\n"
        ), "{text}");
        assert!(text.contains("status=\"4xx\""), "{text}");
        assert!(
            text.contains("aviary_sandboxes{state=\"Idle\"} 5\n"),
            "{text}"
        );
        assert!(text.contains("aviary_sandboxes_live 2\n"), "{text}");
        assert!(
            text.contains("aviary_lease_operations_total{op=\"acquired\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("aviary_fence_refusals_total 1\n"), "{text}");
        // a label value cannot break the line format
        assert!(text.contains("template=\"tricky\\\"name\\n\""), "{text}");
        assert!(text.contains("aviary_pool_handed_out{"), "{text}");
        // a state seen before and gone now is not shown
        let text = m.render(0, &[("Idle".into(), 1)]);
        assert!(!text.contains("state=\"Running\""), "{text}");
    }
}
