//! Input checks at the HTTP edge: every name that can end up in a file path,
//! a chunk-store key or a log line, and every exec request, is checked here
//! before any operation runs, so bad input is a 4xx with a stable code and
//! never reaches the registry, the snapshot store or a sandbox.
//!
//! Rules: identifiers (tenant, user_id, session_id, agent, class, network
//! profile, key ids) are 1-64 of `[A-Za-z0-9._-]` starting with a letter or
//! digit, the configuration file's rule, so `../x`, `a/b`, NUL and non-ASCII
//! names are refused; template names follow the template store (up to 128).
//! An exec's command (argv, cwd and environment) must fit one envd frame.

use crate::error::OpError;
use aviary_core::api::{CreateKeyRequest, CreateSandboxRequest, ExecRequest};

/// Longest identifier.
pub const MAX_IDENTIFIER: usize = 64;
/// Longest template name (the template store's rule).
pub const MAX_TEMPLATE_NAME: usize = 128;
/// Largest exec command (argv, cwd and env, JSON-encoded). envd reads one
/// request frame of at most [`aviary_envd_proto::MAX_JSON_FRAME`]; the rest of
/// the frame is the operation's other fields.
pub const MAX_EXEC_COMMAND_BYTES: usize = aviary_envd_proto::MAX_JSON_FRAME as usize - 1024;

