//! Snapshot benchmark (issues 4 and 12): a ~1 GiB workspace of many small text files
//! and a few large random binaries; snapshot #1; change ~1% (in-place edits, appends,
//! new files); snapshot #2 with #1 as parent; a full `tar -c | zstd` of the same tree
//! for comparison; restore throughput. Prints a markdown table per case:
//!
//! - `plain`: the workspace in a plain directory under `--dir` (the host's
//!   filesystem; changed files are read whole);
//! - `xfs`: the workspace on an XFS filesystem (`reflink=1`) the bench makes on a
//!   sparse image under `--dir` and loop-mounts (root and `mkfs.xfs` needed; always
//!   unmounted and removed), snapshotted with a reflink shadow directory on the same
//!   filesystem, so changed files are read only where they changed.
//!
//! The chunk store, the tar output and the restore are on `--dir` in both cases.
//!
//! cargo run --release -p aviary-snapshots --example snapshot_bench -- [--dir D]
//!     [--size-mib 1024] [--no-fsync] [--keep] [--only plain|xfs]

use anyhow::{bail, Context, Result};
use aviary_snapshots::{
    restore_dir, snapshot_dir, ChunkStore, ChunkerConfig, LocalStore, RestoreOptions,
    SnapshotRequest,
};
use rand::{Rng, SeedableRng};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const MIB: u64 = 1024 * 1024;
const WORDS: &[&str] = &[
    "fn", "let", "mut", "self", "return", "match", "impl", "struct", "pub", "use", "async",
    "await", "result", "error", "value", "config", "sandbox", "lease", "token", "snapshot",
    "chunk", "store", "manifest", "tenant", "import", "def", "class", "for", "in", "if", "else",
    "while", "print", "data", "frame", "index", "count", "path", "file", "open",
];

struct Args {
    dir: PathBuf,
    size_mib: u64,
    fsync: bool,
    keep: bool,
    chunker: ChunkerConfig,
    only: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        dir: std::env::temp_dir().join("aviary-snapshot-bench"),
        size_mib: 1024,
        fsync: true,
        keep: false,
        chunker: ChunkerConfig::default(),
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => args.dir = it.next().context("--dir needs a value")?.into(),
            "--size-mib" => {
                args.size_mib = it.next().context("--size-mib needs a value")?.parse()?
            }
            "--no-fsync" => args.fsync = false,
            "--keep" => args.keep = true,
            "--only" => match it.next().as_deref() {
                Some(c @ ("plain" | "xfs")) => args.only = Some(c.to_owned()),
                _ => bail!("--only needs plain or xfs"),
            },
            "--avg-kib" => {
                let avg: usize = it.next().context("--avg-kib needs a value")?.parse()?;
                args.chunker = ChunkerConfig {
                    min_size: avg * 1024 / 4,
                    avg_size: avg * 1024,
                    max_size: avg * 1024 * 4,
                };
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn text(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
        out.push(if rng.gen_ratio(1, 8) { b'\n' } else { b' ' });
    }
    out.truncate(len);
    out
}

fn random_file(path: &Path, rng: &mut impl Rng, len: u64) -> Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut buf = vec![0u8; MIB as usize];
    let mut left = len;
    while left > 0 {
        let n = left.min(MIB) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(())
}

/// ~20% of the bytes in small text files (5000 files in 50 dirs), the rest in 8
/// large random binaries.
fn generate(ws: &Path, size: u64) -> Result<(u64, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut files = 0;
    let mut total = 0u64;
    let text_budget = size / 5;
    let n_text = 5000u64;
    for i in 0..n_text {
        let dir = ws.join(format!("src/pkg{:02}", i % 50));
        std::fs::create_dir_all(&dir)?;
        let len = rng.gen_range(1..(2 * text_budget / n_text)) as usize;
        std::fs::write(dir.join(format!("mod{i}.txt")), text(&mut rng, len))?;
        total += len as u64;
        files += 1;
    }
    std::fs::create_dir_all(ws.join("data"))?;
    let big = (size - total) / 8;
    for i in 0..8 {
        random_file(&ws.join(format!("data/blob{i}.bin")), &mut rng, big)?;
        total += big;
        files += 1;
    }
    Ok((total, files))
}

/// Change ~1% of the workspace: in-place overwrites in 3 blobs, appends to 2 blobs,
/// 40 rewritten and 40 appended text files, 2 new files. Returns changed bytes.
fn change_one_percent(ws: &Path, size: u64) -> Result<u64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut changed = 0u64;
    let big = std::fs::metadata(ws.join("data/blob0.bin"))?.len();
    for i in 0..3 {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(ws.join(format!("data/blob{i}.bin")))?;
        for _ in 0..2 {
            let off = rng.gen_range(0..big - 65536);
            let mut buf = vec![0u8; 65536];
            rng.fill(&mut buf[..]);
            f.seek(SeekFrom::Start(off))?;
            f.write_all(&buf)?;
            changed += buf.len() as u64;
        }
    }
    let append = size / 500; // 0.2% each
    for i in 3..5 {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(ws.join(format!("data/blob{i}.bin")))?;
        let mut buf = vec![0u8; append as usize];
        rng.fill(&mut buf[..]);
        f.write_all(&buf)?;
        changed += append;
    }
    for i in 0..40u64 {
        let p = ws.join(format!("src/pkg{:02}/mod{}.txt", (i * 37) % 50, i * 37));
        let len = std::fs::metadata(&p)?.len() as usize;
        std::fs::write(&p, text(&mut rng, len))?;
        changed += len as u64;
        let p = ws.join(format!(
            "src/pkg{:02}/mod{}.txt",
            (i * 41 + 3) % 50,
            i * 41 + 3
        ));
        let extra = text(&mut rng, 200);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)?
            .write_all(&extra)?;
        changed += 200;
    }
    let new_len = size / 500; // 0.2% each
    for i in 0..2 {
        random_file(&ws.join(format!("data/new{i}.bin")), &mut rng, new_len)?;
        changed += new_len;
    }
    Ok(changed)
}

