//! Snapshot layers over the wire: how a control plane snapshots and restores
//! the layers of a sandbox on an agent's host without either side sharing a
//! file system or the agent reaching the chunk store.
//!
//! The agent walks (or writes) its own directories with the same tree code
//! as a local snapshot (`aviary_snapshots::snapshot_dir` / `restore_dir`);
//! what would go to a chunk store travels in a stream of frames instead:
//!
//! - **snapshot** (`POST …/layers/{layer}/snapshot`, JSON body
//!   [`LayerSnapshotRequest`] with the parent manifest, if any): the answer
//!   streams a `C` frame per chunk the parent does not have, then one `M`
//!   frame with the manifest, or an `E` frame with an error. The control
//!   plane checks every chunk's hash before it stores it, and stores the
//!   manifest only when every chunk it names was sent or is the parent's.
//! - **restore** (`POST …/layers/stage`, `POST …/workspace/restore`): the
//!   request body streams an `M` frame, then a `C` frame per chunk of that
//!   manifest's files in manifest order (the order `restore_dir` reads them
//!   in, one at a time); a stage sends the workspace, then the writable
//!   layer. The agent checks each chunk's name against the one it expects
//!   next and its bytes against that name.
//!
//! Frame: one tag byte (`C`, `M`, `E`), a big-endian `u32` payload length,
//! the payload. A chunk's payload is its 64-character hex name then its
//! bytes; a manifest's is its JSON; an error's is UTF-8 text. Frames above
//! [`MAX_FRAME`] are refused.

use aviary_core::SandboxId;
use aviary_snapshots::{
    ChunkHash, ChunkStore, EntryKind, ManifestKey, SnapshotError, SnapshotId, SnapshotManifest,
};
use futures_util::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::Mutex;
use tokio::sync::mpsc;

/// The largest frame either side accepts (a chunk is at most a few MiB; a
/// manifest of a very large tree can be tens of MiB).
pub const MAX_FRAME: usize = 256 << 20;

/// Length of a chunk name in a `C` frame.
const HASH_LEN: usize = 64;

/// The JSON body of a layer snapshot request.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSnapshotRequest {
    pub tenant: String,
    pub label: String,
    pub sandbox_id: Option<SandboxId>,
    /// The parent snapshot's manifest: lineage, and files unchanged since
    /// it are not read again (their chunks are not sent).
    pub parent: Option<SnapshotManifest>,
}

/// `GET …/workspace/empty`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct WorkspaceEmpty {
    pub empty: bool,
}

/// One frame of a layer stream.
#[derive(Debug)]
pub enum Frame {
    Chunk(ChunkHash, Vec<u8>),
    Manifest(Box<SnapshotManifest>),
    Error(String),
}

impl Frame {
    pub fn encode(&self) -> Vec<u8> {
        let (tag, payload): (u8, Vec<u8>) = match self {
            Frame::Chunk(h, data) => {
                let mut p = Vec::with_capacity(HASH_LEN + data.len());
                p.extend_from_slice(h.as_str().as_bytes());
                p.extend_from_slice(data);
                (b'C', p)
            }
            Frame::Manifest(m) => (b'M', m.to_bytes()),
            Frame::Error(e) => (b'E', e.as_bytes().to_vec()),
        };
        let mut out = Vec::with_capacity(5 + payload.len());
        out.push(tag);
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
        out
    }
}

/// A wire failure, as a snapshot error of the `node` backend.
pub fn wire_error(op: impl Into<String>, detail: impl Into<String>) -> SnapshotError {
    SnapshotError::Backend {
        backend: "node",
        op: op.into(),
        source: detail.into().into(),
    }
}

/// Reads frames from a byte stream (an HTTP body).
pub struct FrameReader<S> {
    stream: S,
    buf: Vec<u8>,
    done: bool,
}

