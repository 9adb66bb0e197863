//! The events of execd's `POST /command` stream, in the framing real execd
//! writes ("legacy": one bare JSON object followed by `\n\n`, never mixed
//! with `data:` lines in one stream). Every event carries `timestamp`
//! (milliseconds since the epoch): the SDK silently drops an event without
//! one.
//!
//! Exit codes travel as execd sends them: a zero exit is an
//! `execution_complete` event, a non-zero one an `error` event whose
//! `evalue` is the code in decimal and no `execution_complete` (the SDK
//! reads an `execution_complete` as exit code 0).
//!
//! Output text is cut at line ends ([`LineSplitter`]): AgentScope joins
//! event texts and inserts a newline between two events when neither side
//! has whitespace at the seam, so an event cut inside a word would gain a
//! newline. Bytes that are not UTF-8 are replaced (the wire is JSON text).

use bytes::Bytes;
use serde_json::json;

/// One event of the command stream.
#[derive(Clone, Debug, PartialEq)]
pub enum CommandEvent {
    /// First event: the execution's id.
    Init {
        execution_id: String,
    },
    Stdout(String),
    Stderr(String),
    /// Sent after a stretch of silence, so idle connections stay open.
    Ping,
    /// The command exited 0.
    Complete {
        execution_time_ms: u64,
    },
    /// The command exited non-zero (`evalue` is the code) or could not run
    /// to its end (`evalue` is the reason, not a number).
    Error {
        evalue: String,
        traceback: Vec<String>,
    },
}

impl CommandEvent {
    /// The event as JSON with its `timestamp`.
    pub fn to_json(&self, timestamp_ms: i64) -> serde_json::Value {
        match self {
            CommandEvent::Init { execution_id } => {
                json!({"type": "init", "text": execution_id, "timestamp": timestamp_ms})
            }
            CommandEvent::Stdout(t) => {
                json!({"type": "stdout", "text": t, "timestamp": timestamp_ms})
            }
            CommandEvent::Stderr(t) => {
                json!({"type": "stderr", "text": t, "timestamp": timestamp_ms})
            }
            CommandEvent::Ping => {
                json!({"type": "ping", "text": "pong", "timestamp": timestamp_ms})
            }
            CommandEvent::Complete { execution_time_ms } => json!({
                "type": "execution_complete",
                "execution_time": execution_time_ms,
                "timestamp": timestamp_ms,
            }),
            CommandEvent::Error { evalue, traceback } => json!({
                "type": "error",
                "error": {"ename": "CommandExecError", "evalue": evalue, "traceback": traceback},
                "timestamp": timestamp_ms,
            }),
        }
    }

    /// The event framed for the wire: the JSON object (which holds no raw
    /// newline: serde escapes them in strings) and `\n\n`.
    pub fn frame(&self, timestamp_ms: i64) -> Bytes {
        let mut out = serde_json::to_vec(&self.to_json(timestamp_ms))
            .expect("a JSON value always serializes");
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }

    /// The events that end a command with exit `code`.
    pub fn exit(code: i32, execution_time_ms: u64) -> CommandEvent {
        if code == 0 {
            CommandEvent::Complete { execution_time_ms }
        } else {
            CommandEvent::Error {
                evalue: code.to_string(),
                traceback: vec![format!("exit status {code}")],
            }
        }
    }
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// Cuts one output stream into texts that end at a line end: what arrives
/// is held until its line is complete, unless more than [`Self::MAX_HELD`]
/// bytes wait (a long line without a newline still streams) or the stream
/// ends ([`Self::finish`]). A UTF-8 sequence split across chunks is kept
/// whole.
#[derive(Default)]
pub struct LineSplitter {
    held: Vec<u8>,
}

impl LineSplitter {
    /// Longest partial line held back.
    pub const MAX_HELD: usize = 64 * 1024;

