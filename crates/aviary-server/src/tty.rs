//! `GET /v1/sandboxes/{id}/exec/tty`: an interactive terminal over a
//! WebSocket.
//!
//! **Before the upgrade** (plain HTTP answers): the caller authenticates
//! like every `/v1` route, with `Authorization: Bearer <key>` or, for a
//! browser (which cannot set headers on a WebSocket), the subprotocol
//! `aviary.bearer.<key>` offered beside `aviary.tty.v1`; only
//! `aviary.tty.v1` is echoed back, never the key, and the key is never
//! read from the query string. A browser's lease token comes the same way,
//! as the subprotocol `aviary.lease.<FENCE.SECRET>`, when the
//! `x-aviary-lease-token` header is absent. The sandbox must be the caller's (another
//! tenant's id is a 404), running and not paused, and a leased one needs
//! its lease token in `x-aviary-lease-token`. No cookie authenticates, so
//! a page of another origin cannot ride a browser's session (no cross-site
//! WebSocket hijacking); `Origin` is therefore not checked.
//!
//! **After the upgrade**: the client's first message is a text message,
//! the JSON [`TtyStart`] (command, env, cwd, user, window size). Then
//! binary messages carry terminal bytes both ways, and text messages carry
//! JSON control messages from the client: `{"type":"resize","cols":C,
//! "rows":R}` and `{"type":"signal","signal":"INT"}` (a name or number, to
//! the terminal's foreground process group). The server ends with the text
//! message `{"exit":{"exit_code":N,"signal":S|null,"duration_ms":F}}` and a
//! normal close. A refusal (a bad start message, a stale token, a command
//! envd refuses) is the text message `{"error":{"code":…,"message":…}}`
//! (the API's error body) and a close with code 4000 + the HTTP status the
//! same error gets on other routes (4400, 4404, 4409, …): nothing started.
//! A bad control message is answered with an error message and changes
//! nothing; the session goes on. Closing the WebSocket ends the session:
//! envd hangs the terminal up and kills its process groups.
//!
//! A session holds its connection's slots (it counts against the server's
//! connection caps until it ends) and is closed (1001) when the server
//! shuts down.
//!
//! Bounds: messages up to [`MAX_MESSAGE`] bytes; the start message must
//! come within [`START_TIMEOUT`]; output is back-pressured through a
//! bounded queue (a slow client slows the terminal, it does not grow the
//! server's memory).

use std::time::Duration;

use aviary_control::requests::OnSandbox;
use aviary_control::tty::{TtySession, TtyStart};
use aviary_control::{OpContext, OpError};
use aviary_envd_proto::{PtyControl, PtyEvent, PtyInput, PtyOutput};
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;

use crate::edge::ConnectionHold;
use crate::error::ApiError;
use crate::http::{op_context, AppState, Auth, TokenFrom};

/// The subprotocol the server speaks (and echoes back when offered).
pub const TTY_PROTOCOL: &str = "aviary.tty.v1";
/// Prefix of the subprotocol that carries the API key (browsers).
pub const BEARER_PROTOCOL_PREFIX: &str = "aviary.bearer.";
/// Prefix of the subprotocol that carries the lease token (browsers).
pub const LEASE_PROTOCOL_PREFIX: &str = "aviary.lease.";
/// Largest WebSocket message accepted from the client.
pub const MAX_MESSAGE: usize = 256 * 1024;
/// How long the server waits for the start message.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Output messages queued for a slow client before the terminal waits.
const OUTPUT_QUEUE: usize = 16;
/// Up to how many bytes of queued output one WebSocket message carries.
const COALESCE_BYTES: usize = 64 * 1024;

/// The caller, from `Authorization` or else the `aviary.bearer.<key>`
/// subprotocol.
pub struct TtyAuth(Auth);

/// The value of the first offered subprotocol that starts with `prefix`.
fn offered(parts: &Parts, prefix: &str) -> Option<String> {
    parts
        .headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(prefix))
        .map(str::to_owned)
}

impl FromRequestParts<AppState> for TtyAuth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, ApiError> {
        if !parts.headers.contains_key(header::AUTHORIZATION) {
            if let Some(key) = offered(parts, BEARER_PROTOCOL_PREFIX) {
                let v = HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| OpError::Unauthorized)?;
                parts.headers.insert(header::AUTHORIZATION, v);
            }
        }
        // a browser's lease token travels the same way (it is checked like
        // the header's: parsed, then against the lease store and by envd)
        if !parts.headers.contains_key(crate::http::LEASE_TOKEN_HEADER) {
            if let Some(token) = offered(parts, LEASE_PROTOCOL_PREFIX) {
                let v = HeaderValue::from_str(&token).map_err(|_| {
                    OpError::InvalidRequest("the lease token subprotocol is not a token".into())
                })?;
                parts.headers.insert(crate::http::LEASE_TOKEN_HEADER, v);
            }
        }
        Auth::from_request_parts(parts, st).await.map(TtyAuth)
    }
}

