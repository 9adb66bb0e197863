//! Building rootfs trees from the host: busybox-static and debootstrap.
//!
//! This module is the only place in the crate that spawns processes
//! (`busybox --list-full`, `debootstrap`, `chroot … python3`).

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;

use crate::error::{remove_err, write_err, IoContext, TemplateError};

pub(crate) const DEBOOTSTRAP_SOURCE: &str = "debootstrap:bookworm";
const SUITE: &str = "bookworm";

fn find_in_path(tool: &str, extra: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .chain(extra.iter().map(|d| Path::new(d).join(tool)))
        .find(|p| p.is_file())
}

/// The host's busybox: `AVIARY_BUSYBOX`, else the usual install paths.
fn find_busybox() -> Result<PathBuf, TemplateError> {
    if let Some(p) = std::env::var_os("AVIARY_BUSYBOX") {
        return Ok(PathBuf::from(p));
    }
    ["/bin/busybox", "/usr/bin/busybox", "/usr/sbin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or(TemplateError::MissingTool {
            tool: "busybox",
            hint: "install it with `apt-get install busybox-static`",
        })
}

/// True when the ELF file has no program interpreter (statically linked).
fn is_static_elf(path: &Path) -> std::io::Result<bool> {
    let mut head = vec![0u8; 64];
    let mut f = fs::File::open(path)?;
    f.read_exact(&mut head)?;
    if &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        // Not a 64-bit little-endian ELF: we cannot tell, so refuse.
        return Ok(false);
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]) as u64;
    let phoff = u64::from_le_bytes(head[0x20..0x28].try_into().unwrap_or([0; 8]));
    let phentsize = u16_at(0x36);
    let phnum = u16_at(0x38);
    let mut all = Vec::new();
    let mut f = fs::File::open(path)?;
    f.read_to_end(&mut all)?;
    for i in 0..phnum {
        let off = usize::try_from(phoff + i * phentsize).unwrap_or(usize::MAX);
        let Some(p_type) = all.get(off..off.saturating_add(4)) else {
            return Ok(false);
        };
        if p_type == 3u32.to_le_bytes() {
            return Ok(false); // PT_INTERP
        }
    }
    Ok(true)
}

fn mkdir_mode(path: &Path, mode: u32) -> Result<(), TemplateError> {
    fs::create_dir_all(path).ctx(write_err, path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).ctx(write_err, path)
}

/// Builds a busybox rootfs at `rootfs` (which must not exist).
pub(crate) fn busybox(rootfs: &Path) -> Result<(), TemplateError> {
    let bin = find_busybox()?;
    if !is_static_elf(&bin).ctx(write_err, &bin)? {
        return Err(TemplateError::CheckBusybox(bin));
    }
    mkdir_mode(rootfs, 0o755)?;
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "dev",
        "proc",
        "sys",
        "run",
        "var",
        "home",
        "workspace",
    ] {
        mkdir_mode(&rootfs.join(d), 0o755)?;
    }
    mkdir_mode(&rootfs.join("root"), 0o700)?;
    mkdir_mode(&rootfs.join("tmp"), 0o1777)?;
    mkdir_mode(&rootfs.join("var/tmp"), 0o1777)?;

    let dest = rootfs.join("bin/busybox");
    fs::copy(&bin, &dest).ctx(write_err, &dest)?;
    fs::set_permissions(&dest, fs::Permissions::from_mode(0o755)).ctx(write_err, &dest)?;

    let out = Command::new(&bin)
        .arg("--list-full")
        .stdin(Stdio::null())
        .output()
        .map_err(|source| TemplateError::SpawnTool {
            tool: "busybox",
            source,
        })?;
    if !out.status.success() {
        return Err(TemplateError::RunTool {
            tool: "busybox",
            status: out.status.to_string(),
            tail: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let rel = Path::new(line.trim());
        // Only plain relative paths; busybox's own list is trusted but checked.
        if rel.as_os_str().is_empty()
            || rel == Path::new("bin/busybox")
            || !rel
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            continue;
        }
        let link = rootfs.join(rel);
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent).ctx(write_err, parent)?;
        }
        if fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("/bin/busybox", &link).ctx(write_err, &link)?;
        }
    }

    let files: [(&str, &str); 4] = [
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        ),
        ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
        ("etc/hostname", "aviary\n"),
        ("etc/hosts", "127.0.0.1 localhost aviary\n::1 localhost\n"),
    ];
    for (rel, content) in files {
        let p = rootfs.join(rel);
        fs::write(&p, content).ctx(write_err, &p)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).ctx(write_err, &p)?;
    }
    Ok(())
}

