//! `connect` fails fast and names the server, never the password.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod support;

use aviary_coord_redis::{connect, ConnectError, CONNECT_TIMEOUT};
use std::time::Duration;

/// The error and its sources, as the edge prints them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out = format!("{out}: {s}");
        source = s.source();
    }
    out
}

/// Generous: only proves the call does not hang (the retries and the
/// timeout are CONNECT_TIMEOUT long).
const NO_HANG: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_closed_port_fails_fast_naming_it() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("redis://:hunter2@127.0.0.1:{port}/0");
    let Err(e) = tokio::time::timeout(NO_HANG, connect(&url))
        .await
        .expect("connect to a closed port hung")
    else {
        panic!("connected to a closed port");
    };
    assert!(matches!(e, ConnectError::Connect { .. }), "{e:?}");
    let text = chain(&e);
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("hunter2"), "the password leaked: {text}");
}

/// A server that accepts but never answers: the timeout, naming it.
#[tokio::test]
async fn a_silent_server_times_out_naming_it() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let url = format!("redis://:hunter2@127.0.0.1:{port}/0");
    let Err(e) = tokio::time::timeout(NO_HANG, connect(&url))
        .await
        .expect("connect to a silent server hung")
    else {
        panic!("connected to a silent server");
    };
    let text = chain(&e);
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("hunter2"), "the password leaked: {text}");
    if let ConnectError::Timeout { waited, .. } = &e {
        assert_eq!(*waited, CONNECT_TIMEOUT);
    }
    silent.abort();
}

#[tokio::test]
async fn the_test_redis_answers() {
    let Some(url) = support::redis_url() else {
        return;
    };
    connect(&url).await.unwrap();
}
