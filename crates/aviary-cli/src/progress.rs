//! Progress display for long client work (template import, snapshot, fork,
//! hibernate, wake, `sandbox cp`), on the `indicatif` crate.
//!
//! Shown on stderr only when stderr is a terminal and `--json` is off, so
//! scripts, pipes and `--json` readers see exactly what they saw before;
//! `AVIARY_NO_PROGRESS=1` turns it off on a terminal too. Every bar is
//! cleared when the work ends, whichever way it ends (drop).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether progress is drawn for this invocation.
pub fn enabled(json: bool) -> bool {
    !json
        && std::io::stderr().is_terminal()
        && std::env::var_os("AVIARY_NO_PROGRESS").is_none_or(|v| v.is_empty() || v == "0")
}

/// One progress display; a hidden one when progress is off.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `len` (a spinner when `None`) drawing to stderr, or
    /// hidden when progress is off: decided before anything could draw.
    fn bar(len: Option<u64>, json: bool) -> ProgressBar {
        let target = if enabled(json) {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        ProgressBar::with_draw_target(len, target)
    }

    /// A spinner with `message` and the elapsed time, for work whose size
    /// the client cannot know (a snapshot, a fork, a wake).
    pub fn spinner(message: impl Into<String>, json: bool) -> Progress {
        let bar = Progress::bar(None, json);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .expect("static template")
                .tick_strings(&["-", "\\", "|", "/", "-"]),
        );
        bar.set_message(message.into());
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress { bar }
    }

    /// A byte counter: a bar when `total` is known, else bytes and rate.
    pub fn bytes(message: impl Into<String>, total: Option<u64>, json: bool) -> Progress {
        let bar = match total {
            Some(t) => {
                let bar = Progress::bar(Some(t), json);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                    )
                    .expect("static template")
                    .progress_chars("=> "),
                );
                bar
            }
            None => {
                let bar = Progress::bar(None, json);
                bar.set_style(
                    ProgressStyle::with_template("{spinner} {msg} {bytes} {bytes_per_sec}")
                        .expect("static template")
                        .tick_strings(&["-", "\\", "|", "/", "-"]),
                );
                bar.enable_steady_tick(Duration::from_millis(120));
                bar
            }
        };
        bar.set_message(message.into());
        Progress { bar }
    }

    /// Counts `reader`'s bytes as they are read.
    pub fn wrap_read<R: tokio::io::AsyncRead + Unpin>(
        &self,
        reader: R,
    ) -> indicatif::ProgressBarIter<R> {
        self.bar.wrap_async_read(reader)
    }

    /// Counts `writer`'s bytes as they are written.
    pub fn wrap_write<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        writer: W,
    ) -> indicatif::ProgressBarIter<W> {
        self.bar.wrap_async_write(writer)
    }

    /// Names what is being worked on now (a file of a directory copy).
    pub fn set_message(&self, message: impl Into<String>) {
        self.bar.set_message(message.into());
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn json_never_shows_progress() {
        assert!(!enabled(true));
    }

    /// A hidden bar still passes every byte through unchanged and counts it.
    #[tokio::test]
    async fn wrapped_streams_pass_bytes_through() {
        let p = Progress::bytes("copy", Some(11), true);
        let mut r = p.wrap_read(&b"hello world"[..]);
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
        assert_eq!(p.bar.position(), 11);
        let mut w = p.wrap_write(Vec::new());
        w.write_all(b"abc").await.unwrap();
        assert_eq!(p.bar.position(), 14);
    }
}