fn is_identifier(v: &str, max: usize) -> bool {
    !v.is_empty()
        && v.len() <= max
        && v.as_bytes()[0].is_ascii_alphanumeric()
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `field` must be an identifier; the error names the field.
pub fn identifier(field: &str, v: &str) -> Result<(), OpError> {
    if is_identifier(v, MAX_IDENTIFIER) {
        return Ok(());
    }
    Err(OpError::InvalidRequest(format!(
        "{field} must be 1-{MAX_IDENTIFIER} characters of A-Z a-z 0-9 '.' '_' '-', starting with a letter or digit"
    )))
}

/// A template name (as the template store accepts it).
pub fn template_name(v: &str) -> Result<(), OpError> {
    if is_identifier(v, MAX_TEMPLATE_NAME) {
        return Ok(());
    }
    Err(OpError::InvalidRequest(format!(
        "template must be 1-{MAX_TEMPLATE_NAME} characters of A-Z a-z 0-9 '.' '_' '-', starting with a letter or digit"
    )))
}

/// The names of a create request.
pub fn create_request(req: &CreateSandboxRequest) -> Result<(), OpError> {
    if let Some(t) = &req.template {
        template_name(t)?;
    }
    for (field, v) in [
        ("class", &req.class),
        ("network", &req.network),
        ("user_id", &req.user_id),
        ("session_id", &req.session_id),
        ("agent", &req.agent),
        ("from_snapshot", &req.from_snapshot),
    ] {
        if let Some(v) = v {
            identifier(field, v)?;
        }
    }
    labels(&req.metadata)?;
    if let Some(dir) = &req.workdir {
        crate::ops::check_sandbox_path(dir)?;
    }
    sandbox_env(&req.env)
}

/// At most this many labels (`metadata`) on a sandbox.
pub const MAX_LABELS: usize = 64;
/// Longest label key and value.
pub const MAX_LABEL_KEY: usize = 128;
pub const MAX_LABEL_VALUE: usize = 1024;
/// At most this many default environment variables on a sandbox, and their
/// total size (names and values), so that every exec still fits envd's frame.
pub const MAX_SANDBOX_ENV: usize = 128;
pub const MAX_SANDBOX_ENV_BYTES: usize = 32 * 1024;

/// A sandbox's labels: printable keys (dots allowed, e.g.
/// `agentscope.workspace.id`) and values without control characters.
pub fn labels(m: &std::collections::BTreeMap<String, String>) -> Result<(), OpError> {
    if m.len() > MAX_LABELS {
        return Err(OpError::InvalidRequest(format!(
            "metadata has {} entries; at most {MAX_LABELS}",
            m.len()
        )));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_LABEL_KEY || k.chars().any(char::is_control) {
            return Err(OpError::InvalidRequest(format!(
                "metadata key {k:?} must be 1-{MAX_LABEL_KEY} bytes without control characters"
            )));
        }
        if v.len() > MAX_LABEL_VALUE || v.chars().any(char::is_control) {
            return Err(OpError::InvalidRequest(format!(
                "metadata value of {k:?} must be at most {MAX_LABEL_VALUE} bytes without control characters"
            )));
        }
    }
    Ok(())
}

/// A sandbox's default exec environment: POSIX-style names
/// (`[A-Za-z_][A-Za-z0-9_]*`), values without NUL, bounded in count and size.
pub fn sandbox_env(m: &std::collections::BTreeMap<String, String>) -> Result<(), OpError> {
    if m.len() > MAX_SANDBOX_ENV {
        return Err(OpError::InvalidRequest(format!(
            "env has {} entries; at most {MAX_SANDBOX_ENV}",
            m.len()
        )));
    }
    let mut size = 0;
    for (k, v) in m {
        let b = k.as_bytes();
        let name_ok = !b.is_empty()
            && (b[0].is_ascii_alphabetic() || b[0] == b'_')
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if !name_ok {
            return Err(OpError::InvalidRequest(format!(
                "env name {k:?} must match [A-Za-z_][A-Za-z0-9_]*"
            )));
        }
        if v.contains('\0') {
            return Err(OpError::InvalidRequest(format!(
                "env value of {k} must not contain NUL"
            )));
        }
        size += k.len() + v.len();
    }
    if size > MAX_SANDBOX_ENV_BYTES {
        return Err(OpError::PayloadTooLarge(format!(
            "env is {size} bytes; at most {MAX_SANDBOX_ENV_BYTES}"
        )));
    }
    Ok(())
}

/// A key's tenant.
pub fn key_request(req: &CreateKeyRequest) -> Result<(), OpError> {
    identifier("tenant", &req.tenant)
}

/// An exec request: no NUL anywhere the kernel would cut a string, and a
/// command small enough for envd (413 `payload_too_large` otherwise). The
/// rest (exactly one of cmd/shell, cwd absolute, env names, timeout) is
/// checked by the operation.
pub fn exec_request(req: &ExecRequest) -> Result<(), OpError> {
    let has_nul = |s: &str| s.contains('\0');
    if req.cmd.iter().flatten().any(|a| has_nul(a)) || req.shell.as_deref().is_some_and(has_nul) {
        return Err(OpError::InvalidRequest(
            "arguments must not contain NUL".into(),
        ));
    }
    if req.cwd.as_deref().is_some_and(has_nul) {
        return Err(OpError::InvalidRequest("cwd must not contain NUL".into()));
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || has_nul(k) {
            return Err(OpError::InvalidRequest(format!(
                "env name {k:?} must be non-empty without '=' or NUL"
            )));
        }
        if has_nul(v) {
            return Err(OpError::InvalidRequest(format!(
                "env value of {k} must not contain NUL"
            )));
        }
    }
    let size = exec_command_size(req);
    if size > MAX_EXEC_COMMAND_BYTES {
        return Err(OpError::PayloadTooLarge(format!(
            "the command (arguments, cwd and environment) is {size} bytes encoded; at most {MAX_EXEC_COMMAND_BYTES} (pass large data through stdin or a file)"
        )));
    }
    Ok(())
}

/// JSON-encoded size of what envd receives in its request frame. Counted
/// without allocating the encoding: quoted string lengths plus separators,
/// with escapes counted at their escaped length.
fn exec_command_size(req: &ExecRequest) -> usize {
    fn quoted(s: &str) -> usize {
        2 + s
            .chars()
            .map(|c| match c {
                '"' | '\\' | '\n' | '\r' | '\t' | '\u{08}' | '\u{0c}' => 2,
                c if (c as u32) < 0x20 => 6,
                c => c.len_utf8(),
            })
            .sum::<usize>()
    }
    let argv: usize = match (&req.cmd, &req.shell) {
        (Some(cmd), _) => cmd.iter().map(|a| quoted(a) + 1).sum(),
        (None, Some(sh)) => quoted("/bin/sh") + quoted("-c") + quoted(sh) + 3,
        (None, None) => 0,
    };
    let env: usize = req.env.iter().map(|(k, v)| quoted(k) + quoted(v) + 4).sum();
    argv + env + req.cwd.as_deref().map_or(0, quoted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::ErrorCode;

    #[test]
    fn identifiers_refuse_paths_and_non_ascii() {
        for ok in ["default", "acme-1", "a", "A.b_c-9", &"x".repeat(64)] {
            identifier("tenant", ok).unwrap();
        }
        for bad in [
            "",
            "../../evil",
            "a/b",
            ".hidden",
            "-x",
            "naïve",
            "tab\tx",
            "nul\0",
            "sp ace",
            &"x".repeat(65),
        ] {
            let e = identifier("tenant", bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{bad:?}");
            assert!(e.to_string().starts_with("tenant "), "{e}");
        }
        template_name(&"t".repeat(128)).unwrap();
        template_name("../etc").unwrap_err();
    }

    #[test]
    fn labels_and_env_are_bounded() {
        let map = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        labels(&map(&[
            ("agentscope.workspace.id", "ws 1"),
            ("a/b", "x=y&z"),
        ]))
        .unwrap();
        for bad in [
            map(&[("", "v")]),
            map(&[("k\n", "v")]),
            map(&[("k", "v\0")]),
            map(&[(&"k".repeat(129), "v")]),
            map(&[("k", &"v".repeat(1025))]),
        ] {
            assert_eq!(labels(&bad).unwrap_err().code(), ErrorCode::InvalidRequest);
        }
        let many: std::collections::BTreeMap<String, String> =
            (0..65).map(|i| (format!("k{i}"), String::new())).collect();
        labels(&many).unwrap_err();

        sandbox_env(&map(&[("PATH", "/bin"), ("_X1", "a=b"), ("EMPTY", "")])).unwrap();
        for bad in [
            map(&[("1X", "v")]),
            map(&[("A-B", "v")]),
            map(&[("A=B", "v")]),
            map(&[("", "v")]),
            map(&[("X", "nul\0")]),
        ] {
            assert_eq!(
                sandbox_env(&bad).unwrap_err().code(),
                ErrorCode::InvalidRequest
            );
        }
        let big = map(&[("BIG", &"x".repeat(MAX_SANDBOX_ENV_BYTES))]);
        assert_eq!(
            sandbox_env(&big).unwrap_err().code(),
            ErrorCode::PayloadTooLarge
        );
    }

    #[test]
    fn create_names_every_bad_field() {
        for (field, req) in [
            (
                "user_id",
                CreateSandboxRequest {
                    user_id: Some("../../u".into()),
                    ..Default::default()
                },
            ),
            (
                "session_id",
                CreateSandboxRequest {
                    session_id: Some("s/1".into()),
                    ..Default::default()
                },
            ),
            (
                "agent",
                CreateSandboxRequest {
                    agent: Some("ägent".into()),
                    ..Default::default()
                },
            ),
            (
                "template",
                CreateSandboxRequest {
                    template: Some("bad name".into()),
                    ..Default::default()
                },
            ),
        ] {
            let e = create_request(&req).unwrap_err();
            assert!(e.to_string().starts_with(field), "{field}: {e}");
        }
        create_request(&CreateSandboxRequest::default()).unwrap();
    }

    fn exec(cmd: Vec<String>, env: Vec<(String, String)>) -> ExecRequest {
        ExecRequest {
            cmd: Some(cmd),
            env: env.into_iter().collect(),
            ..Default::default()
        }
    }

    #[test]
    fn oversized_exec_commands_are_payload_too_large() {
        let many_env = (0..10_000)
            .map(|i| (format!("V{i}"), "x".into()))
            .collect::<Vec<_>>();
        for req in [
            exec(vec!["true".into()], many_env),
            exec(vec!["a".into(); 100_000], vec![]),
            exec(vec!["echo".into(), "x".repeat(900 << 10)], vec![]),
            ExecRequest {
                shell: Some("x".repeat(MAX_EXEC_COMMAND_BYTES)),
                ..Default::default()
            },
        ] {
            let e = exec_request(&req).unwrap_err();
            assert_eq!(e.code(), ErrorCode::PayloadTooLarge, "{e}");
        }
        exec_request(&exec(vec!["echo".into(), "x".repeat(32 << 10)], vec![])).unwrap();
    }

    #[test]
    fn size_estimate_matches_the_encoding() {
        let req = exec(
            vec!["sh".into(), "-c".into(), "echo \"hi\"\n\u{1}é".into()],
            vec![("A".into(), "b\\c".into()), ("PATH".into(), "/bin".into())],
        );
        let encoded = serde_json::to_vec(&(
            req.cmd.as_ref().unwrap(),
            req.env.iter().collect::<Vec<_>>(),
        ))
        .unwrap();
        let estimate = exec_command_size(&req);
        assert!(
            estimate + 8 >= encoded.len() && estimate <= encoded.len() + 8,
            "{estimate} vs {}",
            encoded.len()
        );
    }

    #[test]
    fn nul_anywhere_in_exec_is_invalid_request() {
        for req in [
            exec(vec!["a\0b".into()], vec![]),
            exec(vec!["true".into()], vec![("K".into(), "v\0".into())]),
            exec(vec!["true".into()], vec![("K\0".into(), "v".into())]),
            exec(vec!["true".into()], vec![("A=B".into(), "v".into())]),
            ExecRequest {
                shell: Some("true".into()),
                cwd: Some("/tmp\0".into()),
                ..Default::default()
            },
        ] {
            let e = exec_request(&req).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        }
    }
}
