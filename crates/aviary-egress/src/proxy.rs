//! One proxied connection: read a bounded request head, judge it, connect
//! to the pinned address, relay with an idle timeout.

use crate::classify::{forbidden, parse_host, Host};
use crate::rules::{judge, Verdict};
use crate::SandboxCtx;
use aviary_core::egress::EgressDenial;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::time::timeout;

/// Longest a name lookup or an upstream connect may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Most headers a request head may carry.
const MAX_HEADERS: usize = 64;
/// Longest host string kept in a denial (the sandbox wrote it).
const MAX_REPORTED_HOST: usize = 255;

/// Why a request is not forwarded.
#[derive(Debug)]
enum Refusal {
    /// Policy: 403 and a denial event.
    Denied { reason: String },
    /// Malformed or unsupported request: this status, no event.
    Bad { status: u16, reason: String },
}

fn bad(status: u16, reason: impl Into<String>) -> Refusal {
    Refusal::Bad {
        status,
        reason: reason.into(),
    }
}

pub(crate) async fn serve(ctx: &SandboxCtx, mut client: UnixStream) {
    let idle = Duration::from_secs(u64::from(ctx.policy.limits.idle_timeout_s.max(1)));
    let Ok(_permit) = ctx.connections.clone().try_acquire_owned() else {
        let _ = respond(&mut client, 429, "too many open egress connections").await;
        return;
    };
    let max = ctx.policy.limits.max_header_bytes as usize;
    let (head, rest) = match timeout(idle, read_head(&mut client, max)).await {
        Ok(Ok(Some(h))) => h,
        Ok(Ok(None)) | Err(_) => return,
        Ok(Err(status)) => {
            let _ = respond(&mut client, status, "request head too large").await;
            return;
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return,
        Err(httparse::Error::TooManyHeaders) => {
            let _ = respond(&mut client, 431, "too many request headers").await;
            return;
        }
        Err(_) => {
            let _ = respond(&mut client, 400, "malformed request").await;
            return;
        }
    }
    let method = req.method.unwrap_or_default().to_owned();
    let target = req.path.unwrap_or_default().to_owned();
    let connect = method == "CONNECT";
    let parsed = if connect {
        split_authority(&target, None).map(|(h, p)| (h, p, String::new()))
    } else {
        absolute_form(&target)
    };
    let (raw_host, port, path) = match parsed {
        Ok(t) => t,
        Err(r) => {
            let _ = respond_refusal(ctx, &mut client, "", 0, &method, r).await;
            return;
        }
    };
    let upstream = match decide(ctx, &raw_host, port, &method).await {
        Ok(a) => a,
        Err(r) => {
            let _ = respond_refusal(ctx, &mut client, &raw_host, port, &method, r).await;
            return;
        }
    };
    let mut server = match timeout(UPSTREAM_TIMEOUT, TcpStream::connect(upstream)).await {
        Ok(Ok(s)) => s,
        _ => {
            let _ = respond(&mut client, 502, "upstream connect failed").await;
            return;
        }
    };
    tracing::debug!(sandbox.id = %ctx.id, host = %raw_host, port, method = %method, "egress allowed");
    if connect {
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
            || server.write_all(&rest).await.is_err()
        {
            return;
        }
        relay(&mut client, &mut server, idle).await;
        return;
    }
    // plain HTTP: one request, its body exactly, then the answer
    let mut body_len: u64 = 0;
    let mut seen_length = false;
    let mut out = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        if name == "transfer-encoding" {
            let _ = respond(&mut client, 411, "chunked request bodies are not proxied").await;
            return;
        }
        if name == "content-length" {
            // one length only: two could make the origin read the body as a
            // second request (one the method limit never judged)
            if seen_length {
                let _ = respond(&mut client, 400, "more than one content-length").await;
                return;
            }
            seen_length = true;
            match std::str::from_utf8(h.value)
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse().ok())
            {
                Some(n) => body_len = n,
                None => {
                    let _ = respond(&mut client, 400, "bad content-length").await;
                    return;
                }
            }
        }
        if matches!(
            name.as_str(),
            "host" | "connection" | "keep-alive" | "te" | "trailer" | "upgrade"
        ) || name.starts_with("proxy-")
        {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    let host_header = if port == 80 {
        raw_host.clone()
    } else {
        format!("{raw_host}:{port}")
    };
    out.extend_from_slice(format!("Host: {host_header}\r\nConnection: close\r\n\r\n").as_bytes());
    if server.write_all(&out).await.is_err() {
        return;
    }
    // the part of the body read with the head, then the rest; never more
    let early = rest
        .len()
        .min(usize::try_from(body_len).unwrap_or(usize::MAX));
    if server.write_all(&rest[..early]).await.is_err() {
        return;
    }
    let mut remaining = body_len - early as u64;
    let (mut cr, _cw) = client.split();
    let mut buf = vec![0u8; 16 * 1024];
    while remaining > 0 {
        let want = buf
            .len()
            .min(usize::try_from(remaining).unwrap_or(usize::MAX));
        match timeout(idle, cr.read(&mut buf[..want])).await {
            Ok(Ok(n)) if n > 0 => {
                if server.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                remaining -= n as u64;
            }
            _ => return,
        }
    }
    copy_idle(&mut server, &mut client, idle).await;
}

/// Reads up to the end of the head (`\r\n\r\n`). `Ok(None)`: the client
/// went away; `Err(431)`: longer than `max`.
async fn read_head(client: &mut UnixStream, max: usize) -> Result<Option<(Vec<u8>, Vec<u8>)>, u16> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = match client.read(&mut chunk).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => n,
        };
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + i + 4;
            if end > max {
                return Err(431);
            }
            let rest = buf.split_off(end);
            return Ok(Some((buf, rest)));
        }
        if buf.len() > max {
            return Err(431);
        }
    }
}