/// An interactive terminal: a WebSocket (see the module docs of
/// `aviary_server::tty` and README's "Interactive terminal"). The first
/// client message is the start message ([`TtyStart`], JSON text); then
/// binary messages are terminal bytes both ways and text messages are JSON
/// control messages (`resize`, `signal`); the server ends with
/// `{"exit":{…}}` or `{"error":{…}}` and closes.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/exec/tty",
    params(
        ("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased"),
        ("Sec-WebSocket-Protocol" = Option<String>, Header, description = "offer `aviary.tty.v1`; a browser also offers `aviary.bearer.<API key>` instead of the Authorization header, and `aviary.lease.<lease token>` instead of `x-aviary-lease-token` (only `aviary.tty.v1` is echoed)"),
    ),
    responses(
        (status = 101, description = "switching to the WebSocket terminal protocol; first client message: the start message (TtyStart, JSON text)"),
        (status = 400, description = "not a WebSocket upgrade, or a malformed lease token", body = aviary_core::ErrorBody),
        (status = 401, body = aviary_core::ErrorBody),
        (status = 404, body = aviary_core::ErrorBody),
        (status = 409, description = "the sandbox is not running, is paused, or is leased and the token is missing or stale", body = aviary_core::ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn exec_tty(
    State(cp): State<AppState>,
    TtyAuth(auth): TtyAuth,
    headers: HeaderMap,
    Path(id): Path<String>,
    hold: Option<axum::Extension<ConnectionHold>>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    cp.tty_admissible(&cx, &id).await?;
    let ws = ws.map_err(|r| {
        OpError::InvalidRequest(format!(
            "exec/tty is a WebSocket: send a GET with the upgrade headers ({})",
            r.body_text()
        ))
    })?;
    Ok(ws
        .protocols([TTY_PROTOCOL])
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| session(cp, cx, id, socket, hold.map(|h| h.0))))
}

fn error_message(e: &OpError) -> Message {
    let body = serde_json::to_string(&e.body(None)).unwrap_or_default();
    Message::Text(Utf8Bytes::from(body))
}

/// Sends the error and closes with 4000 + its HTTP status.
async fn refuse(mut socket: WebSocket, e: OpError) {
    let status = e.code().http_status();
    let _ = socket.send(error_message(&e)).await;
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code: 4000 + status,
            reason: Utf8Bytes::from(e.code().as_str()),
        })))
        .await;
}

async fn read_start(socket: &mut WebSocket) -> Result<Option<TtyStart>, OpError> {
    let first = match tokio::time::timeout(START_TIMEOUT, socket.recv()).await {
        Err(_) => {
            return Err(OpError::InvalidRequest(format!(
                "no start message within {START_TIMEOUT:?}"
            )))
        }
        Ok(None | Some(Err(_))) => return Ok(None),
        Ok(Some(Ok(m))) => m,
    };
    let text = match first {
        Message::Text(t) => t,
        Message::Close(_) => return Ok(None),
        _ => {
            return Err(OpError::InvalidRequest(
                "the first message must be the start message: a JSON object as text".into(),
            ))
        }
    };
    if !text.trim_start().starts_with('{') {
        return Err(OpError::InvalidRequest(
            "the start message must be a JSON object".into(),
        ));
    }
    let start: TtyStart = serde_json::from_str(&text)
        .map_err(|e| OpError::InvalidRequest(format!("invalid start message: {e}")))?;
    start.validate()?;
    Ok(Some(start))
}

async fn session(
    cp: AppState,
    cx: OpContext,
    id: String,
    mut socket: WebSocket,
    hold: Option<ConnectionHold>,
) {
    let start = match read_start(&mut socket).await {
        Ok(Some(s)) => s,
        Ok(None) => return,
        Err(e) => return refuse(socket, e).await,
    };
    let run = match cp.exec_tty_start(&cx, OnSandbox::new(id, start)).await {
        Ok(run) => run,
        Err(e) => return refuse(socket, e).await,
    };
    let exit = serve(socket, run.input, run.output, hold).await;
    cp.exec_tty_finish(&run.session, exit.as_ref()).await;
    drop::<TtySession>(run.session);
}