impl<S, B, E> FrameReader<S>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    pub fn new(stream: S) -> Self {
        FrameReader {
            stream,
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next frame; `None` at a clean end of the stream (not inside a
    /// frame).
    pub async fn next(&mut self) -> Result<Option<Frame>, SnapshotError> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if len > MAX_FRAME {
                    return Err(wire_error("read a frame", format!("frame of {len} bytes")));
                }
                if self.buf.len() >= 5 + len {
                    let tag = self.buf[0];
                    let payload: Vec<u8> = self.buf[5..5 + len].to_vec();
                    self.buf.drain(..5 + len);
                    return decode(tag, payload).map(Some);
                }
            }
            if self.done {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(wire_error(
                        "read a frame",
                        "the stream ended inside a frame",
                    ))
                };
            }
            match self.stream.next().await {
                Some(Ok(bytes)) => self.buf.extend_from_slice(bytes.as_ref()),
                Some(Err(e)) => return Err(wire_error("read the layer stream", e.to_string())),
                None => self.done = true,
            }
        }
    }
}

fn decode(tag: u8, payload: Vec<u8>) -> Result<Frame, SnapshotError> {
    match tag {
        b'C' => {
            if payload.len() < HASH_LEN {
                return Err(wire_error("read a chunk frame", "too short"));
            }
            let name = std::str::from_utf8(&payload[..HASH_LEN])
                .map_err(|_| wire_error("read a chunk frame", "its name is not hex"))?;
            let hash: ChunkHash = name
                .parse()
                .map_err(|_| wire_error("read a chunk frame", "its name is not a chunk hash"))?;
            Ok(Frame::Chunk(hash, payload[HASH_LEN..].to_vec()))
        }
        b'M' => {
            let m = SnapshotManifest::from_bytes("streamed", &payload)?;
            Ok(Frame::Manifest(Box::new(m)))
        }
        b'E' => Ok(Frame::Error(String::from_utf8_lossy(&payload).into_owned())),
        other => Err(wire_error(
            "read a frame",
            format!("unknown frame tag {other:#04x}"),
        )),
    }
}

/// The chunks of `m`'s files, in the order `restore_dir` reads them.
pub fn restore_order(m: &SnapshotManifest) -> impl Iterator<Item = &ChunkHash> {
    m.entries
        .iter()
        .filter(|e| e.kind == EntryKind::File)
        .flat_map(|e| e.chunks.iter())
}

/// Every chunk `m` names.
pub fn chunks_of(m: &SnapshotManifest) -> HashSet<ChunkHash> {
    restore_order(m).cloned().collect()
}

fn unsupported(op: &str) -> SnapshotError {
    wire_error(op.to_owned(), "not part of a layer stream")
}

/// The agent's store for a snapshot: chunks the parent does not have go out
/// as frames; the parent manifest is the one the request carried; the
/// manifest is kept for the last frame.
pub struct SinkStore {
    tx: mpsc::Sender<Vec<u8>>,
    parent: Option<SnapshotManifest>,
    known: Mutex<HashSet<ChunkHash>>,
    manifest: Mutex<Option<SnapshotManifest>>,
}

impl SinkStore {
    pub fn new(tx: mpsc::Sender<Vec<u8>>, parent: Option<SnapshotManifest>) -> Self {
        let known = parent.as_ref().map(chunks_of).unwrap_or_default();
        SinkStore {
            tx,
            parent,
            known: Mutex::new(known),
            manifest: Mutex::new(None),
        }
    }

    /// The manifest the snapshot stored, once it has.
    pub fn take_manifest(&self) -> Option<SnapshotManifest> {
        self.manifest.lock().expect("manifest poisoned").take()
    }
}