/// `host:port` (CONNECT's target, or an absolute URL's authority).
fn split_authority(auth: &str, default_port: Option<u16>) -> Result<(String, u16), Refusal> {
    if auth.contains('@') {
        return Err(bad(400, "credentials in the request target"));
    }
    let (host, port) = if let Some(end) = auth.strip_prefix('[').and_then(|r| r.find(']')) {
        let host = &auth[..end + 2];
        let after = &auth[end + 2..];
        (host, after.strip_prefix(':'))
    } else {
        match auth.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (auth, None),
        }
    };
    let port = match (port, default_port) {
        (Some(p), _) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad(400, "bad port"))?,
        (None, Some(d)) => d,
        (None, None) => return Err(bad(400, "CONNECT needs host:port")),
    };
    if host.is_empty() {
        return Err(bad(400, "empty host"));
    }
    Ok((host.to_owned(), port))
}

/// `http://authority/path?query` → host, port, origin-form path.
fn absolute_form(target: &str) -> Result<(String, u16, String), Refusal> {
    let Some(after) = target
        .get(..7)
        .filter(|s| s.eq_ignore_ascii_case("http://"))
        .map(|_| &target[7..])
    else {
        return Err(bad(
            400,
            "not an absolute http:// URL (use CONNECT for https)",
        ));
    };
    let end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let (auth, path) = after.split_at(end);
    let path = match path {
        "" => "/".to_owned(),
        p if p.starts_with('/') => p.split('#').next().unwrap_or("/").to_owned(),
        p => format!("/{}", p.split('#').next().unwrap_or("")),
    };
    let (host, port) = split_authority(auth, Some(80))?;
    Ok((host, port, path))
}

/// The address to connect to, or why not.
async fn decide(
    ctx: &SandboxCtx,
    raw_host: &str,
    port: u16,
    method: &str,
) -> Result<SocketAddr, Refusal> {
    let denied = |reason: String| Refusal::Denied { reason };
    let name = match parse_host(raw_host) {
        Err(why) => return Err(denied(format!("bad host: {why}"))),
        Ok(Host::Ip(ip)) => {
            return Err(denied(match forbidden(ip) {
                Some(range) => format!("address {ip} is {range}: always denied"),
                None => format!("IP literal {ip}: only allowed domain names are reached"),
            }))
        }
        Ok(Host::Name(n)) => n,
    };
    if let Verdict::Deny(reason) = judge(&ctx.policy, &name, method) {
        return Err(denied(reason));
    }
    // the operator's override, trusted as configured
    if let Some(to) = ctx.policy.resolve.get(&name) {
        if let Ok(sa) = to.parse::<SocketAddr>() {
            return Ok(sa);
        }
        if let Ok(ip) = to.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, port));
        }
        return Err(bad(502, "bad resolve override"));
    }
    let answers = match timeout(
        UPSTREAM_TIMEOUT,
        tokio::net::lookup_host((name.as_str(), port)),
    )
    .await
    {
        Ok(Ok(a)) => a.collect::<Vec<_>>(),
        _ => return Err(bad(502, format!("cannot resolve {name}"))),
    };
    // pinned: the address judged is the address connected to
    if let Some(ok) = answers.iter().find(|a| forbidden(a.ip()).is_none()) {
        return Ok(*ok);
    }
    match answers.first() {
        Some(a) => Err(denied(format!(
            "{name} resolves to {} ({}): always denied",
            a.ip(),
            forbidden(a.ip()).unwrap_or("denied")
        ))),
        None => Err(bad(502, format!("cannot resolve {name}"))),
    }
}