/// The Debian mirror: `AVIARY_DEBIAN_MIRROR`, else the host's first apt source.
pub(crate) fn debian_mirror() -> Result<String, TemplateError> {
    if let Ok(m) = std::env::var("AVIARY_DEBIAN_MIRROR") {
        if !m.trim().is_empty() {
            return Ok(m.trim().to_owned());
        }
    }
    let mut texts = Vec::new();
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut files: Vec<PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
            .collect();
        files.sort();
        texts.extend(files.iter().filter_map(|p| fs::read_to_string(p).ok()));
    }
    if let Ok(t) = fs::read_to_string("/etc/apt/sources.list") {
        texts.insert(0, t);
    }
    texts
        .iter()
        .find_map(|t| mirror_from_sources(t))
        .ok_or(TemplateError::FindMirror)
}

/// The first usable http(s) mirror in an apt sources text (deb822 `URIs:`
/// or one-line `deb [opts] URI suite …`), skipping security archives.
fn mirror_from_sources(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.trim();
        let uri = if let Some(rest) = line.strip_prefix("URIs:") {
            rest.split_whitespace().next()?
        } else if let Some(rest) = line.strip_prefix("deb ") {
            let rest = rest.trim_start();
            let rest = if rest.starts_with('[') {
                rest.split_once(']')?.1
            } else {
                rest
            };
            rest.split_whitespace().next()?
        } else {
            return None;
        };
        let usable = (uri.starts_with("http://") || uri.starts_with("https://"))
            && !uri.contains("security");
        usable.then(|| uri.to_owned())
    })
}

/// Runs `cmd`, sending each output line (stdout and stderr) to `progress`
/// with `prefix`; returns the last lines for error messages.
fn run_streaming(
    tool: &'static str,
    mut cmd: Command,
    prefix: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), TemplateError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| TemplateError::SpawnTool { tool, source })?;
    let (tx, rx) = mpsc::channel::<String>();
    let mut readers = Vec::new();
    let pipes: Vec<Box<dyn Read + Send>> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .collect();
    for pipe in pipes {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        }));
    }
    drop(tx);
    let mut tail = std::collections::VecDeque::new();
    for line in rx {
        progress(&format!("{prefix}{line}"));
        tail.push_back(line);
        if tail.len() > 20 {
            tail.pop_front();
        }
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child
        .wait()
        .map_err(|source| TemplateError::SpawnTool { tool, source })?;
    if status.success() {
        Ok(())
    } else {
        Err(TemplateError::RunTool {
            tool,
            status: status.to_string(),
            tail: Vec::from(tail).join("\n"),
        })
    }
}

/// Builds Debian bookworm minbase + python3 at `rootfs` with debootstrap,
/// cleans caches and logs, adds `/workspace` and `/tmp`, and checks that
/// python3 runs in it.
pub(crate) fn debootstrap(
    rootfs: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), TemplateError> {
    let tool =
        find_in_path("debootstrap", &["/usr/sbin", "/sbin"]).ok_or(TemplateError::MissingTool {
            tool: "debootstrap",
            hint: "install it with `apt-get install debootstrap` (as root)",
        })?;
    let mirror = debian_mirror()?;
    progress(&format!(
        "debootstrap: building {SUITE} minbase + python3 from {mirror} (takes a minute or two)"
    ));
    mkdir_mode(rootfs, 0o755)?;
    let mut cmd = Command::new(tool);
    cmd.args(["--variant=minbase", "--include=python3", SUITE])
        .arg(rootfs)
        .arg(&mirror);
    run_streaming("debootstrap", cmd, "debootstrap: ", progress)?;
    // debootstrap unmounts what it mounted on success; make sure of it before
    // we walk and digest the tree.
    let leftover = crate::fsutil::mounts_under(rootfs)?;
    if !leftover.is_empty() {
        return Err(TemplateError::CheckRootfs(format!(
            "debootstrap left mounts behind: {leftover:?}"
        )));
    }
    progress("debootstrap: cleaning caches and logs");
    clean_debian(rootfs)?;
    progress("debootstrap: checking python3");
    check_python(rootfs)
}