/// A second ~1% change that leaves the large binaries alone: 300 rewritten text
/// files and one new file. Returns changed bytes.
fn change_small_files(ws: &Path, size: u64) -> Result<u64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut changed = 0u64;
    for i in 0..300u64 {
        let n = (i * 13 + 5) % 5000;
        let p = ws.join(format!("src/pkg{:02}/mod{n}.txt", n % 50));
        let len = std::fs::metadata(&p)?.len() as usize;
        std::fs::write(&p, text(&mut rng, len))?;
        changed += len as u64;
    }
    let new_len = (size / 100).saturating_sub(changed);
    random_file(&ws.join("data/new-small-change.bin"), &mut rng, new_len)?;
    Ok(changed + new_len)
}

fn tar_zstd(parent: &Path, out: &Path) -> Result<(u64, f64)> {
    let t = Instant::now();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "tar -cf - -C '{}' workspace | zstd -q -3 -T0 -f -o '{}'",
            parent.display(),
            out.display()
        ))
        .status()
        .context("run tar | zstd (apt-get install tar zstd)")?;
    let secs = t.elapsed().as_secs_f64();
    if !status.success() {
        bail!("tar | zstd failed: {status}");
    }
    Ok((std::fs::metadata(out)?.len(), secs))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / MIB as f64)
}

/// A sparse image with an XFS filesystem, loop-mounted; unmounted and removed on drop.
struct XfsMount {
    img: PathBuf,
    mnt: PathBuf,
    mounted: bool,
}

