//! Aviary's template store: the immutable root filesystems sandboxes start from.
//!
//! # What it owns
//! A directory (normally `<data dir>/templates`) laid out as
//!
//! ```text
//! <root>/.lock                      store lock: name and rootfs mutations
//! <root>/names/<name>.json          name -> digest, size, source, created_at
//! <root>/rootfs/                    mode 0700: host users cannot reach setuid files
//! <root>/rootfs/<digest-hex>/       one immutable tree per content digest
//! <root>/tmp/<build-id>/ + .lock    private staging areas of running builds
//! <root>/locks/<name>.build.lock    serializes "build if missing" per name
//! ```
//!
//! # Invariants
//! - A tree under `rootfs/` is complete and never written after it is renamed
//!   there; sandboxes use it only as the read-only overlayfs lower layer.
//!   Its name is the hex of its digest ([`digest_tree`], documented in
//!   [`digest`]), so equal content is stored once whatever it is called.
//! - Every build happens in a staging directory inside `<root>` and is moved in
//!   with one `rename`; a crashed build leaves only a staging directory, which
//!   the next [`TemplateStore::open`] removes (its build lock is free).
//! - A name file is replaced atomically (write, fsync, rename).
//!
//! # Concurrency
//! Blocking std I/O throughout (async callers use `spawn_blocking`). Readers
//! (`get`, `list`) take no lock. Mutations take the store's `flock`, so
//! threads and processes sharing a root are serialized; `ensure_default`
//! additionally holds a per-name build lock for the whole build, so
//! concurrent callers build the default template once and the others wait.
#![forbid(unsafe_code)]

mod archive;
pub mod digest;
mod error;
mod extract;
mod fsutil;
mod prepare;
#[cfg(test)]
mod tests;

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

pub use digest::{digest_tree, TreeDigest};
pub use error::TemplateError;
pub use extract::ImportLimits;

use error::{commit_err, open_err, read_meta_err, remove_err, write_meta_err, IoContext};
use fsutil::Staging;

/// Name of the template sandboxes use when none is asked for.
pub const DEFAULT_TEMPLATE: &str = "default";

/// A stored template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateInfo {
    pub name: String,
    /// `sha256:<hex>` over the canonical tree serialization (see [`digest`]).
    pub digest: String,
    /// The immutable rootfs directory: use it only as a read-only lower layer.
    pub rootfs: PathBuf,
    /// Apparent size of the regular files (each inode once).
    pub size_bytes: u64,
    /// `debootstrap:bookworm`, `busybox`, `docker-archive` or `oci-layout`.
    pub source: String,
    pub created_at: OffsetDateTime,
    /// What the imported image's config asks of processes run from it.
    pub defaults: aviary_core::api::ImageDefaults,
}

impl TemplateInfo {
    /// The API view of this template.
    pub fn to_api(&self) -> aviary_core::api::Template {
        aviary_core::api::Template {
            name: self.name.clone(),
            digest: self.digest.clone(),
            size_bytes: self.size_bytes,
            source: self.source.clone(),
            created_at: self.created_at,
            defaults: Default::default(),
        }
    }
}

/// What `names/<name>.json` holds.
#[derive(Debug, Serialize, Deserialize)]
struct NameRecord {
    name: String,
    digest: String,
    size_bytes: u64,
    source: String,
    #[serde(with = "time::serde::rfc3339")]
    created_at: OffsetDateTime,
    /// From the imported image's config (empty for built templates).
    #[serde(default)]
    defaults: aviary_core::api::ImageDefaults,
}

/// A directory of templates. Cheap to clone; all methods block.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    root: PathBuf,
    limits: ImportLimits,
}

/// Checks a template name: 1-128 of `[A-Za-z0-9._-]`, first a letter or digit.
pub fn validate_name(name: &str) -> Result<(), TemplateError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(TemplateError::InvalidName(name.to_owned()))
    }
}