/// Empties `dir` (keeps the directory); with `keep_dirs`, keeps
/// subdirectories too and only removes non-directories below them.
fn empty_dir(dir: &Path, keep_dirs: bool) -> Result<(), TemplateError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(remove_err(dir.to_path_buf(), e)),
    };
    for entry in entries {
        let path = entry.ctx(remove_err, dir)?.path();
        let md = fs::symlink_metadata(&path).ctx(remove_err, &path)?;
        if md.is_dir() {
            if keep_dirs {
                empty_dir(&path, true)?;
            } else {
                fs::remove_dir_all(&path).ctx(remove_err, &path)?;
            }
        } else {
            fs::remove_file(&path).ctx(remove_err, &path)?;
        }
    }
    Ok(())
}

fn clean_debian(rootfs: &Path) -> Result<(), TemplateError> {
    empty_dir(&rootfs.join("var/lib/apt/lists"), false)?;
    mkdir_mode(&rootfs.join("var/lib/apt/lists/partial"), 0o700)?;
    empty_dir(&rootfs.join("var/cache/apt"), true)?;
    empty_dir(&rootfs.join("var/log"), true)?;
    // The runtime provides /dev; device nodes in a template are only risk.
    empty_dir(&rootfs.join("dev"), false)?;
    // debootstrap copies these from the host; they must not leak into sandboxes.
    for (rel, content) in [("etc/hostname", "aviary\n"), ("etc/resolv.conf", "")] {
        let p = rootfs.join(rel);
        let _ = fs::remove_file(&p);
        fs::write(&p, content).ctx(write_err, &p)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).ctx(write_err, &p)?;
    }
    mkdir_mode(&rootfs.join("workspace"), 0o755)?;
    mkdir_mode(&rootfs.join("tmp"), 0o1777)?;
    Ok(())
}

fn check_python(rootfs: &Path) -> Result<(), TemplateError> {
    let chroot =
        find_in_path("chroot", &["/usr/sbin", "/sbin"]).ok_or(TemplateError::MissingTool {
            tool: "chroot",
            hint: "install coreutils",
        })?;
    let out = Command::new(chroot)
        .arg(rootfs)
        .args(["python3", "-c", "print(1)"])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .stdin(Stdio::null())
        .output()
        .map_err(|source| TemplateError::SpawnTool {
            tool: "chroot",
            source,
        })?;
    if out.status.success() && out.stdout == b"1\n" {
        Ok(())
    } else {
        Err(TemplateError::CheckRootfs(format!(
            "`chroot {} python3 -c 'print(1)'` gave {} stdout {:?} stderr {:?}",
            rootfs.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_is_read_from_deb822_and_one_line_sources() {
        let deb822 = "Types: deb\n# comment\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n";
        assert_eq!(
            mirror_from_sources(deb822).unwrap(),
            "http://deb.debian.org/debian"
        );
        let classic = "# x\ndeb http://security.debian.org/debian-security bookworm-security main\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n";
        assert_eq!(
            mirror_from_sources(classic).unwrap(),
            "http://mirror.example/debian"
        );
        assert_eq!(mirror_from_sources("deb cdrom:[x]/ bookworm main\n"), None);
    }

    #[test]
    fn host_busybox_is_recognized_as_static() {
        let Ok(bin) = find_busybox() else {
            eprintln!("SKIPPED host_busybox_is_recognized_as_static: no busybox on this host (apt-get install busybox-static)");
            return;
        };
        assert!(
            is_static_elf(&bin).unwrap(),
            "{} should be static",
            bin.display()
        );
        // A dynamically linked binary has PT_INTERP.
        assert!(!is_static_elf(Path::new("/bin/sh")).unwrap());
    }
}
