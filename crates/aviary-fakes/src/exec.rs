//! What [`crate::FakeEnvd`] answers to an `exec`: nothing runs; a script of
//! rules decides the output and the exit.
//!
//! Rules are consulted newest first; a rule answering `None` passes the call
//! on to older rules and finally to the built-ins:
//! - `echo ARGS..` prints the arguments joined by spaces and a newline
//!   (`echo -n` without the newline);
//! - `true` exits 0, `false` exits 1;
//! - `cat` without arguments prints its stdin;
//! - `sh -c "exit N"` (also `true`, `false`, `:`) exits N, for any `sh` or
//!   `bash` path;
//! - anything else exits 127 with a note on stderr, the way a shell reports
//!   an unknown command (the fake cannot tell whether a program exists).

use std::sync::Arc;

/// One exec the fake accepted (its token matched the fence and the request
/// was well formed), as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecCall {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    /// The bytes sent as stdin; `None` when the exec had no stdin.
    pub stdin: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
    pub token: Option<u64>,
    /// The sandbox user it was asked to run as.
    pub user: Option<String>,
}

/// How a scripted exec ends: its output (sent as one `Stdout` and one
/// `Stderr` stream, in chunks) and its exit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecReply {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Exit code, or 128 + signal number for a killed process.
    pub exit_code: i32,
    /// The signal that killed the process (e.g. 9 for an OOM kill).
    pub signal: Option<i32>,
    /// Report the exec as killed by its timeout.
    pub timed_out: bool,
}

impl ExecReply {
    /// Exit 0 with `stdout`.
    pub fn success(stdout: impl Into<Vec<u8>>) -> ExecReply {
        ExecReply {
            stdout: stdout.into(),
            ..ExecReply::default()
        }
    }

    /// Exit `code` without output.
    pub fn exit(code: i32) -> ExecReply {
        ExecReply {
            exit_code: code,
            ..ExecReply::default()
        }
    }

    /// Killed by `signal` (exit code 128 + signal).
    pub fn killed(signal: i32) -> ExecReply {
        ExecReply {
            exit_code: 128 + signal,
            signal: Some(signal),
            ..ExecReply::default()
        }
    }
}

/// A scripted answer: `None` passes the call on to the next rule.
pub(crate) type ExecRule = Arc<dyn Fn(&ExecCall) -> Option<ExecReply> + Send + Sync>;

/// The reply of the newest matching rule, else of the built-ins.
pub(crate) fn answer(rules: &[ExecRule], call: &ExecCall) -> ExecReply {
    rules
        .iter()
        .rev()
        .find_map(|rule| rule(call))
        .unwrap_or_else(|| builtin(call))
}

fn program(argv0: &str) -> &str {
    argv0.rsplit('/').next().unwrap_or(argv0)
}

fn builtin(call: &ExecCall) -> ExecReply {
    let argv: Vec<&str> = call.argv.iter().map(String::as_str).collect();
    let Some((argv0, args)) = argv.split_first() else {
        return unknown(call);
    };
    match (program(argv0), args) {
        ("echo", ["-n", rest @ ..]) => ExecReply::success(rest.join(" ")),
        ("echo", rest) => ExecReply::success(format!("{}\n", rest.join(" "))),
        ("true", _) => ExecReply::exit(0),
        ("false", _) => ExecReply::exit(1),
        ("cat", []) => ExecReply::success(call.stdin.clone().unwrap_or_default()),
        ("sh" | "bash", ["-c", script, ..]) => match script.trim() {
            "true" | ":" | "exit" => ExecReply::exit(0),
            // the control plane's level-1 reset script: a fake has no
            // processes left to kill and no temporary files to clear
            s if s.starts_with("kill -9 -1 ") => ExecReply::exit(0),
            "false" => ExecReply::exit(1),
            s => match s.strip_prefix("exit ").map(|n| n.trim().parse::<i32>()) {
                // A shell exits with the status modulo 256.
                Some(Ok(n)) => ExecReply::exit(n.rem_euclid(256)),
                _ => unknown(call),
            },
        },
        _ => unknown(call),
    }
}

fn unknown(call: &ExecCall) -> ExecReply {
    ExecReply {
        stderr: format!("fake envd: no exec rule for {:?}\n", call.argv).into_bytes(),
        exit_code: 127,
        ..ExecReply::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(argv: &[&str]) -> ExecCall {
        ExecCall {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: None,
            env: vec![],
            stdin: None,
            timeout_ms: None,
            token: None,
            user: Default::default(),
        }
    }

    #[test]
    fn builtins() {
        assert_eq!(answer(&[], &call(&["echo", "a", "b"])).stdout, b"a b\n");
        assert_eq!(answer(&[], &call(&["/bin/echo", "-n", "a"])).stdout, b"a");
        assert_eq!(answer(&[], &call(&["echo"])).stdout, b"\n");
        assert_eq!(
            answer(&[], &call(&["/bin/sh", "-c", "exit 7"])).exit_code,
            7
        );
        assert_eq!(answer(&[], &call(&["sh", "-c", "exit 300"])).exit_code, 44);
        assert_eq!(answer(&[], &call(&["false"])).exit_code, 1);
        let mut c = call(&["cat"]);
        c.stdin = Some(b"in".to_vec());
        assert_eq!(answer(&[], &c).stdout, b"in");
        let r = answer(&[], &call(&["make", "all"]));
        assert_eq!(r.exit_code, 127);
        assert!(String::from_utf8_lossy(&r.stderr).contains("make"));
    }

    #[test]
    fn the_newest_matching_rule_wins() {
        let rules: Vec<ExecRule> = vec![
            Arc::new(|_| Some(ExecReply::exit(1))),
            Arc::new(|c| (c.argv[0] == "ls").then(|| ExecReply::success("a\n"))),
        ];
        assert_eq!(answer(&rules, &call(&["ls"])).stdout, b"a\n");
        assert_eq!(answer(&rules, &call(&["echo", "x"])).exit_code, 1);
    }
}
