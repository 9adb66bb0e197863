//! `sandbox exec -t` / `run -t`: a command on a pseudo-terminal in the
//! sandbox, over the API's `exec/tty` WebSocket.
//!
//! With `-i` too (`-it`) the local terminal goes into raw mode, so every
//! key, Ctrl-C included, goes to the sandbox's terminal (whose line
//! discipline turns Ctrl-C into SIGINT for its foreground process); raw
//! mode is restored on every way out (a guard, dropped on return and on
//! unwind). With `-t` alone the keyboard is not read: the terminal shows
//! the output, and Ctrl-C here is sent on as SIGINT. The window size is
//! sent at the start and on every SIGWINCH. The exit code is the remote
//! command's.

use std::io::{IsTerminal, Write};

use aviary_core::{ErrorBody, ErrorCode, LeaseToken};
use futures_util::{SinkExt, StreamExt};
use tokio::io::AsyncReadExt;
use tokio::signal::unix::{signal, SignalKind};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::Failure;

/// What to run on the terminal.
pub struct TtyCommand {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    /// Forward the keyboard (`-i`): raw mode.
    pub stdin: bool,
    pub token: Option<LeaseToken>,
}

/// Refuses `-t` where it cannot work, before anything is created.
pub fn check_terminal() -> Result<(), Failure> {
    if std::io::stdin().is_terminal() {
        Ok(())
    } else {
        Err(Failure::new(
            ErrorCode::InvalidRequest,
            "-t needs a terminal on stdin, and stdin is not one; \
             drop -t (use -i alone to pipe input to the command)"
                .into(),
        ))
    }
}

/// Restores the local terminal when dropped.
struct RawMode;

impl RawMode {
    fn enable() -> Result<RawMode, Failure> {
        crossterm::terminal::enable_raw_mode().map_err(|e| {
            Failure::exit(
                super::EXIT_IO_ERROR,
                format!("cannot put the terminal into raw mode: {e}"),
            )
        })?;
        Ok(RawMode)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = crossterm::terminal::disable_raw_mode();
    }
}

fn window_size() -> (u16, u16) {
    crossterm::terminal::size()
        .ok()
        .filter(|(c, r)| *c > 0 && *r > 0)
        .unwrap_or((80, 24))
}

fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn internal(what: String) -> Failure {
    Failure::new(ErrorCode::Internal, what)
}

