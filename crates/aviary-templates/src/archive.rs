//! Reading image archives: `docker save` tarballs and OCI image layouts.
//!
//! The outer tarball (optionally gzip/zstd-compressed as a whole) is indexed
//! once (member name → offset and size); nothing of it is ever extracted to
//! disk by name, so hostile member names in the outer tar are harmless.
//! Metadata members (`manifest.json`, `index.json`, configs, manifests) are
//! read into memory with a size cap. Each layer is streamed from its offset
//! through: blob hash → decompression (gzip/zstd, sniffed from magic bytes)
//! → uncompressed hash + byte budget → [`extract::apply_layer`].
//!
//! Verification: every blob named by digest (`blobs/sha256/<hex>`, and
//! legacy `<hex>.json` configs) must hash to its name; every layer's
//! uncompressed stream must hash to its `diff_id` from the image config. A
//! `docker save` archive must carry diff_ids for all layers.

use aviary_core::api::ImageDefaults;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, OciLayout};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{read_archive_err, write_err, IoContext, TemplateError};
use crate::extract::{self, Budget, DeferredDirs};

/// Largest metadata member (manifest, index, config) we read into memory.
const MAX_JSON: u64 = 16 << 20;

/// Which kind of archive an import was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArchiveKind {
    DockerArchive,
    OciLayout,
}

impl ArchiveKind {
    pub(crate) fn source(self) -> &'static str {
        match self {
            ArchiveKind::DockerArchive => "docker-archive",
            ArchiveKind::OciLayout => "oci-layout",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Zstd,
}

fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

fn decoder<'a>(
    kind: Compression,
    input: &'a mut (dyn BufRead + 'a),
) -> Result<Box<dyn Read + 'a>, TemplateError> {
    match kind {
        Compression::None => Ok(Box::new(input)),
        Compression::Gzip => Ok(Box::new(flate2::bufread::MultiGzDecoder::new(input))),
        #[cfg(feature = "zstd")]
        Compression::Zstd => {
            let d = ruzstd::decoding::StreamingDecoder::new(input)
                .map_err(|e| TemplateError::invalid(format!("zstd stream: {e}")))?;
            Ok(Box::new(d))
        }
        #[cfg(not(feature = "zstd"))]
        Compression::Zstd => Err(TemplateError::invalid(
            "zstd-compressed data needs aviary-templates' `zstd` feature",
        )),
    }
}

/// Hashes (and optionally charges to a budget) everything read through it.
struct Hashing<'a, R> {
    inner: R,
    hasher: Sha256,
    budget: Option<&'a Budget>,
}

impl<'a, R: Read> Hashing<'a, R> {
    fn new(inner: R, budget: Option<&'a Budget>) -> Self {
        Hashing {
            inner,
            hasher: Sha256::new(),
            budget,
        }
    }