#[async_trait::async_trait]
impl ChunkStore for SinkStore {
    fn backend(&self) -> &'static str {
        "node"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        if !self
            .known
            .lock()
            .expect("known poisoned")
            .insert(hash.clone())
        {
            return Ok(());
        }
        self.tx
            .send(Frame::Chunk(hash.clone(), bytes).encode())
            .await
            .map_err(|_| wire_error("send a chunk", "the control plane hung up"))
    }

    async fn get(&self, _hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        Err(unsupported("get"))
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        Ok(self.known.lock().expect("known poisoned").contains(hash))
    }

    async fn delete(&self, _hash: &ChunkHash) -> Result<(), SnapshotError> {
        Err(unsupported("delete"))
    }

    async fn list(
        &self,
        _after: Option<&ChunkHash>,
        _limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        Err(unsupported("list"))
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        *self.manifest.lock().expect("manifest poisoned") = Some(manifest.clone());
        Ok(())
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        match &self.parent {
            Some(p) if p.tenant == tenant && &p.id == id => Ok(p.clone()),
            _ => Err(SnapshotError::NotFound {
                what: format!("snapshot {id}"),
            }),
        }
    }

    async fn list_manifests(
        &self,
        _tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        Err(unsupported("list manifests"))
    }

    async fn delete_manifest(&self, _tenant: &str, _id: &SnapshotId) -> Result<(), SnapshotError> {
        Err(unsupported("delete a manifest"))
    }
}

/// The agent's store for a restore: each `get` takes the next chunk frame
/// of the request body, which must be the chunk asked for (the restore
/// reads one at a time, in manifest order).
pub struct StreamStore<S> {
    reader: tokio::sync::Mutex<FrameReader<S>>,
}

impl<S, B, E> StreamStore<S>
where
    S: Stream<Item = Result<B, E>> + Unpin + Send,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    pub fn new(reader: FrameReader<S>) -> Self {
        StreamStore {
            reader: tokio::sync::Mutex::new(reader),
        }
    }

    /// The next frame, which must be a manifest.
    pub async fn next_manifest(&self) -> Result<SnapshotManifest, SnapshotError> {
        match self.reader.lock().await.next().await? {
            Some(Frame::Manifest(m)) => Ok(*m),
            Some(Frame::Error(e)) => Err(wire_error("read the restore stream", e)),
            Some(Frame::Chunk(..)) => Err(wire_error(
                "read the restore stream",
                "a chunk where a manifest was expected",
            )),
            None => Err(wire_error(
                "read the restore stream",
                "it ended before a manifest",
            )),
        }
    }
}

#[async_trait::async_trait]
impl<S, B, E> ChunkStore for StreamStore<S>
where
    S: Stream<Item = Result<B, E>> + Unpin + Send,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    fn backend(&self) -> &'static str {
        "node"
    }

    async fn put(&self, _hash: &ChunkHash, _bytes: Vec<u8>) -> Result<(), SnapshotError> {
        Err(unsupported("put"))
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        match self.reader.lock().await.next().await? {
            Some(Frame::Chunk(h, data)) if &h == hash => Ok(data),
            Some(Frame::Chunk(h, _)) => Err(wire_error(
                "read the restore stream",
                format!("chunk {h} where {hash} was expected"),
            )),
            Some(Frame::Error(e)) => Err(wire_error("read the restore stream", e)),
            Some(Frame::Manifest(_)) => Err(wire_error(
                "read the restore stream",
                "a manifest where a chunk was expected",
            )),
            None => Err(wire_error(
                "read the restore stream",
                "it ended before every chunk came",
            )),
        }
    }

    async fn has(&self, _hash: &ChunkHash) -> Result<bool, SnapshotError> {
        Err(unsupported("has"))
    }

    async fn delete(&self, _hash: &ChunkHash) -> Result<(), SnapshotError> {
        Err(unsupported("delete"))
    }

    async fn list(
        &self,
        _after: Option<&ChunkHash>,
        _limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        Err(unsupported("list"))
    }

    async fn put_manifest(&self, _manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        Err(unsupported("put a manifest"))
    }

    async fn get_manifest(
        &self,
        _tenant: &str,
        _id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        Err(unsupported("get a manifest"))
    }

    async fn list_manifests(
        &self,
        _tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        Err(unsupported("list manifests"))
    }

    async fn delete_manifest(&self, _tenant: &str, _id: &SnapshotId) -> Result<(), SnapshotError> {
        Err(unsupported("delete a manifest"))
    }
}

