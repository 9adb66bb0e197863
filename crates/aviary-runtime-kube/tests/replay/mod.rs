//! A test-only Kubernetes API server that replays a script of exchanges.
//!
//! A fixture (`tests/fixtures/<name>.json`) is an ordered list of request →
//! answer pairs: method, path, query (decoded key → value; none means no
//! query), an optional subset the request's JSON body must contain, and the
//! status and JSON body to answer. Requests must arrive in the script's
//! order; an exchange marked `"repeat": true` answers every matching request
//! until one matches the next exchange; one marked `"anytime": true`
//! answers at any point without moving the script (background passes).
//! `{sandbox}` in a path matches any sandbox id, and in an answer stands for
//! the id the request named. Any request the script does not
//! expect is answered 500 and recorded, and [`Replay::finish`] fails the
//! test on it and on any exchange never reached. Every request is recorded
//! (with its `Authorization` header and JSON body) so a test can assert
//! exactly what the runtime sent, and wait for one to arrive
//! ([`Replay::wait_for`]: e.g. the Secret the runtime generated, to start
//! a real envd with it). Values known only while a test runs (that
//! secret) are bound with [`Replay::bind`]: `{name}` in an answer stands
//! for the bound value.
//!
//! The fixtures are written from the Kubernetes API reference (v1.30
//! objects, `Status` errors, `metrics.k8s.io/v1beta1`), not captured from a
//! live cluster; each says so in its `source` field.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exchange {
    #[serde(default, rename = "$comment")]
    pub comment: Option<String>,
    pub method: String,
    pub path: String,
    #[serde(default)]
    pub query: BTreeMap<String, String>,
    /// A subset of the request body: every key given must be there with an
    /// equal value (objects recursively; arrays element by element).
    #[serde(default)]
    pub body: Option<Value>,
    pub status: u16,
    pub response: Value,
    #[serde(default)]
    pub repeat: bool,
    /// Answers a matching request at any point, outside the order (for a
    /// server's background passes, e.g. the reconciler's lists).
    #[serde(default)]
    pub anytime: bool,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixture {
    source: String,
    exchanges: Vec<Exchange>,
}

/// One request the server received.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub body: Option<Value>,
    pub authorization: Option<String>,
}

#[derive(Default)]
struct Script {
    exchanges: Vec<Exchange>,
    /// `{name}` → value in answers (see [`Replay::bind`]).
    bindings: BTreeMap<String, String>,
    /// Index of the next exchange expected.
    at: usize,
    /// How often the exchange at `at` answered.
    used: usize,
    requests: Vec<Recorded>,
    unexpected: Vec<String>,
}

pub struct Replay {
    pub addr: SocketAddr,
    script: Arc<Mutex<Script>>,
    /// Woken on every request.
    arrived: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Shared {
    script: Arc<Mutex<Script>>,
    arrived: Arc<tokio::sync::Notify>,
}

fn contains(actual: &Value, expected: &Value) -> bool {
    match (actual, expected) {
        (Value::Object(a), Value::Object(e)) => e
            .iter()
            .all(|(k, v)| a.get(k).is_some_and(|av| contains(av, v))),
        (Value::Array(a), Value::Array(e)) => {
            a.len() == e.len() && a.iter().zip(e).all(|(av, ev)| contains(av, ev))
        }
        (a, e) => a == e,
    }
}

/// `{sandbox}` in a fixture's path stands for any well-formed sandbox id
/// (for suites that make their own ids); the id it stood for.
fn path_id<'a>(pattern: &str, path: &'a str) -> Option<&'a str> {
    let (before, after) = pattern.split_once("{sandbox}")?;
    path.strip_prefix(before)
        .and_then(|rest| rest.strip_suffix(after))
        .filter(|id| id.parse::<aviary_core::SandboxId>().is_ok())
}

fn path_matches(pattern: &str, path: &str) -> bool {
    if pattern.contains("{sandbox}") {
        path_id(pattern, path).is_some()
    } else {
        pattern == path
    }
}

/// The answer of `x` to `r`: `{sandbox}` in it is replaced by the id the
/// request named (in its path, or as the name of the object it sends).
fn answer_text(x: &Exchange, r: &Recorded, bindings: &BTreeMap<String, String>) -> String {
    let mut text = x.response.to_string();
    for (name, value) in bindings {
        text = text.replace(&format!("{{{name}}}"), value);
    }
    let id = path_id(&x.path, &r.path).map(str::to_owned).or_else(|| {
        r.body
            .as_ref()
            .and_then(|b| b["metadata"]["name"].as_str())
            .map(str::to_owned)
    });
    match id {
        Some(id) => text.replace("{sandbox}", &id),
        None => text,
    }
}

fn matches(x: &Exchange, r: &Recorded) -> bool {
    x.method == r.method
        && path_matches(&x.path, &r.path)
        && x.query == r.query
        && match &x.body {
            None => true,
            Some(e) => r.body.as_ref().is_some_and(|a| contains(a, e)),
        }
}

