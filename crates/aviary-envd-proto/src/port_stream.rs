//! [`PortStream`]: the client end of a port tunnel (`connect`), an
//! `AsyncRead + AsyncWrite` byte stream over envd's framing.
//!
//! Reads decode `Data` frames (at most [`crate::MAX_DATA_FRAME`] each, the
//! header checked before any payload is read) and end at `End`; any other
//! frame is a protocol error. Writes go out as `Data` frames of at most
//! [`CHUNK_SIZE`]; `shutdown` sends `End` (a half-close: the sandbox's server
//! sees EOF, its answer still comes back). Dropping the stream closes the
//! connection, and envd closes the tunnel.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::client::Conn;
use crate::{decode_header, encode_header, FrameKind, ProtoError, CHUNK_SIZE, FRAME_HEADER_LEN};

/// A byte tunnel to a port inside a sandbox; see the module docs.
#[derive(Debug)]
pub struct PortStream {
    conn: Conn,
    /// Payload bytes of the current `Data` frame not yet handed out.
    remaining: usize,
    header: [u8; FRAME_HEADER_LEN],
    header_filled: usize,
    read_done: bool,
    /// An encoded frame being written, and how much of it is out.
    pending: Vec<u8>,
    written: usize,
    end_sent: bool,
}

impl PortStream {
    pub(crate) fn new(conn: Conn) -> PortStream {
        PortStream {
            conn,
            remaining: 0,
            header: [0; FRAME_HEADER_LEN],
            header_filled: 0,
            read_done: false,
            pending: Vec::new(),
            written: 0,
            end_sent: false,
        }
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut self.conn).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    fn queue(&mut self, kind: FrameKind, payload: &[u8]) {
        self.pending.clear();
        self.pending
            .extend_from_slice(&encode_header(kind, payload.len()));
        self.pending.extend_from_slice(payload);
        self.written = 0;
    }
}

fn protocol(e: ProtoError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl AsyncRead for PortStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.read_done || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if this.remaining > 0 {
                let want = this.remaining.min(buf.remaining());
                let mut limited = ReadBuf::new(buf.initialize_unfilled_to(want));
                ready!(Pin::new(&mut this.conn).poll_read(cx, &mut limited))?;
                let n = limited.filled().len();
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
                buf.advance(n);
                this.remaining -= n;
                return Poll::Ready(Ok(()));
            }
            while this.header_filled < FRAME_HEADER_LEN {
                let mut hb = ReadBuf::new(&mut this.header[this.header_filled..]);
                ready!(Pin::new(&mut this.conn).poll_read(cx, &mut hb))?;
                let n = hb.filled().len();
                if n == 0 {
                    if this.header_filled == 0 {
                        // envd closed the tunnel without an `End` (fence
                        // move, idle): the stream ends here
                        this.read_done = true;
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
                this.header_filled += n;
            }
            this.header_filled = 0;
            let (kind, len) = decode_header(this.header).map_err(protocol)?;
            match kind {
                FrameKind::Data => this.remaining = len as usize,
                FrameKind::End => this.read_done = true,
                other => return Poll::Ready(Err(protocol(ProtoError::UnexpectedFrame(other)))),
            }
        }
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.end_sent {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "port tunnel already shut down for writing",
            )));
        }
        ready!(this.poll_drain(cx))?;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(CHUNK_SIZE);
        this.queue(FrameKind::Data, &buf[..n]);
        // Accepted: the frame goes out on this or a later poll (flush drains it).
        let _ = this.poll_drain(cx)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.conn).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        if !this.end_sent {
            this.queue(FrameKind::End, &[]);
            this.end_sent = true;
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.conn).poll_flush(cx)
    }
}
