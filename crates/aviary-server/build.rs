//! Embeds the web console's built assets (`console/dist`, made by
//! `scripts/build-console.sh`) into the server binary: writes
//! `$OUT_DIR/console_assets.rs`, a table of (path, bytes) with every file
//! `include_bytes!`-ed. Without a built console the table is empty and the
//! server answers `/` with a page saying how to build it, so a clean
//! `cargo build` never fails (and never runs npm) because of the console.

use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let console = manifest.join("../../console");
    let dist = console.join("dist");
    let mut files = Vec::new();
    if dist.join("index.html").is_file() {
        println!("cargo:rerun-if-changed={}", dist.display());
        collect(&dist, &dist, &mut files);
        files.sort();
    } else if console.is_dir() {
        // a later build of the console creates dist/ (the dir changes)
        println!("cargo:rerun-if-changed={}", console.display());
    }
    let mut out = String::from(
        "/// Built console assets: path under `/console/` and the file's bytes.\n\
         pub(crate) static CONSOLE_ASSETS: &[(&str, &[u8])] = &[\n",
    );
    for (rel, abs) in &files {
        out.push_str(&format!("    ({rel:?}, include_bytes!({abs:?})),\n"));
    }
    out.push_str("];\n");
    let target = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"))
        .join("console_assets.rs");
    std::fs::write(target, out).expect("write console_assets.rs");
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            collect(root, &path, files);
        } else if kind.is_file() {
            let rel = path.strip_prefix(root).expect("under root");
            let Some(rel) = rel.to_str() else {
                continue;
            };
            let abs = path.canonicalize().expect("canonical asset path");
            files.push((
                rel.replace('\\', "/"),
                abs.to_str().expect("utf-8 asset path").to_owned(),
            ));
        }
    }
}