    fn finish_hex(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

impl<R: Read> Read for Hashing<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(b) = self.budget {
            b.charge_bytes(n as u64)?;
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Index of the outer tarball's regular-file members.
struct Outer {
    path: std::path::PathBuf,
    members: HashMap<String, (u64, u64)>,
}

impl Outer {
    fn index(path: &Path, max_entries: u64) -> Result<Self, TemplateError> {
        let file = File::open(path).ctx(read_archive_err, path)?;
        let mut archive = tar::Archive::new(file);
        let bad = |e: io::Error| TemplateError::invalid(format!("outer tar: {e}"));
        let mut members = HashMap::new();
        for (n, entry) in archive.entries_with_seek().map_err(bad)?.enumerate() {
            if n as u64 >= max_entries {
                return Err(TemplateError::invalid(format!(
                    "outer tar has more than {max_entries} entries"
                )));
            }
            let entry = entry.map_err(bad)?;
            if !matches!(
                entry.header().entry_type(),
                tar::EntryType::Regular | tar::EntryType::Continuous
            ) {
                continue;
            }
            let name = entry.path().map_err(bad)?;
            let Ok(norm) = extract::normalize(&name, "member") else {
                continue;
            };
            let Some(key) = norm.to_str().map(str::to_owned) else {
                continue;
            };
            members.insert(key, (entry.raw_file_position(), entry.size()));
        }
        Ok(Outer {
            path: path.to_path_buf(),
            members,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.members.contains_key(name)
    }

    fn open(&self, name: &str) -> Result<io::Take<File>, TemplateError> {
        let &(offset, size) = self
            .members
            .get(name)
            .ok_or_else(|| TemplateError::invalid(format!("archive has no member {name:?}")))?;
        let mut f = File::open(&self.path).ctx(read_archive_err, &self.path)?;
        f.seek(SeekFrom::Start(offset))
            .ctx(read_archive_err, &self.path)?;
        Ok(f.take(size))
    }

    /// Reads a small member, checking its sha256 when `hex` is given.
    fn read_small(&self, name: &str, hex: Option<&str>) -> Result<Vec<u8>, TemplateError> {
        let size = self.members.get(name).map(|m| m.1).unwrap_or(0);
        if size > MAX_JSON {
            return Err(TemplateError::invalid(format!(
                "{name} is larger than {MAX_JSON} bytes"
            )));
        }
        let mut data = Vec::new();
        self.open(name)?
            .read_to_end(&mut data)
            .ctx(read_archive_err, &self.path)?;
        if let Some(want) = hex {
            let got = hex::encode(Sha256::digest(&data));
            if got != want {
                return Err(TemplateError::invalid(format!(
                    "{name}: digest mismatch (sha256:{got})"
                )));
            }
        }
        Ok(data)
    }

    /// A small JSON member, decoded into `T` (an `oci-spec` image type or
    /// Docker's manifest list); a shape error names the member.
    fn read_json<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        hex: Option<&str>,
    ) -> Result<T, TemplateError> {
        let data = self.read_small(name, hex)?;
        serde_json::from_slice(&data)
            .map_err(|e| TemplateError::invalid(format!("{name} is not a valid document: {e}")))
    }
}

/// One layer to apply: where it is and what it must hash to.
struct LayerRef {
    member: String,
    blob_hex: Option<String>,
    diff_hex: Option<String>,
}

/// Parses `sha256:<64 lowercase hex>`; other algorithms are refused.
fn sha256_hex(digest: &str) -> Result<String, TemplateError> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| TemplateError::invalid(format!("unsupported digest {digest:?}")))?;
    if hex.len() != 64 || !hex.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(TemplateError::invalid(format!(
            "malformed digest {digest:?}"
        )));
    }
    Ok(hex.to_owned())
}

/// The digest hex of a content-addressed member name, if it is one.
fn member_hex(member: &str) -> Option<String> {
    let tail = member
        .strip_prefix("blobs/sha256/")
        .or_else(|| member.strip_suffix(".json"))?;
    sha256_hex(&format!("sha256:{tail}")).ok()
}

/// One image of Docker's `manifest.json` (`docker save`).
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerImage {
    config: String,
    layers: Vec<String>,
}

/// `rootfs.diff_ids` as digest hex, if every one is a valid sha256 digest.
fn diff_ids(config: &ImageConfiguration) -> Option<Vec<String>> {
    config
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| sha256_hex(d).ok())
        .collect()
}

fn docker_layers(outer: &Outer) -> Result<(Vec<LayerRef>, ImageDefaults), TemplateError> {
    let images: Vec<DockerImage> = outer.read_json("manifest.json", None)?;
    let [image] = images.as_slice() else {
        return Err(TemplateError::invalid(format!(
            "manifest.json lists {} images; import exactly one",
            images.len()
        )));
    };
    let config_name = norm_member(&image.config)?;
    let config: ImageConfiguration =
        outer.read_json(&config_name, member_hex(&config_name).as_deref())?;
    let diffs = diff_ids(&config).ok_or_else(|| {
        TemplateError::invalid(format!("{config_name}: no valid rootfs.diff_ids"))
    })?;
    let defaults = image_defaults(&config, &config_name)?;
    if image.layers.len() != diffs.len() {
        return Err(TemplateError::invalid(format!(
            "manifest lists {} layers but the config has {} diff_ids",
            image.layers.len(),
            diffs.len()
        )));
    }
    let layers = image
        .layers
        .iter()
        .zip(diffs)
        .map(|(l, diff)| {
            let member = norm_member(l)?;
            Ok(LayerRef {
                blob_hex: member
                    .starts_with("blobs/sha256/")
                    .then(|| member_hex(&member))
                    .flatten(),
                member,
                diff_hex: Some(diff),
            })
        })
        .collect::<Result<Vec<_>, TemplateError>>()?;
    Ok((layers, defaults))
}

/// Largest environment an image may bring (names and values).
const MAX_IMAGE_ENV_BYTES: usize = 32 * 1024;

