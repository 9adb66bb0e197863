//! The HTTP edge's defences against floods: the accept loop with a cap on
//! open connections and hyper's header read timeout, and the per-key request
//! rate limiter.
//!
//! - At most `max_connections` connections are served at once, and at most
//!   `max_connections_per_ip` from one client address (so one client cannot
//!   take every slot); one more is answered `503` with `Retry-After` in a
//!   single non-blocking write and closed, without spawning anything, so a
//!   flood costs the server no memory beyond the kernel's accept queue.
//! - A connection must deliver a request's headers within
//!   `header_read_timeout_ms`, and the same limit applies to a kept-alive
//!   connection waiting for its next request (hyper restarts the timer after
//!   each response), so idle or half-sent connections free their slot.
//! - Request bodies stall at most `body_read_timeout_ms` between chunks
//!   (a layer in [`crate::http::router`]).
//! - Each API key has a token bucket (`rate_limit_per_s`, `rate_limit_burst`);
//!   a request over it is `429 rate_limited` with `Retry-After`. Requests
//!   with a missing or unknown key draw from a bucket of their client
//!   address, so guessing keys is as limited as using one.
//!
//! Concurrency: one task per accepted connection holding a semaphore permit
//! (shared with a WebSocket session the connection was upgraded to, see
//! [`ConnectionHold`]); shutdown asks every connection to finish gracefully
//! (and every such session to close) and waits until all permits are back.