/// Pumps the session until the exit was sent or the client left; returns
/// the exit, if there was one.
async fn serve(
    socket: WebSocket,
    mut input: PtyInput,
    output: PtyOutput,
    mut hold: Option<ConnectionHold>,
) -> Option<aviary_envd_proto::ExitInfo> {
    let (mut ws_tx, mut ws_rx) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(OUTPUT_QUEUE);
    // one writer owns the socket's sending half; terminal output already
    // queued behind the first chunk goes out in the same message
    let writer = tokio::spawn(async move {
        let mut next = out_rx.recv().await;
        while let Some(m) = next.take() {
            let m = match m {
                Message::Binary(first) => {
                    let mut joined = first.to_vec();
                    while joined.len() < COALESCE_BYTES {
                        match out_rx.try_recv() {
                            Ok(Message::Binary(more)) => joined.extend_from_slice(&more),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    Message::Binary(joined.into())
                }
                other => other,
            };
            let close = matches!(m, Message::Close(_));
            if ws_tx.send(m).await.is_err() || close {
                break;
            }
            if next.is_none() {
                next = out_rx.recv().await;
            }
        }
    });
    // terminal output (a task of its own: reading a frame is not
    // cancellation-safe, and a process that does not read its input must
    // not stop its output)
    let to_client = out_tx.clone();
    let mut pump = tokio::spawn(async move { pump_output(output, to_client).await });
    let stopping = async {
        match hold.as_mut() {
            Some(h) => h.stopping().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(stopping);
    let exit = loop {
        tokio::select! {
            done = &mut pump => break done.ok().flatten(),
            () = &mut stopping => {
                // the server is shutting down: the session ends (envd kills it)
                pump.abort();
                let _ = out_tx
                    .send(Message::Close(Some(CloseFrame {
                        code: 1001,
                        reason: Utf8Bytes::from_static("server stopping"),
                    })))
                    .await;
                break None;
            }
            msg = ws_rx.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if input.write(&b).await.is_err() {
                        // envd closed the connection: the session ended
                        // (the exit, if it came, is still in the pump's hands)
                        break (&mut pump).await.ok().flatten();
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    if let Err(e) = control(&mut input, &t).await {
                        let _ = out_tx.send(error_message(&e)).await;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => {
                    // the client left: both halves dropped, envd hangs the
                    // terminal up and kills the session
                    pump.abort();
                    break None;
                }
            }
        }
    };
    drop(input);
    drop(out_tx);
    let _ = writer.await;
    exit
}

/// Forwards terminal output, then the exit (or the error) and a close.
async fn pump_output(
    mut output: PtyOutput,
    to_client: mpsc::Sender<Message>,
) -> Option<aviary_envd_proto::ExitInfo> {
    loop {
        match output.next().await {
            Ok(PtyEvent::Output(b)) => {
                if to_client.send(Message::Binary(b.into())).await.is_err() {
                    return None;
                }
            }
            Ok(PtyEvent::Exit(e)) => {
                let msg = serde_json::json!({"exit": {
                    "exit_code": e.exit_code,
                    "signal": e.signal,
                    "duration_ms": e.duration.as_secs_f64() * 1000.0,
                }});
                let _ = to_client
                    .send(Message::Text(Utf8Bytes::from(msg.to_string())))
                    .await;
                let _ = to_client
                    .send(Message::Close(Some(CloseFrame {
                        code: 1000,
                        reason: Utf8Bytes::from_static("exited"),
                    })))
                    .await;
                return Some(e);
            }
            Err(e) => {
                let e = OpError::from(e);
                let _ = to_client.send(error_message(&e)).await;
                let _ = to_client
                    .send(Message::Close(Some(CloseFrame {
                        code: 1011,
                        reason: Utf8Bytes::from(e.code().as_str()),
                    })))
                    .await;
                return None;
            }
        }
    }
}

/// Applies one control message; a bad one is the caller's error.
async fn control(input: &mut PtyInput, text: &str) -> Result<(), OpError> {
    // the client's control messages are envd's, word for word
    let msg: PtyControl = serde_json::from_str(text).map_err(|e| {
        OpError::InvalidRequest(format!("invalid control message (resize or signal): {e}"))
    })?;
    let r = match msg {
        PtyControl::Resize { cols, rows } => {
            aviary_envd_proto::check_pty_size(cols, rows).map_err(OpError::InvalidRequest)?;
            input.resize(cols, rows).await
        }
        PtyControl::Signal { signal } => input.signal(signal).await,
    };
    r.map_err(OpError::from)
}