impl XfsMount {
    fn make(dir: &Path, size: u64) -> Result<XfsMount> {
        if !nix::unistd::geteuid().is_root() {
            bail!("not root (loop mounts need root)");
        }
        let mut m = XfsMount {
            img: dir.join("xfs.img"),
            mnt: dir.join("xfs"),
            mounted: false,
        };
        std::fs::File::create(&m.img)?.set_len(size)?;
        let out = Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&m.img)
            .output()
            .context("mkfs.xfs (scripts/deps.sh installs xfsprogs)")?;
        if !out.status.success() {
            bail!("mkfs.xfs: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        std::fs::create_dir_all(&m.mnt)?;
        let out = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&m.img)
            .arg(&m.mnt)
            .output()?;
        if !out.status.success() {
            bail!(
                "mount -o loop: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        m.mounted = true;
        Ok(m)
    }
}

impl Drop for XfsMount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.mnt).status();
        }
        let _ = std::fs::remove_dir(&self.mnt);
        let _ = std::fs::remove_file(&self.img);
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    // A run killed mid-way may have left its filesystem mounted.
    if args.dir.join("xfs").exists() {
        let _ = Command::new("umount").arg(args.dir.join("xfs")).output();
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let size = args.size_mib * MIB;
    let want = |c: &str| args.only.as_deref().is_none_or(|o| o == c);
    let mut ok = true;
    if want("plain") {
        let host = args.dir.join("plain");
        std::fs::create_dir_all(&host)?;
        ok &= run_case(
            &args,
            &host,
            &host,
            None,
            "workspace in a plain directory (the host's filesystem)",
        )
        .await?;
        if !args.keep {
            let _ = std::fs::remove_dir_all(&host);
        }
    }
    if want("xfs") {
        // Room for the workspace, its changes and the shadows' pinned blocks.
        match XfsMount::make(&args.dir, size * 3 / 2 + 512 * MIB) {
            Ok(xfs) => {
                let host = args.dir.join("xfs-host");
                std::fs::create_dir_all(&host)?;
                let shadow = xfs.mnt.join("shadow");
                let r = run_case(
                    &args,
                    &xfs.mnt,
                    &host,
                    Some(&shadow),
                    "workspace on a loop-mounted XFS (reflink=1), reflink shadows",
                )
                .await;
                drop(xfs);
                ok &= r?;
            }
            Err(e) => println!("\n(XFS case skipped: {e:#})"),
        }
    }
    if !args.keep {
        let _ = std::fs::remove_dir_all(&args.dir);
    }
    if !ok {
        bail!("restored tree differs from the workspace");
    }
    Ok(())
}