/// The control plane's side of a restore: the frames for `manifests`, each
/// followed by its chunks from `store`, sent into `tx` (a request body).
/// Stops early when the receiver hangs up; a store failure is sent as an
/// `E` frame and returned.
pub async fn send_restore(
    store: &dyn ChunkStore,
    manifests: &[SnapshotManifest],
    tx: &mpsc::Sender<Result<Vec<u8>, std::io::Error>>,
) -> Result<(), SnapshotError> {
    for m in manifests {
        if tx
            .send(Ok(Frame::Manifest(Box::new(m.clone())).encode()))
            .await
            .is_err()
        {
            return Ok(());
        }
        for hash in restore_order(m) {
            let data = match store.get(hash).await {
                Ok(d) => d,
                Err(e) => {
                    let _ = tx.send(Ok(Frame::Error(e.to_string()).encode())).await;
                    return Err(e);
                }
            };
            if tx
                .send(Ok(Frame::Chunk(hash.clone(), data).encode()))
                .await
                .is_err()
            {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The control plane's side of a snapshot: stores the streamed chunks in
/// `store` (each checked against its name), then the manifest, once every
/// chunk it names is one that came or one of `parent`'s.
pub async fn receive_snapshot<S, B, E>(
    store: &dyn ChunkStore,
    mut reader: FrameReader<S>,
    tenant: &str,
    parent: Option<&SnapshotManifest>,
) -> Result<SnapshotManifest, SnapshotError>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    let mut have = parent.map(chunks_of).unwrap_or_default();
    loop {
        match reader.next().await? {
            Some(Frame::Chunk(hash, data)) => {
                hash.verify(&data)?;
                store.put(&hash, data).await?;
                have.insert(hash);
            }
            Some(Frame::Manifest(m)) => {
                if m.tenant != tenant {
                    return Err(wire_error(
                        "check the streamed manifest",
                        format!("it is tenant {:?}'s, not {tenant:?}'s", m.tenant),
                    ));
                }
                if let Some(missing) = restore_order(&m).find(|h| !have.contains(*h)) {
                    return Err(wire_error(
                        "check the streamed manifest",
                        format!("it names chunk {missing}, which never came"),
                    ));
                }
                store.flush().await?;
                store.put_manifest(&m).await?;
                return Ok(*m);
            }
            Some(Frame::Error(e)) => return Err(wire_error("snapshot on the node", e)),
            None => {
                return Err(wire_error(
                    "read the snapshot stream",
                    "it ended before the manifest",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_snapshots::{MemoryStore, SnapshotRequest};

    fn stream_of(
        frames: Vec<Vec<u8>>,
        split: usize,
    ) -> impl Stream<Item = Result<Vec<u8>, String>> + Unpin {
        // re-cut the bytes into pieces of `split` so frames straddle reads
        let all: Vec<u8> = frames.concat();
        let pieces: Vec<Result<Vec<u8>, String>> =
            all.chunks(split.max(1)).map(|c| Ok(c.to_vec())).collect();
        futures_util::stream::iter(pieces)
    }

    async fn tree_with_files() -> (tempfile::TempDir, SnapshotManifest, MemoryStore) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("a"), b"alpha".repeat(5000)).unwrap();
        std::fs::write(dir.path().join("d/b"), b"beta").unwrap();
        let store = MemoryStore::new();
        let m = aviary_snapshots::snapshot_dir(&store, dir.path(), SnapshotRequest::new("t", "l"))
            .await
            .unwrap();
        (dir, m, store)
    }

    #[tokio::test]
    async fn a_snapshot_streams_through_the_sink_into_a_store() {
        let (dir, _, _) = tree_with_files().await;
        let (tx, mut rx) = mpsc::channel(64);
        let sink = SinkStore::new(tx, None);
        let m = aviary_snapshots::snapshot_dir(&sink, dir.path(), SnapshotRequest::new("t", "l"))
            .await
            .unwrap();
        let mut frames: Vec<Vec<u8>> = Vec::new();
        drop(sink);
        while let Some(f) = rx.recv().await {
            frames.push(f);
        }
        frames.push(Frame::Manifest(Box::new(m.clone())).encode());
        let target = MemoryStore::new();
        let got = receive_snapshot(&target, FrameReader::new(stream_of(frames, 7)), "t", None)
            .await
            .unwrap();
        assert_eq!(got.id, m.id);
        for h in restore_order(&m) {
            assert!(target.has(h).await.unwrap(), "chunk {h} stored");
        }
        assert_eq!(target.get_manifest("t", &m.id).await.unwrap().id, m.id);
    }

    #[tokio::test]
    async fn a_manifest_naming_chunks_that_never_came_is_refused() {
        let (_dir, m, _) = tree_with_files().await;
        let target = MemoryStore::new();
        let frames = vec![Frame::Manifest(Box::new(m.clone())).encode()];
        let e = receive_snapshot(&target, FrameReader::new(stream_of(frames, 3)), "t", None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("node backend"), "{e}");
        assert!(
            target.get_manifest("t", &m.id).await.is_err(),
            "nothing stored"
        );
        // another tenant's manifest is refused too
        let frames = vec![Frame::Manifest(Box::new(m)).encode()];
        receive_snapshot(
            &target,
            FrameReader::new(stream_of(frames, 64)),
            "other",
            None,
        )
        .await
        .unwrap_err();
    }

    #[tokio::test]
    async fn a_chunk_whose_bytes_do_not_match_its_name_is_refused() {
        let target = MemoryStore::new();
        let frames = vec![Frame::Chunk(ChunkHash::of(b"x"), b"y".to_vec()).encode()];
        let e = receive_snapshot(&target, FrameReader::new(stream_of(frames, 64)), "t", None)
            .await
            .unwrap_err();
        assert!(matches!(e, SnapshotError::Corrupt { .. }), "{e:?}");
    }

    #[tokio::test]
    async fn a_restore_streams_a_manifest_and_its_chunks_in_order() {
        let (_dir, m, store) = tree_with_files().await;
        let (tx, mut rx) = mpsc::channel(64);
        send_restore(&store, std::slice::from_ref(&m), &tx)
            .await
            .unwrap();
        drop(tx);
        let mut frames = Vec::new();
        while let Some(f) = rx.recv().await {
            frames.push(f.unwrap());
        }
        let src = StreamStore::new(FrameReader::new(stream_of(frames, 5)));
        let got = src.next_manifest().await.unwrap();
        let out = tempfile::tempdir().unwrap();
        let target = out.path().join("r");
        let opts = aviary_snapshots::RestoreOptions {
            restore_ownership: false,
            fetch_concurrency: 1,
        };
        aviary_snapshots::restore_dir(&src, &got, &target, &opts)
            .await
            .unwrap();
        assert_eq!(std::fs::read(target.join("d/b")).unwrap(), b"beta");
        assert_eq!(
            std::fs::read(target.join("a")).unwrap(),
            b"alpha".repeat(5000)
        );
    }

    #[tokio::test]
    async fn truncated_or_oversized_frames_are_errors() {
        let mut f = Frame::Error("boom".into()).encode();
        f.pop();
        let mut r = FrameReader::new(stream_of(vec![f], 2));
        r.next().await.unwrap_err();
        let huge = [b'C', 0xff, 0xff, 0xff, 0xff];
        let mut r = FrameReader::new(stream_of(vec![huge.to_vec()], 5));
        r.next().await.unwrap_err();
        let mut r = FrameReader::new(stream_of(vec![vec![b'Z', 0, 0, 0, 0]], 5));
        r.next().await.unwrap_err();
        let mut r = FrameReader::new(stream_of(Vec::new(), 5));
        assert!(r.next().await.unwrap().is_none());
    }
}