use aviary_control::ControlPlane;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// The whole answer to a connection over the cap.
const OVER_CAPACITY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 86\r\n\
\r\n\
{\"error\":{\"code\":\"unavailable\",\"message\":\"too many connections to the server, retry\"}}";

/// Serves `app` on `listener` until `shutdown` resolves, then finishes the
/// open connections gracefully.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    cp: Arc<ControlPlane>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let limits = &cp.cfg.settings.server.edge;
    let max = usize::try_from(limits.max_connections).unwrap_or(usize::MAX);
    let header_timeout = Duration::from_millis(limits.header_read_timeout_ms);
    let permits = Arc::new(Semaphore::new(max));
    let peers = Arc::new(PeerCounts::new(limits.max_connections_per_ip));
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (Some(peer_slot), Ok(permit)) = (
            PeerCounts::claim(&peers, peer.ip()),
            permits.clone().try_acquire_owned(),
        ) else {
            cp.metrics.inc_connection_refused();
            refuse(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (app, cp, mut stop) = (app.clone(), cp.clone(), stop_rx.clone());
        let hold = ConnectionHold {
            _slots: Arc::new((permit, peer_slot)),
            stopping: stop_rx.clone(),
        };
        tokio::spawn(async move {
            let _hold = hold.clone();
            cp.metrics.connection_opened();
            let _open = OpenConnection(&cp);
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder
                .serve_connection(
                    TokioIo::new(stream),
                    TowerToHyperService::new(app.map_request(
                        move |mut req: axum::http::Request<hyper::body::Incoming>| {
                            req.extensions_mut().insert(ClientAddr(peer));
                            req.extensions_mut().insert(hold.clone());
                            req
                        },
                    )),
                )
                // WebSockets (exec/tty, the port proxy) take the connection over after a 101
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                res = conn.as_mut() => {
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
    Ok(())
}

/// A connection's slots (the global one and its address's), in every
/// request's extensions: held by the connection's task and by a session
/// that outlives its upgrade (a terminal WebSocket), freed when the last
/// holder lets go, so upgraded sessions count against the caps and a
/// shutdown waits for them.
#[derive(Clone)]
pub struct ConnectionHold {
    _slots: Arc<(tokio::sync::OwnedSemaphorePermit, PeerSlot)>,
    stopping: watch::Receiver<bool>,
}

impl ConnectionHold {
    /// Resolves when the server is shutting down.
    pub async fn stopping(&mut self) {
        let _ = self.stopping.wait_for(|s| *s).await;
    }
}

/// The client's address, in every request's extensions.
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

/// Keeps the open-connections gauge true however the task ends.
struct OpenConnection<'a>(&'a ControlPlane);

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.metrics.connection_closed();
    }
}

/// Answers a connection over the cap without waiting for anything: the
/// answer fits the socket buffer of a fresh connection, and if it does not
/// the client just sees the connection closed.
fn refuse(stream: TcpStream) {
    let _ = stream.try_write(OVER_CAPACITY);
}

/// Open connections per client address.
struct PeerCounts {
    limit: u32,
    open: Mutex<HashMap<IpAddr, u32>>,
}

/// One connection's place in [`PeerCounts`], given back on drop.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
}

impl PeerCounts {
    fn new(limit: u32) -> Self {
        PeerCounts {
            limit: limit.max(1),
            open: Mutex::new(HashMap::new()),
        }
    }

    fn claim(counts: &Arc<PeerCounts>, ip: IpAddr) -> Option<PeerSlot> {
        let mut open = counts.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= counts.limit {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            counts: counts.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Token buckets per API key (by key hash).
pub struct RateLimiter {
    per_s: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Buckets kept before full ones are dropped (a full bucket is the same as
/// none).
const PRUNE_AT: usize = 4096;

impl RateLimiter {
    pub fn new(per_s: f64, burst: u32) -> Self {
        RateLimiter {
            per_s,
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    pub fn from_settings(s: &aviary_config::EdgeSettings) -> Self {
        Self::new(s.rate_limit_per_s, s.rate_limit_burst)
    }

    /// Takes one request from `key`'s bucket; `Err(seconds)` to wait when
    /// it is empty.
    pub fn take(&self, key: &str, now: Instant) -> Result<(), u64> {
        self.bucket(key, now, true)
    }

    /// Whether `key`'s bucket has a request left, without taking it.
    pub fn check(&self, key: &str, now: Instant) -> Result<(), u64> {
        self.bucket(key, now, false)
    }

    fn bucket(&self, key: &str, now: Instant, take: bool) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (per_s, burst) = (self.per_s, self.burst);
        let refill = |b: &Bucket| {
            (b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * per_s).min(burst)
        };
        if buckets.len() >= PRUNE_AT {
            buckets.retain(|_, b| refill(b) < burst);
        }
        let b = buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        b.tokens = refill(b);
        b.at = now;
        if b.tokens >= 1.0 {
            if take {
                b.tokens -= 1.0;
            }
            Ok(())
        } else {
            let wait = ((1.0 - b.tokens) / per_s).ceil();
            // at least 1 s (Retry-After is whole seconds), at most a day
            Err(if wait >= 86_400.0 {
                86_400
            } else {
                (wait as u64).max(1)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_refill_per_key() {
        let l = RateLimiter::new(2.0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            l.take("a", t0).unwrap();
        }
        assert_eq!(l.take("a", t0), Err(1));
        assert_eq!(l.check("a", t0), Err(1));
        l.check("b", t0).unwrap();
        l.take("b", t0).unwrap();
        // half a second refills one request at 2/s
        l.take("a", t0 + Duration::from_millis(500)).unwrap();
        assert!(l.take("a", t0 + Duration::from_millis(500)).is_err());
        // never more than the burst, however long the pause
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            l.take("a", later).unwrap();
        }
        assert!(l.take("a", later).is_err());
    }

    #[test]
    fn slow_rates_ask_for_longer_waits() {
        let l = RateLimiter::new(0.1, 1);
        let t0 = Instant::now();
        l.take("k", t0).unwrap();
        assert_eq!(l.take("k", t0), Err(10));
    }

    #[test]
    fn full_buckets_are_pruned() {
        let l = RateLimiter::new(1000.0, 1);
        let t0 = Instant::now();
        for i in 0..PRUNE_AT {
            l.take(&format!("k{i}"), t0).unwrap();
        }
        l.take("last", t0 + Duration::from_secs(1)).unwrap();
        assert!(l.buckets.lock().unwrap().len() < 10);
    }

    #[test]
    fn one_address_gets_at_most_its_share() {
        let counts = Arc::new(PeerCounts::new(2));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let s1 = PeerCounts::claim(&counts, a).unwrap();
        let _s2 = PeerCounts::claim(&counts, a).unwrap();
        assert!(PeerCounts::claim(&counts, a).is_none());
        let _t = PeerCounts::claim(&counts, b).unwrap();
        drop(s1);
        let _s3 = PeerCounts::claim(&counts, a).unwrap();
        drop(_t);
        assert!(
            !counts.open.lock().unwrap().contains_key(&b),
            "empty entries go"
        );
    }

    #[test]
    fn the_canned_answer_has_the_right_length() {
        let text = std::str::from_utf8(OVER_CAPACITY).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "unavailable");
    }
}