/// `config.Env`, `config.WorkingDir` and `config.User` of an image config
/// (the same fields in Docker's and OCI's). An entry a sandbox could not
/// honour is refused, naming it, rather than dropped.
fn image_defaults(config: &ImageConfiguration, ctx: &str) -> Result<ImageDefaults, TemplateError> {
    let Some(c) = config.config() else {
        return Ok(ImageDefaults::default());
    };
    let bad = |what: String| TemplateError::invalid(format!("{ctx}: {what}"));
    let mut out = ImageDefaults::default();
    let mut size = 0;
    for entry in c.env().iter().flatten() {
        let (k, v) = entry
            .split_once('=')
            .ok_or_else(|| bad(format!("config.Env entry {entry:?} is not NAME=VALUE")))?;
        let b = k.as_bytes();
        let name_ok = !b.is_empty()
            && (b[0].is_ascii_alphabetic() || b[0] == b'_')
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if !name_ok || v.contains('\0') {
            return Err(bad(format!(
                "config.Env entry {entry:?} is not a usable variable"
            )));
        }
        size += entry.len();
        out.env.insert(k.to_owned(), v.to_owned());
    }
    if size > MAX_IMAGE_ENV_BYTES {
        return Err(bad(format!(
            "config.Env is {size} bytes; at most {MAX_IMAGE_ENV_BYTES}"
        )));
    }
    if let Some(dir) = c.working_dir().as_deref().filter(|d| !d.is_empty()) {
        if dir != "/" && aviary_core::paths::clean_absolute(dir).is_none() {
            return Err(bad(format!(
                "config.WorkingDir {dir:?} is not a clean absolute path"
            )));
        }
        out.working_dir = Some(dir.to_owned());
    }
    if let Some(user) = c.user().as_deref().filter(|u| !u.is_empty()) {
        let ok = user.len() <= 64
            && user
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
            && user.matches(':').count() <= 1;
        if !ok {
            return Err(bad(format!("config.User {user:?} is not user[:group]")));
        }
        out.user = Some(user.to_owned());
    }
    Ok(out)
}

fn norm_member(name: &str) -> Result<String, TemplateError> {
    let p = extract::normalize(Path::new(name), "member")?;
    p.to_str()
        .map(str::to_owned)
        .ok_or_else(|| TemplateError::invalid("member name is not UTF-8"))
}

fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ("linux", arch)
}

fn choose_descriptor<'d>(
    list: &'d [Descriptor],
    ctx: &str,
) -> Result<&'d Descriptor, TemplateError> {
    if let [only] = list {
        return Ok(only);
    }
    let (os, arch) = host_platform();
    let matching: Vec<&Descriptor> = list
        .iter()
        .filter(|d| {
            d.platform()
                .as_ref()
                .is_some_and(|p| p.os().to_string() == os && p.architecture().to_string() == arch)
        })
        .collect();
    match matching.as_slice() {
        [one] => Ok(one),
        _ => Err(TemplateError::invalid(format!(
            "{ctx} lists {} manifests and not exactly one for {os}/{arch}",
            list.len()
        ))),
    }
}

fn is_index(media_type: &str) -> bool {
    media_type.ends_with("image.index.v1+json") || media_type.ends_with("manifest.list.v2+json")
}

fn oci_layers(outer: &Outer) -> Result<(Vec<LayerRef>, ImageDefaults), TemplateError> {
    let layout: OciLayout = outer.read_json("oci-layout", None)?;
    if layout.image_layout_version() != "1.0.0" {
        return Err(TemplateError::invalid(
            "oci-layout: unsupported imageLayoutVersion",
        ));
    }
    let mut index: ImageIndex = outer.read_json("index.json", None)?;
    let mut ctx = "index.json".to_owned();
    // Follow nested indexes to one image manifest (bounded depth).
    for _ in 0..4 {
        let desc = choose_descriptor(index.manifests(), &ctx)?;
        let hex = sha256_hex(desc.digest().as_ref())?;
        let member = format!("blobs/sha256/{hex}");
        let next: Value = outer.read_json(&member, Some(&hex))?;
        let next_media = next
            .get("mediaType")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| desc.media_type().to_string());
        let decode = |e: serde_json::Error| {
            TemplateError::invalid(format!("{member} is not a valid document: {e}"))
        };
        if is_index(&next_media)
            || (next.get("manifests").is_some() && next.get("layers").is_none())
        {
            index = serde_json::from_value(next).map_err(decode)?;
            ctx = member;
            continue;
        }
        let manifest: ImageManifest = serde_json::from_value(next).map_err(decode)?;
        return manifest_layers(outer, &manifest, &member);
    }
    Err(TemplateError::invalid("image indexes nested too deeply"))
}

fn manifest_layers(
    outer: &Outer,
    manifest: &ImageManifest,
    ctx: &str,
) -> Result<(Vec<LayerRef>, ImageDefaults), TemplateError> {
    let config_hex = sha256_hex(manifest.config().digest().as_ref())?;
    let config_name = format!("blobs/sha256/{config_hex}");
    let config: ImageConfiguration = outer.read_json(&config_name, Some(&config_hex))?;
    let layers = manifest.layers();
    let diffs = diff_ids(&config).filter(|d| d.len() == layers.len());
    let defaults = image_defaults(&config, &config_name)?;
    let layers = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let media = l.media_type().to_string();
            if media.contains("encrypted") {
                return Err(TemplateError::invalid(format!(
                    "{ctx}: encrypted layer ({media})"
                )));
            }
            let hex = sha256_hex(l.digest().as_ref())?;
            Ok(LayerRef {
                member: format!("blobs/sha256/{hex}"),
                blob_hex: Some(hex),
                diff_hex: diffs.as_ref().map(|d| d[i].clone()),
            })
        })
        .collect::<Result<Vec<_>, TemplateError>>()?;
    Ok((layers, defaults))
}