/// Runs `cmd` in sandbox `id` on a terminal; returns its exit code.
pub async fn run(base_url: &str, key: &str, id: &str, cmd: TtyCommand) -> Result<i32, Failure> {
    let ws_base = if let Some(rest) = base_url.strip_prefix("https://") {
        format!("wss://{rest}")
    } else {
        format!("ws://{}", base_url.trim_start_matches("http://"))
    };
    let url = format!("{ws_base}/v1/sandboxes/{}/exec/tty", encode_segment(id));
    let mut req = url
        .as_str()
        .into_client_request()
        .map_err(|e| Failure::new(ErrorCode::InvalidRequest, format!("AVIARY_URL: {e}")))?;
    let bad_header = |what: &str| Failure::new(ErrorCode::InvalidRequest, format!("bad {what}"));
    let h = req.headers_mut();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| bad_header("API key"))?,
    );
    h.insert(
        "sec-websocket-protocol",
        HeaderValue::from_static("aviary.tty.v1"),
    );
    if let Some(t) = cmd.token {
        h.insert(
            "x-aviary-lease-token",
            HeaderValue::from_str(&t.to_string()).map_err(|_| bad_header("lease token"))?,
        );
    }
    let (ws, _) = match tokio_tungstenite::connect_async(req).await {
        Ok(c) => c,
        Err(WsError::Http(resp)) => {
            let status = resp.status().as_u16();
            return Err(match resp
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice::<ErrorBody>(b).ok())
            {
                Some(b) => Failure::new(
                    b.error.code,
                    format!("{} [{}]", b.error.message, b.error.code.as_str()),
                ),
                None => internal(format!("the server refused the terminal ({status})")),
            });
        }
        Err(e) => {
            return Err(Failure::new(
                ErrorCode::Unavailable,
                format!("connect to {url}: {e} (is `aviary serve` running there? AVIARY_URL selects another)"),
            ))
        }
    };
    let (mut tx, mut rx) = ws.split();
    let (cols, rows) = window_size();
    let mut env = cmd.env;
    if !env.iter().any(|(k, _)| k == "TERM") {
        if let Ok(term) = std::env::var("TERM") {
            env.push(("TERM".into(), term));
        }
    }
    let start = serde_json::json!({
        "cmd": cmd.argv,
        "env": env.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
        "cwd": cmd.cwd,
        "cols": cols,
        "rows": rows,
    });
    tx.send(Message::text(start.to_string()))
        .await
        .map_err(|e| internal(format!("send the start message: {e}")))?;

    // everything the client sends goes through one queue to one writer
    let (out_tx, mut out_rx) = tokio::sync::mpsc::channel::<Message>(16);
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if tx.send(m).await.is_err() {
                break;
            }
        }
    });
    let _raw = if cmd.stdin {
        Some(RawMode::enable()?)
    } else {
        None
    };
    let mut keyboard = None;
    if cmd.stdin {
        let keys = out_tx.clone();
        keyboard = Some(tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 8192];
            while let Ok(n) = stdin.read(&mut buf).await {
                if n == 0 || keys.send(Message::binary(buf[..n].to_vec())).await.is_err() {
                    break;
                }
            }
        }));
    }
    let mut winch = signal(SignalKind::window_change())
        .map_err(|e| internal(format!("watch the window size: {e}")))?;
    let mut interrupt =
        signal(SignalKind::interrupt()).map_err(|e| internal(format!("watch Ctrl-C: {e}")))?;
    let mut stdout = std::io::stdout();
    let mut refused: Option<Failure> = None;
    let result = loop {
        tokio::select! {
            msg = rx.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    let _ = stdout.write_all(&b);
                    let _ = stdout.flush();
                }
                Some(Ok(Message::Text(t))) => {
                    let v: serde_json::Value = serde_json::from_str(&t).unwrap_or_default();
                    if let Some(exit) = v.get("exit") {
                        break exit["exit_code"]
                            .as_i64()
                            .and_then(|c| i32::try_from(c).ok())
                            .ok_or_else(|| internal(format!("malformed exit message: {t}")));
                    }
                    // a refusal; the close that follows ends the session
                    if let Ok(b) = serde_json::from_value::<ErrorBody>(v) {
                        let code = b.error.code;
                        refused = Some(Failure::new(code, format!("{} [{}]", b.error.message, code.as_str())));
                    }
                }
                Some(Ok(Message::Close(frame))) => {
                    let away = frame.as_ref().is_some_and(|f| u16::from(f.code) == 1001);
                    break Err(refused.take().unwrap_or_else(|| if away {
                        Failure::new(
                            ErrorCode::Unavailable,
                            "the server is stopping; the terminal session was ended".into(),
                        )
                    } else {
                        internal("the terminal session ended without an exit status".into())
                    }))
                }
                None => {
                    break Err(refused.take().unwrap_or_else(|| {
                        internal("the terminal session ended without an exit status".into())
                    }))
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break Err(internal(format!("terminal connection: {e}"))),
            },
            _ = winch.recv() => {
                let (cols, rows) = window_size();
                let m = serde_json::json!({"type": "resize", "cols": cols, "rows": rows});
                let _ = out_tx.send(Message::text(m.to_string())).await;
            }
            _ = interrupt.recv() => {
                // only without raw mode: then Ctrl-C here is a signal there
                let m = serde_json::json!({"type": "signal", "signal": "INT"});
                let _ = out_tx.send(Message::text(m.to_string())).await;
            }
        }
    };
    if let Some(k) = keyboard {
        k.abort();
    }
    drop(out_tx);
    writer.abort();
    result
}