    /// The complete lines `chunk` finishes, if any.
    pub fn push(&mut self, chunk: &[u8]) -> Option<String> {
        self.held.extend_from_slice(chunk);
        let cut = match self.held.iter().rposition(|&b| b == b'\n') {
            Some(i) => i + 1,
            None if self.held.len() > Self::MAX_HELD => utf8_boundary(&self.held),
            None => return None,
        };
        if cut == 0 {
            return None;
        }
        let rest = self.held.split_off(cut);
        let text = String::from_utf8_lossy(&self.held).into_owned();
        self.held = rest;
        Some(text)
    }

    /// Whatever is still held (the last line had no newline).
    pub fn finish(&mut self) -> Option<String> {
        if self.held.is_empty() {
            return None;
        }
        let text = String::from_utf8_lossy(&self.held).into_owned();
        self.held.clear();
        Some(text)
    }
}

/// The longest prefix of `b` that does not end inside a UTF-8 sequence.
fn utf8_boundary(b: &[u8]) -> usize {
    match std::str::from_utf8(b) {
        Ok(_) => b.len(),
        // an incomplete sequence at the end: stop before it
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        // invalid bytes inside: they are replaced anyway
        Err(_) => b.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(frame: &Bytes) -> serde_json::Value {
        let s = std::str::from_utf8(frame).unwrap();
        let body = s
            .strip_suffix("\n\n")
            .expect("frame ends with a blank line");
        assert!(
            !body.contains('\n'),
            "a raw newline inside a frame: {body:?}"
        );
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn every_event_has_a_type_and_timestamp_and_legacy_framing() {
        let events = [
            CommandEvent::Init {
                execution_id: "x1".into(),
            },
            CommandEvent::Stdout("a\nb\n".into()),
            CommandEvent::Stderr("e\n".into()),
            CommandEvent::Ping,
            CommandEvent::exit(0, 12),
            CommandEvent::exit(3, 12),
        ];
        for ev in &events {
            let frame = ev.frame(1_700_000_000_123);
            assert_eq!(frame[0], b'{', "legacy framing starts with the object");
            let v = parse(&frame);
            assert_eq!(v["timestamp"], 1_700_000_000_123i64, "{ev:?}");
            assert!(v["type"].is_string(), "{ev:?}");
        }
        assert_eq!(parse(&events[1].frame(1))["text"], "a\nb\n");
    }

    #[test]
    fn exit_zero_completes_and_non_zero_is_an_error_with_the_code() {
        let ok = CommandEvent::exit(0, 5).to_json(1);
        assert_eq!(ok["type"], "execution_complete");
        assert_eq!(ok["execution_time"], 5);
        let failed = CommandEvent::exit(3, 5).to_json(1);
        assert_eq!(failed["type"], "error");
        assert_eq!(failed["error"]["evalue"], "3");
        assert_eq!(failed["error"]["ename"], "CommandExecError");
        assert_eq!(failed["error"]["traceback"][0], "exit status 3");
        let signalled = CommandEvent::exit(-1, 5).to_json(1);
        assert_eq!(signalled["error"]["evalue"], "-1");
    }

    #[test]
    fn splitter_cuts_at_line_ends_and_holds_partial_lines() {
        let mut s = LineSplitter::default();
        assert_eq!(s.push(b"hel"), None);
        assert_eq!(s.push(b"lo\nwor").as_deref(), Some("hello\n"));
        assert_eq!(s.push(b"ld\nx\ny").as_deref(), Some("world\nx\n"));
        assert_eq!(s.finish().as_deref(), Some("y"));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn splitter_keeps_utf8_sequences_whole_and_streams_long_lines() {
        let mut s = LineSplitter::default();
        let snow = "☃".as_bytes(); // 3 bytes
        assert_eq!(s.push(&snow[..1]), None);
        assert_eq!(
            s.push(&[&snow[1..], b"\n"].concat()).as_deref(),
            Some("☃\n")
        );
        let mut long = vec![b'a'; LineSplitter::MAX_HELD];
        long.extend_from_slice(&snow[..2]);
        let out = s.push(&long).unwrap();
        assert_eq!(
            out.len(),
            LineSplitter::MAX_HELD,
            "cut before the split sequence"
        );
        assert_eq!(s.push(&snow[2..]), None);
        assert_eq!(s.finish().as_deref(), Some("☃"));
    }
}