async fn answer(
    State(shared): State<Shared>,
    method: Method,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let query = uri
        .query()
        .map(|q| {
            form_urlencoded::parse(q.as_bytes())
                .filter(|(k, _)| !k.is_empty())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect()
        })
        .unwrap_or_default();
    let rec = Recorded {
        method: method.to_string(),
        path: uri.path().to_owned(),
        query,
        body: (!body.is_empty()).then(|| serde_json::from_slice(&body).unwrap_or(Value::Null)),
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    };
    let mut s = shared.script.lock().unwrap();
    s.requests.push(rec.clone());
    shared.arrived.notify_waiters();
    let json = ("content-type", "application/json");
    loop {
        let at = s.at;
        let Some(x) = s.exchanges.get(at).cloned() else {
            break;
        };
        if matches(&x, &rec) {
            if x.repeat {
                s.used += 1;
            } else {
                s.at += 1;
                s.used = 0;
            }
            return (
                StatusCode::from_u16(x.status).unwrap(),
                [json],
                answer_text(&x, &rec, &s.bindings),
            );
        }
        if x.anytime {
            s.at += 1;
            continue;
        }
        // a repeating exchange that answered at least once gives way
        if x.repeat && s.used > 0 {
            s.at += 1;
            s.used = 0;
            continue;
        }
        break;
    }
    if let Some(x) = s.exchanges.iter().find(|x| x.anytime && matches(x, &rec)) {
        return (
            StatusCode::from_u16(x.status).unwrap(),
            [json],
            answer_text(x, &rec, &s.bindings),
        );
    }
    let line = format!(
        "unexpected {} {} {:?} body {:?} (script at exchange {}: {:?})",
        rec.method,
        rec.path,
        rec.query,
        rec.body,
        s.at,
        s.exchanges.get(s.at).map(|x| (&x.method, &x.path))
    );
    s.unexpected.push(line.clone());
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        [("content-type", "text/plain")],
        line,
    )
}

impl Replay {
    /// Serves fixture `name` on 127.0.0.1, a port of its own.
    pub async fn start(name: &str) -> Replay {
        // the Kubernetes runtime's fixtures, from its own tests and the server's
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../aviary-runtime-kube/tests/fixtures")
            .join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap();
        let fixture: Fixture = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
        assert!(
            fixture.source.contains("not captured from a live cluster"),
            "fixture {name} must say where it comes from"
        );
        Replay::serve(fixture.exchanges).await
    }

    async fn serve(exchanges: Vec<Exchange>) -> Replay {
        let script = Arc::new(Mutex::new(Script {
            exchanges,
            ..Script::default()
        }));
        let arrived = Arc::new(tokio::sync::Notify::new());
        let app = axum::Router::new().fallback(answer).with_state(Shared {
            script: script.clone(),
            arrived: arrived.clone(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Replay {
            addr,
            script,
            arrived,
            task,
        }
    }

    /// A server that expects no request at all.
    pub async fn silent() -> Replay {
        Replay::serve(Vec::new()).await
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.script.lock().unwrap().requests.clone()
    }

    /// From now on `{name}` in every answer stands for `value`.
    pub fn bind(&self, name: &str, value: &str) {
        self.script
            .lock()
            .unwrap()
            .bindings
            .insert(name.to_owned(), value.to_owned());
    }

    /// The first request `method path` received, waiting until one arrives.
    pub async fn wait_for(&self, method: &str, path: &str) -> Recorded {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(r) = self
                .requests()
                .into_iter()
                .find(|r| r.method == method && r.path == path)
            {
                return r;
            }
            arrived.await;
        }
    }

    /// Fails on any unexpected request and on any exchange never reached.
    pub fn finish(&self) {
        let s = self.script.lock().unwrap();
        assert!(s.unexpected.is_empty(), "{:#?}", s.unexpected);
        let rest = &s.exchanges[s.at.min(s.exchanges.len())..];
        let done = rest
            .iter()
            .enumerate()
            .all(|(i, x)| x.anytime || (i == 0 && x.repeat && s.used > 0));
        assert!(
            done,
            "the script stopped at exchange {} of {}: {:?}",
            s.at,
            s.exchanges.len(),
            s.exchanges
                .get(s.at)
                .map(|x| (&x.method, &x.path, &x.comment))
        );
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Writes a kubeconfig for the API server at `url` (bearer token
/// `replay-token`, namespace `aviary`) into `dir`.
pub fn kubeconfig(dir: &Path, url: &str) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: replay
  cluster:
    server: {url}
users:
- name: replay
  user:
    token: replay-token
contexts:
- name: replay
  context:
    cluster: replay
    user: replay
    namespace: aviary
current-context: replay
"
        ),
    )
    .unwrap();
    path
}
