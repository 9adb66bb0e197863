//! Measures the chunker Aviary uses (the `fastcdc` crate's FastCDC 2020,
//! through `chunker::cut_point`) against the gear chunker Aviary hand-wrote
//! before (kept here as the baseline), with the same min / avg / max sizes,
//! on the same buffer:
//! throughput, chunk count and how many chunks survive a 1% in-place edit
//! spread over the buffer (dedup after an edit).
//!
//! `cargo run --release -p aviary-snapshots --example chunker_bench -- --size-mib 256`

use std::collections::HashSet;
use std::time::Instant;

use aviary_snapshots::chunker::{cut_point, ChunkerConfig};
use rand::{RngCore, SeedableRng};

/// The former hand-written chunker: gear hash, normalized chunking level 2.
/// Gear table: 256 values from splitmix64.
const GEAR: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut state: u64 = 0x6176_6961_7279_2d63; // "aviary-c"
    let mut i = 0;
    while i < 256 {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        table[i] = z ^ (z >> 31);
        i += 1;
    }
    table
};

fn gear_cut_point(data: &[u8], cfg: &ChunkerConfig) -> usize {
    let n = data.len();
    if n <= cfg.min_size {
        return n;
    }
    let bits = cfg.avg_size.trailing_zeros();
    let top = |n: u32| -> u64 { !0u64 << (64 - n.clamp(1, 63)) };
    let (mask_small, mask_large) = (top(bits + 2), top(bits.saturating_sub(2)));
    let normal = cfg.avg_size.min(n);
    let max = cfg.max_size.min(n);
    let mut h: u64 = 0;
    let mut i = cfg.min_size;
    while i < normal {
        h = (h << 1).wrapping_add(GEAR[data[i] as usize]);
        if h & mask_small == 0 {
            return i + 1;
        }
        i += 1;
    }
    while i < max {
        h = (h << 1).wrapping_add(GEAR[data[i] as usize]);
        if h & mask_large == 0 {
            return i + 1;
        }
        i += 1;
    }
    max
}

fn chunks_with(
    data: &[u8],
    cfg: &ChunkerConfig,
    cut: fn(&[u8], &ChunkerConfig) -> usize,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < data.len() {
        let n = cut(&data[off..], cfg);
        out.push((off, n));
        off += n;
    }
    out
}

fn former(data: &[u8], cfg: &ChunkerConfig) -> Vec<(usize, usize)> {
    chunks_with(data, cfg, gear_cut_point)
}

fn current(data: &[u8], cfg: &ChunkerConfig) -> Vec<(usize, usize)> {
    chunks_with(data, cfg, cut_point)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut size_mib = 256usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--size-mib" => size_mib = args.next().and_then(|v| v.parse().ok()).unwrap_or(256),
            other => panic!("unknown argument {other}"),
        }
    }
    let cfg = ChunkerConfig::default();
    let mut data = vec![0u8; size_mib << 20];
    rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut data);
    // 1% of the bytes rewritten in place, in 100 runs spread over the buffer
    let mut edited = data.clone();
    let run = data.len() / 100 / 100;
    for k in 0..100 {
        let at = k * (data.len() / 100) + 12_345;
        for b in &mut edited[at..at + run] {
            *b = b.wrapping_add(1);
        }
    }
    type Chunker = fn(&[u8], &ChunkerConfig) -> Vec<(usize, usize)>;
    let chunkers: [(&str, Chunker); 2] = [("former gear", former), ("fastcdc (used)", current)];
    println!(
        "{:<16} {:>10} {:>8} {:>10} {:>14}",
        "chunker", "MiB/s", "chunks", "avg KiB", "reused after 1% edit"
    );
    for (name, f) in chunkers {
        let mut times = Vec::new();
        let mut chunks = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            chunks = f(&data, &cfg);
            times.push(t.elapsed().as_secs_f64());
        }
        let secs = median(times);
        let before: HashSet<&[u8]> = chunks.iter().map(|&(o, n)| &data[o..o + n]).collect();
        let after = f(&edited, &cfg);
        let reused = after
            .iter()
            .filter(|&&(o, n)| before.contains(&edited[o..o + n]))
            .count();
        println!(
            "{:<16} {:>10.0} {:>8} {:>10.0} {:>9}/{}",
            name,
            size_mib as f64 / secs,
            chunks.len(),
            (data.len() / chunks.len()) as f64 / 1024.0,
            reused,
            after.len()
        );
    }
}
