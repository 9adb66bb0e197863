//! Content-defined chunking: FastCDC 2020 (the `fastcdc` crate, normalization
//! level 1), measured against the gear chunker this module used to hand-write
//! (`examples/chunker_bench.rs`: about 1.4× the throughput, the same reuse after
//! an in-place edit) and kept for that.
//!
//! A cut point depends only on the last 64 bytes before it, so an insertion or
//! deletion moves at most the chunks around the edit; boundaries further on
//! re-synchronise and their chunks keep their hashes. That is what makes the second
//! snapshot of a slightly changed workspace cheap.
//!
//! Invariants: every chunk is at least `min_size` bytes (except the last of a stream)
//! and at most `max_size`; the concatenation of the chunks is the input.
//! [`StreamChunker`] reads through a fixed buffer of `2 * max_size` bytes, so memory
//! is bounded whatever the file size. No concurrency inside; one chunker per file.

use std::io::{self, Read};

/// Chunk size parameters. `avg_size` must be a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkerConfig {
    pub min_size: usize,
    pub avg_size: usize,
    pub max_size: usize,
}

impl Default for ChunkerConfig {
    /// 256 KiB / 1 MiB / 4 MiB: large enough that a 1 GiB workspace is ~1000 objects,
    /// small enough that a 1% change rewrites only a few MiB.
    fn default() -> Self {
        ChunkerConfig {
            min_size: 256 * 1024,
            avg_size: 1024 * 1024,
            max_size: 4 * 1024 * 1024,
        }
    }
}

impl ChunkerConfig {
    fn validate(&self) {
        use fastcdc::v2020::{
            AVERAGE_MAX, AVERAGE_MIN, MAXIMUM_MAX, MAXIMUM_MIN, MINIMUM_MAX, MINIMUM_MIN,
        };
        let within = |v: usize, lo: u32, hi: u32| v >= lo as usize && v <= hi as usize;
        assert!(
            self.avg_size.is_power_of_two()
                && within(self.min_size, MINIMUM_MIN, MINIMUM_MAX)
                && within(self.avg_size, AVERAGE_MIN, AVERAGE_MAX)
                && within(self.max_size, MAXIMUM_MIN, MAXIMUM_MAX)
                && self.min_size <= self.avg_size
                && self.avg_size <= self.max_size,
            "invalid chunker config {self:?}"
        );
    }
}

/// Length of the first chunk of `data`, treating `data` as the whole rest of the
/// stream (so a short `data` is one chunk).
pub fn cut_point(data: &[u8], cfg: &ChunkerConfig) -> usize {
    let n = data.len();
    if n <= cfg.min_size {
        return n;
    }
    // the sizes were checked against the crate's bounds by `validate`
    let cdc = fastcdc::v2020::FastCDC::new(
        data,
        cfg.min_size as u32,
        cfg.avg_size as u32,
        cfg.max_size as u32,
    );
    cdc.cut(0, n).1
}

/// Split an in-memory buffer into chunks (used by tests and small inputs).
pub fn chunk_slices<'a>(data: &'a [u8], cfg: &ChunkerConfig) -> Vec<&'a [u8]> {
    cfg.validate();
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let cut = cut_point(rest, cfg);
        out.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    out
}

/// Chunks a reader with bounded memory.
pub struct StreamChunker<R> {
    reader: R,
    cfg: ChunkerConfig,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    eof: bool,
}

impl<R: Read> StreamChunker<R> {
    pub fn new(reader: R, cfg: ChunkerConfig) -> Self {
        cfg.validate();
        StreamChunker {
            reader,
            cfg,
            buf: vec![0; 2 * cfg.max_size],
            start: 0,
            end: 0,
            eof: false,
        }
    }

    /// The next chunk, or `None` at the end of the stream.
    pub fn next_chunk(&mut self) -> io::Result<Option<&[u8]>> {
        if self.end - self.start < self.cfg.max_size && !self.eof {
            if self.buf.len() - self.start < self.cfg.max_size {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            while self.end - self.start < self.cfg.max_size && self.end < self.buf.len() {
                match self.reader.read(&mut self.buf[self.end..]) {
                    Ok(0) => {
                        self.eof = true;
                        break;
                    }
                    Ok(n) => self.end += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if self.start == self.end {
            return Ok(None);
        }
        let cut = cut_point(&self.buf[self.start..self.end], &self.cfg);
        let chunk = &self.buf[self.start..self.start + cut];
        self.start += cut;
        Ok(Some(chunk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    const SMALL: ChunkerConfig = ChunkerConfig {
        min_size: 256,
        avg_size: 1024,
        max_size: 4096,
    };

    fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut v = vec![0u8; len];
        rng.fill(&mut v[..]);
        v
    }

    /// A reader that returns at most `step` bytes per call, to exercise refills.
    struct Trickle<'a>(&'a [u8], usize);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(self.1);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn stream_chunks(data: &[u8], step: usize, cfg: ChunkerConfig) -> Vec<Vec<u8>> {
        let mut c = StreamChunker::new(Trickle(data, step), cfg);
        let mut out = Vec::new();
        while let Some(chunk) = c.next_chunk().unwrap() {
            out.push(chunk.to_vec());
        }
        out
    }

    #[test]
    fn default_config_averages_near_one_mib() {
        let data = random_bytes(7, 64 * 1024 * 1024);
        let chunks = chunk_slices(&data, &ChunkerConfig::default());
        let avg = data.len() / chunks.len();
        assert!(
            (512 * 1024..2 * 1024 * 1024).contains(&avg),
            "average chunk {avg} bytes over {} chunks",
            chunks.len()
        );
        for c in &chunks[..chunks.len() - 1] {
            assert!(c.len() >= 256 * 1024 && c.len() <= 4 * 1024 * 1024);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn concatenation_is_input_and_sizes_are_bounded(
            seed in any::<u64>(), len in 0usize..40_000, step in 1usize..9000
        ) {
            let data = random_bytes(seed, len);
            let chunks = stream_chunks(&data, step, SMALL);
            prop_assert_eq!(chunks.concat(), data.clone());
            for (i, c) in chunks.iter().enumerate() {
                prop_assert!(c.len() <= SMALL.max_size);
                if i + 1 < chunks.len() {
                    prop_assert!(c.len() >= SMALL.min_size);
                }
            }
            // Streaming and in-memory chunking agree, whatever the read sizes.
            let direct: Vec<Vec<u8>> = chunk_slices(&data, &SMALL).iter().map(|c| c.to_vec()).collect();
            prop_assert_eq!(chunks, direct);
        }

        #[test]
        fn boundaries_resync_after_an_insertion(
            seed in any::<u64>(), at in 0usize..60_000, insert in proptest::collection::vec(any::<u8>(), 1..300)
        ) {
            let data = random_bytes(seed, 120_000);
            let mut edited = data[..at].to_vec();
            edited.extend_from_slice(&insert);
            edited.extend_from_slice(&data[at..]);
            let before = chunk_slices(&data, &SMALL);
            let after = chunk_slices(&edited, &SMALL);
            // Every chunk that starts well after the edit is shared.
            let after_set: std::collections::HashSet<&[u8]> = after.iter().copied().collect();
            let mut offset = 0;
            let mut shared_tail = 0;
            for c in &before {
                if offset > at + 8 * SMALL.max_size {
                    prop_assert!(after_set.contains(c), "chunk at {} not re-synced", offset);
                    shared_tail += c.len();
                }
                offset += c.len();
            }
            prop_assert!(shared_tail + at + 9 * SMALL.max_size >= data.len());
        }
    }
}