impl TemplateStore {
    /// Opens (creating if needed) the store at `root` and removes staging
    /// directories left by builds that died.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, TemplateError> {
        let root = root.into();
        for sub in ["names", "rootfs", "tmp", "locks"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).ctx(open_err, &dir)?;
        }
        for private in ["rootfs", "tmp"] {
            let dir = root.join(private);
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).ctx(open_err, &dir)?;
        }
        let store = TemplateStore {
            root,
            limits: ImportLimits::default(),
        };
        fsutil::sweep_staging(&store.root.join("tmp"))?;
        Ok(store)
    }

    /// The same store with other import limits.
    pub fn with_import_limits(mut self, limits: ImportLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn name_path(&self, name: &str) -> PathBuf {
        self.root.join("names").join(format!("{name}.json"))
    }

    fn rootfs_path(&self, digest: &str) -> PathBuf {
        self.root
            .join("rootfs")
            .join(digest.trim_start_matches("sha256:"))
    }

    fn read_record(&self, path: &Path) -> Result<Option<NameRecord>, TemplateError> {
        let data = match fs::read(path) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(read_meta_err(path.to_path_buf(), e)),
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|source| TemplateError::ParseMetadata {
                path: path.to_path_buf(),
                source,
            })
    }

    fn info(&self, rec: NameRecord) -> Result<TemplateInfo, TemplateError> {
        // The digest names a directory: refuse anything but sha256 hex.
        let hex = rec.digest.strip_prefix("sha256:").unwrap_or("");
        if hex.len() != 64 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(TemplateError::ParseMetadata {
                path: self.name_path(&rec.name),
                source: serde::de::Error::custom(format!("bad digest {:?}", rec.digest)),
            });
        }
        let rootfs = self.rootfs_path(&rec.digest);
        if !rootfs.is_dir() {
            return Err(TemplateError::MissingRootfs {
                name: rec.name,
                digest: rec.digest,
            });
        }
        Ok(TemplateInfo {
            name: rec.name,
            digest: rec.digest,
            rootfs,
            size_bytes: rec.size_bytes,
            source: rec.source,
            created_at: rec.created_at,
            defaults: rec.defaults,
        })
    }

    /// The template called `name`, if there is one.
    pub fn get(&self, name: &str) -> Result<Option<TemplateInfo>, TemplateError> {
        validate_name(name)?;
        match self.read_record(&self.name_path(name))? {
            Some(rec) => self.info(rec).map(Some),
            None => Ok(None),
        }
    }

    /// All templates, sorted by name. Broken entries are logged and skipped.
    pub fn list(&self) -> Result<Vec<TemplateInfo>, TemplateError> {
        let dir = self.root.join("names");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).ctx(read_meta_err, &dir)? {
            let entry = entry.ctx(read_meta_err, &dir)?;
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if validate_name(name).is_err() {
                continue;
            }
            match self.read_record(&entry.path()).and_then(|r| match r {
                Some(rec) => self.info(rec).map(Some),
                None => Ok(None),
            }) {
                Ok(Some(info)) => out.push(info),
                Ok(None) => {}
                Err(e) => tracing::warn!(template = name, error = %e, "skipping broken template"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The default template ("default"): Debian bookworm minbase + python3 via
    /// debootstrap, prepared on first use. Progress lines go to `progress`.
    /// Concurrent callers (threads or processes) build it once; the others
    /// wait for that build and return its result.
    pub fn ensure_default(
        &self,
        progress: &mut dyn FnMut(&str),
    ) -> Result<TemplateInfo, TemplateError> {
        self.ensure_with(DEFAULT_TEMPLATE, progress, |store, staging, progress| {
            let rootfs = staging.join("rootfs");
            prepare::debootstrap(&rootfs, progress)?;
            progress("debootstrap: computing digest");
            store.commit(
                &rootfs,
                DEFAULT_TEMPLATE,
                prepare::DEBOOTSTRAP_SOURCE,
                Default::default(),
            )
        })
    }

    /// Returns template `name` if present, else builds it with `build` while
    /// holding the name's build lock (re-checking after the lock is taken).
    fn ensure_with(
        &self,
        name: &str,
        progress: &mut dyn FnMut(&str),
        build: impl FnOnce(&Self, &Path, &mut dyn FnMut(&str)) -> Result<TemplateInfo, TemplateError>,
    ) -> Result<TemplateInfo, TemplateError> {
        if let Some(t) = self.get(name)? {
            return Ok(t);
        }
        let lock_path = self.root.join("locks").join(format!("{name}.build.lock"));
        let _lock = match fsutil::try_lock_exclusive(&lock_path)? {
            Some(lock) => lock,
            None => {
                progress(&format!(
                    "template {name}: another process is building it, waiting"
                ));
                fsutil::lock_exclusive(&lock_path)?
            }
        };
        if let Some(t) = self.get(name)? {
            return Ok(t);
        }
        let staging = Staging::create(&self.root.join("tmp"))?;
        let info = build(self, staging.dir(), progress)?;
        progress(&format!("template {name}: ready ({})", info.digest));
        Ok(info)
    }

    /// A tiny template from the host's static busybox: `/bin/busybox`, its
    /// applet links, `/etc/passwd`, `/etc/group`, `/tmp`, `/workspace`.
    /// The busybox binary is taken from `AVIARY_BUSYBOX` or the usual paths.
    pub fn build_busybox(&self, name: &str) -> Result<TemplateInfo, TemplateError> {
        validate_name(name)?;
        let staging = Staging::create(&self.root.join("tmp"))?;
        let rootfs = staging.dir().join("rootfs");
        prepare::busybox(&rootfs)?;
        self.commit(&rootfs, name, "busybox", Default::default())
    }

    /// Imports a `docker save` tarball or an OCI image-layout tarball as
    /// template `name` (see the `archive` and `extract` modules for the
    /// accepted formats and the safety rules). On any error nothing is stored.
    pub fn import_archive(
        &self,
        name: &str,
        archive: &Path,
    ) -> Result<TemplateInfo, TemplateError> {
        validate_name(name)?;
        let staging = Staging::create(&self.root.join("tmp"))?;
        let rootfs = staging.dir().join("rootfs");
        fs::create_dir(&rootfs).ctx(error::write_err, &rootfs)?;
        let budget = extract::Budget::new(self.limits);
        let (kind, defaults) = archive::import_into(archive, &rootfs, staging.dir(), &budget)?;
        // The root directory's own metadata is the store's, not the image's.
        fs::set_permissions(&rootfs, fs::Permissions::from_mode(0o755))
            .ctx(error::write_err, &rootfs)?;
        self.commit(&rootfs, name, kind.source(), defaults)
    }

    /// Removes template `name`. Its rootfs is deleted when no other name
    /// refers to the same digest. The caller must make sure no sandbox still
    /// uses it as a lower layer.
    pub fn remove(&self, name: &str) -> Result<(), TemplateError> {
        validate_name(name)?;
        let _lock = fsutil::lock_exclusive(&self.root.join(".lock"))?;
        let path = self.name_path(name);
        let rec = self
            .read_record(&path)?
            .ok_or_else(|| TemplateError::NotFound(name.to_owned()))?;
        fs::remove_file(&path).ctx(write_meta_err, &path)?;
        if !self.digest_referenced(&rec.digest)? {
            self.remove_rootfs(&rec.digest)?;
        }
        Ok(())
    }

    /// Deletes rootfs trees that no name refers to and that are not in
    /// `in_use` (digests of trees live sandboxes still mount). Such trees
    /// appear when a name is re-pointed to new content. Returns the removed
    /// digests.
    pub fn prune(&self, in_use: &[String]) -> Result<Vec<String>, TemplateError> {
        let _lock = fsutil::lock_exclusive(&self.root.join(".lock"))?;
        let dir = self.root.join("rootfs");
        let mut removed = Vec::new();
        for entry in fs::read_dir(&dir).ctx(read_meta_err, &dir)? {
            let entry = entry.ctx(read_meta_err, &dir)?;
            let Some(hex) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let digest = format!("sha256:{hex}");
            if in_use.contains(&digest) || self.digest_referenced(&digest)? {
                continue;
            }
            self.remove_rootfs(&digest)?;
            removed.push(digest);
        }
        Ok(removed)
    }

    fn digest_referenced(&self, digest: &str) -> Result<bool, TemplateError> {
        let dir = self.root.join("names");
        for entry in fs::read_dir(&dir).ctx(read_meta_err, &dir)? {
            let entry = entry.ctx(read_meta_err, &dir)?;
            if entry.path().extension().is_some_and(|e| e == "json") {
                if let Ok(Some(rec)) = self.read_record(&entry.path()) {
                    if rec.digest == digest {
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    }

    /// Moves the tree out of `rootfs/` first (one rename), so a half-deleted
    /// tree is never visible under its digest.
    fn remove_rootfs(&self, digest: &str) -> Result<(), TemplateError> {
        let path = self.rootfs_path(digest);
        if !path.exists() {
            return Ok(());
        }
        let trash = Staging::create(&self.root.join("tmp"))?;
        let dest = trash.dir().join("old");
        fs::rename(&path, &dest).ctx(remove_err, &path)?;
        fsutil::remove_tree(trash.dir())
    }

    /// Digests the finished tree at `rootfs` (inside a staging dir), moves it
    /// to `rootfs/<hex>` unless that content is already stored, and points
    /// `name` at it.
    fn commit(
        &self,
        rootfs: &Path,
        name: &str,
        source: &str,
        defaults: aviary_core::api::ImageDefaults,
    ) -> Result<TemplateInfo, TemplateError> {
        let tree = digest_tree(rootfs)?;
        // Flush the tree's data before it becomes visible under its digest,
        // so a crash cannot leave a complete-looking tree with lost contents.
        if let Ok(f) = fs::File::open(rootfs) {
            let _ = nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f));
        }
        let _lock = fsutil::lock_exclusive(&self.root.join(".lock"))?;
        let target = self.rootfs_path(&tree.digest);
        if target.is_dir() {
            tracing::info!(template = name, digest = %tree.digest, "content already stored");
        } else {
            fs::rename(rootfs, &target).ctx(commit_err, &target)?;
        }
        let rec = NameRecord {
            name: name.to_owned(),
            digest: tree.digest,
            size_bytes: tree.size_bytes,
            source: source.to_owned(),
            created_at: aviary_core::now(),
            defaults,
        };
        let path = self.name_path(name);
        if let Some(old) = self.read_record(&path)? {
            if old.digest == rec.digest && old.source == rec.source && old.defaults == rec.defaults
            {
                return self.info(old);
            }
        }
        let json =
            serde_json::to_vec_pretty(&rec).map_err(|source| TemplateError::ParseMetadata {
                path: path.clone(),
                source,
            })?;
        fsutil::write_atomic(&path, &json).ctx(write_meta_err, &path)?;
        self.info(rec)
    }
}