/// Imports `archive` into the empty directory `rootfs`, using `scratch` (a
/// private directory) for a decompressed copy of a compressed outer tarball.
pub(crate) fn import_into(
    archive: &Path,
    rootfs: &Path,
    scratch: &Path,
    budget: &Budget,
) -> Result<(ArchiveKind, ImageDefaults), TemplateError> {
    let outer_path = decompress_outer(archive, scratch, budget)?;
    let outer = Outer::index(&outer_path, budget.limits.max_entries)?;
    let (kind, (layers, defaults)) = if outer.has("oci-layout") && outer.has("index.json") {
        (ArchiveKind::OciLayout, oci_layers(&outer)?)
    } else if outer.has("manifest.json") {
        (ArchiveKind::DockerArchive, docker_layers(&outer)?)
    } else {
        return Err(TemplateError::invalid(
            "neither a `docker save` archive (manifest.json) nor an OCI image layout (oci-layout, index.json)",
        ));
    };
    let mut deferred = DeferredDirs::default();
    for (i, layer) in layers.iter().enumerate() {
        let stats = apply_one(&outer, layer, rootfs, budget, &mut deferred)?;
        tracing::debug!(
            layer = i,
            member = %layer.member,
            entries = stats.entries,
            skipped_devices = stats.skipped_devices,
            "applied layer"
        );
    }
    extract::finish_dirs(rootfs, deferred)?;
    Ok((kind, defaults))
}

fn apply_one(
    outer: &Outer,
    layer: &LayerRef,
    rootfs: &Path,
    budget: &Budget,
    deferred: &mut DeferredDirs,
) -> Result<extract::LayerStats, TemplateError> {
    let bad = |e: io::Error| TemplateError::invalid(format!("layer {}: {e}", layer.member));
    let mut raw = Hashing::new(outer.open(&layer.member)?, None);
    let mut buffered = BufReader::with_capacity(256 * 1024, &mut raw);
    let compression = sniff(buffered.fill_buf().map_err(bad)?);
    let diff_hex;
    let stats;
    {
        let decoded = decoder(compression, &mut buffered)?;
        let mut plain = Hashing::new(decoded, Some(budget));
        stats = extract::apply_layer(rootfs, &mut plain, &layer.member, budget, deferred)?;
        // The tar reader stops at the end-of-archive marker; the rest (padding)
        // still belongs to the hashed stream.
        io::copy(&mut plain, &mut io::sink()).map_err(bad)?;
        diff_hex = plain.finish_hex();
    }
    io::copy(&mut buffered, &mut io::sink()).map_err(bad)?;
    drop(buffered);
    let blob_hex = raw.finish_hex();
    if let Some(want) = &layer.blob_hex {
        if *want != blob_hex {
            return Err(TemplateError::invalid(format!(
                "layer {}: blob digest mismatch (got sha256:{blob_hex})",
                layer.member
            )));
        }
    }
    if let Some(want) = &layer.diff_hex {
        if *want != diff_hex {
            return Err(TemplateError::invalid(format!(
                "layer {}: uncompressed digest does not match diff_id sha256:{want} (got sha256:{diff_hex})",
                layer.member
            )));
        }
    }
    Ok(stats)
}

/// Returns a path to the uncompressed outer tarball: the archive itself, or a
/// decompressed copy in `scratch` (charged to the byte budget).
fn decompress_outer(
    archive: &Path,
    scratch: &Path,
    budget: &Budget,
) -> Result<std::path::PathBuf, TemplateError> {
    let file = File::open(archive).ctx(read_archive_err, archive)?;
    let mut buffered = BufReader::with_capacity(256 * 1024, file);
    let compression = sniff(buffered.fill_buf().ctx(read_archive_err, archive)?);
    if compression == Compression::None {
        return Ok(archive.to_path_buf());
    }
    let copy = scratch.join("outer.tar");
    let mut out = File::create(&copy).ctx(write_err, &copy)?;
    let decoded = decoder(compression, &mut buffered)?;
    let mut counted = Hashing::new(decoded, Some(budget));
    io::copy(&mut counted, &mut out).map_err(|e| match e.kind() {
        io::ErrorKind::StorageFull | io::ErrorKind::PermissionDenied => write_err(copy.clone(), e),
        _ => TemplateError::invalid(format!("decompressing archive: {e}")),
    })?;
    Ok(copy)
}