/// One case: the workspace in `ws_parent/workspace`; store, tar output and restore
/// under `host`. Prints its table; returns whether the restore was identical.
async fn run_case(
    args: &Args,
    ws_parent: &Path,
    host: &Path,
    shadow: Option<&Path>,
    title: &str,
) -> Result<bool> {
    let ws = ws_parent.join("workspace");
    std::fs::create_dir(&ws)?;
    let size = args.size_mib * MIB;

    eprintln!("generating {} workspace in {}", mib(size), ws.display());
    let (total, files) = generate(&ws, size)?;
    // Settle the generated data so its writeback is not billed to snapshot #1.
    Command::new("sync").status()?;
    // Let the files age past the racy-timestamp window so #2 may trust them unread.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;

    let store = LocalStore::open(host.join("store"))?.with_fsync(args.fsync);
    let t = Instant::now();
    let mut req = SnapshotRequest::new("bench", "workspace");
    req.chunker = args.chunker;
    req.shadow = shadow.map(Path::to_owned);
    eprintln!("snapshot #1");
    let first = snapshot_dir(&store, &ws, req.clone()).await?;
    let t1 = t.elapsed().as_secs_f64();
    let m1_bytes = first.to_bytes().len() as u64;

    let (tar1_bytes, tar1_secs) = tar_zstd(ws_parent, &host.join("ws1.tar.zst"))?;

    let changed = change_one_percent(&ws, size)?;
    Command::new("sync").status()?;
    eprintln!("snapshot #2");
    let t = Instant::now();
    let second = snapshot_dir(&store, &ws, req.clone().parent(first.id.clone())).await?;
    let t2 = t.elapsed().as_secs_f64();
    let m2_bytes = second.to_bytes().len() as u64;
    let (tar2_bytes, tar2_secs) = tar_zstd(ws_parent, &host.join("ws2.tar.zst"))?;

    eprintln!("restore #2");
    let out = host.join("restore");
    let t = Instant::now();
    let stats = restore_dir(&store, &second, &out, &RestoreOptions::default()).await?;
    let tr = t.elapsed().as_secs_f64();
    let identical = Command::new("diff")
        .args(["-rq", "--no-dereference"])
        .arg(&ws)
        .arg(&out)
        .status()?
        .success();
    let _ = std::fs::remove_dir_all(&out);

    let changed3 = change_small_files(&ws, size)?;
    Command::new("sync").status()?;
    eprintln!("snapshot #3");
    let t = Instant::now();
    let third = snapshot_dir(&store, &ws, req.clone().parent(second.id.clone())).await?;
    let t3 = t.elapsed().as_secs_f64();
    let m3_bytes = third.to_bytes().len() as u64;
    let (tar3_bytes, tar3_secs) = tar_zstd(ws_parent, &host.join("ws3.tar.zst"))?;
    let shadow_note = match shadow {
        Some(dir) => format!(
            "; shadows: {} files",
            std::fs::read_dir(dir.join("files")).map_or(0, |d| d.count())
        ),
        None => String::new(),
    };

    let chunks_stored = store.list(None, usize::MAX).await?.len();
    let inc_written = second.new_bytes + m2_bytes;
    println!(
        "## Snapshot benchmark: {title} ({} in {files} files, local store, fsync {}, chunks {}/{}/{} KiB min/avg/max)\n",
        mib(total),
        if args.fsync { "on" } else { "off" },
        args.chunker.min_size / 1024,
        args.chunker.avg_size / 1024,
        args.chunker.max_size / 1024
    );
    println!("| step | bytes written | time | notes |");
    println!("|---|---:|---:|---|");
    println!(
        "| snapshot #1 (full) | {} (+ {} manifest) | {t1:.2} s | {:.0} MB/s, {} chunks |",
        mib(first.new_bytes),
        mib(m1_bytes),
        total as f64 / 1e6 / t1,
        first.new_chunks
    );
    println!(
        "| tar -c \\| zstd -3 -T0 (full, #1) | {} | {tar1_secs:.2} s | |",
        mib(tar1_bytes)
    );
    println!(
        "| change ~1% | {} changed | | in-place, appends, new files |",
        mib(changed)
    );
    println!(
        "| snapshot #2 (incremental) | {} (+ {} manifest) | {t2:.2} s | read {}, {} new chunks |",
        mib(second.new_bytes),
        mib(m2_bytes),
        mib(second.read_bytes),
        second.new_chunks
    );
    println!(
        "| tar -c \\| zstd -3 -T0 (full, #2) | {} | {tar2_secs:.2} s | |",
        mib(tar2_bytes)
    );
    println!(
        "| restore #2 | {} | {tr:.2} s | {:.0} MB/s, identical: {identical} |",
        mib(stats.bytes),
        stats.bytes as f64 / 1e6 / tr
    );
    println!(
        "| change ~1%, small files only | {} changed | | 300 text files rewritten, 1 new file |",
        mib(changed3)
    );
    println!(
        "| snapshot #3 (incremental) | {} (+ {} manifest) | {t3:.2} s | read {}, {} new chunks |",
        mib(third.new_bytes),
        mib(m3_bytes),
        mib(third.read_bytes),
        third.new_chunks
    );
    println!(
        "| tar -c \\| zstd -3 -T0 (full, #3) | {} | {tar3_secs:.2} s | |",
        mib(tar3_bytes)
    );
    println!();
    println!(
        "snapshot #3 vs tar|zstd: bytes {:.2}%, time {:.3}x",
        100.0 * (third.new_bytes + m3_bytes) as f64 / tar3_bytes as f64,
        t3 / tar3_secs
    );
    println!(
        "snapshot #2 vs tar|zstd: bytes {:.2}% (target <= 3%), time {:.3}x (target <= 0.1x); store holds {chunks_stored} chunks{shadow_note}",
        100.0 * inc_written as f64 / tar2_bytes as f64,
        t2 / tar2_secs
    );
    Ok(identical)
}
