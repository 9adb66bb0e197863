//! Measures `digest_tree` on a synthetic tree (default 300 MB: 30 files of
//! 8 MB plus 6000 files of 10 KB). Run with
//! `cargo run --release -p aviary-templates --example digest_bench [DIR]`;
//! with DIR, digests that tree instead.

use std::time::Instant;

fn main() {
    let arg = std::env::args().nth(1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = match &arg {
        Some(dir) => std::path::PathBuf::from(dir),
        None => {
            let root = tmp.path().to_path_buf();
            let big = vec![0x5au8; 8 << 20];
            for i in 0..30 {
                std::fs::write(root.join(format!("big{i}")), &big).expect("write");
            }
            let small = vec![0xa5u8; 10 << 10];
            for d in 0..60 {
                let dir = root.join(format!("d{d}"));
                std::fs::create_dir(&dir).expect("mkdir");
                for f in 0..100 {
                    std::fs::write(dir.join(format!("f{f}")), &small).expect("write");
                }
            }
            root
        }
    };
    for run in 0..3 {
        let t = Instant::now();
        let d = aviary_templates::digest_tree(&root).expect("digest");
        println!(
            "run {run}: {} MB in {:.3}s -> {}",
            d.size_bytes >> 20,
            t.elapsed().as_secs_f64(),
            d.digest
        );
    }
}