async fn respond_refusal(
    ctx: &SandboxCtx,
    client: &mut UnixStream,
    host: &str,
    port: u16,
    method: &str,
    r: Refusal,
) -> std::io::Result<()> {
    match r {
        Refusal::Bad { status, reason } => respond(client, status, &reason).await,
        Refusal::Denied { reason } => {
            let mut host: String = host.chars().filter(|c| !c.is_control()).collect();
            host.truncate(
                host.char_indices()
                    .nth(MAX_REPORTED_HOST)
                    .map(|(i, _)| i)
                    .unwrap_or(host.len()),
            );
            let method: String = method.chars().take(32).collect();
            tracing::info!(sandbox.id = %ctx.id, host = %host, port, method = %method, reason = %reason, "egress denied");
            let budget = ctx.reports.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(unreported) = budget {
                let mut text = reason.clone();
                if unreported > 0 {
                    text.push_str(&format!(
                        " (and {unreported} earlier denials over the report budget)"
                    ));
                }
                let d = EgressDenial {
                    sandbox: ctx.id.clone(),
                    profile: ctx.policy.profile.clone(),
                    host,
                    port,
                    method,
                    reason: text,
                };
                if ctx.denials.try_send(d).is_err() {
                    tracing::warn!(sandbox.id = %ctx.id, "egress denial queue full: event dropped");
                }
            }
            respond(client, 403, &reason).await
        }
    }
}

async fn respond(client: &mut UnixStream, status: u16, reason: &str) -> std::io::Result<()> {
    let text = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        411 => "Length Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        _ => "Error",
    };
    let body = format!("aviary egress: {reason}\n");
    let msg = format!(
        "HTTP/1.1 {status} {text}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nX-Aviary-Egress: refused\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(msg.as_bytes()).await?;
    client.shutdown().await
}

/// Both directions until both end or nothing moves for `idle`.
async fn relay(client: &mut UnixStream, server: &mut TcpStream, idle: Duration) {
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let mut cbuf = vec![0u8; 16 * 1024];
    let mut sbuf = vec![0u8; 16 * 1024];
    let (mut c_open, mut s_open) = (true, true);
    while c_open || s_open {
        let step = timeout(idle, async {
            tokio::select! {
                r = cr.read(&mut cbuf), if c_open => (true, r),
                r = sr.read(&mut sbuf), if s_open => (false, r),
            }
        })
        .await;
        let Ok((from_client, r)) = step else { return };
        match (from_client, r) {
            (true, Ok(n)) if n > 0 => {
                if sw.write_all(&cbuf[..n]).await.is_err() {
                    return;
                }
            }
            (true, _) => {
                c_open = false;
                let _ = sw.shutdown().await;
            }
            (false, Ok(n)) if n > 0 => {
                if cw.write_all(&sbuf[..n]).await.is_err() {
                    return;
                }
            }
            (false, _) => {
                s_open = false;
                let _ = cw.shutdown().await;
            }
        }
    }
}

/// One direction until EOF or nothing moves for `idle`.
async fn copy_idle<R, W>(from: &mut R, to: &mut W, idle: Duration)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match timeout(idle, from.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            _ => break,
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        let (h, p, path) = absolute_form("http://pkgs.test:8080/simple/x?y=1#frag")
            .ok()
            .unwrap();
        assert_eq!(
            (h.as_str(), p, path.as_str()),
            ("pkgs.test", 8080, "/simple/x?y=1")
        );
        let (h, p, path) = absolute_form("HTTP://Example.org").unwrap();
        assert_eq!((h.as_str(), p, path.as_str()), ("Example.org", 80, "/"));
        let (h, p, _) = absolute_form("http://[::1]:81/").unwrap();
        assert_eq!((h.as_str(), p), ("[::1]", 81));
        absolute_form("https://x.org/").unwrap_err();
        absolute_form("/relative").unwrap_err();
        absolute_form("http://user:pw@x.org/").unwrap_err();
        absolute_form("http://x.org:0/").unwrap_err();
        absolute_form("http://x.org:99999/").unwrap_err();
        let (h, p) = split_authority("pypi.org:443", None).unwrap();
        assert_eq!((h.as_str(), p), ("pypi.org", 443));
        split_authority("pypi.org", None).unwrap_err();
        let (h, p) = split_authority("[::ffff:10.0.0.1]:443", None).unwrap();
        assert_eq!((h.as_str(), p), ("[::ffff:10.0.0.1]", 443));
    }
}
