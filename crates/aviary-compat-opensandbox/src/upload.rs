//! execd's `POST /files/upload`: a multipart body of `metadata` / `file`
//! part pairs, one pair per file. Real execd pairs them by index (the
//! n-th `metadata` part describes the n-th `file` part), which is also how
//! they are read here, streaming: a `metadata` part must come before its
//! `file` part (the SDK sends them in that order), and a file part is
//! written to the sandbox as it arrives, never buffered whole.
//!
//! `metadata` is JSON `{"path": "/abs/path", "mode": 755, "owner": null,
//! "group": null}`. `mode` is an integer whose *decimal digits are the
//! octal mode* (755 means 0o755; the SDK sends 0o644 as 420, i.e. 0o420,
//! and so does execd). `owner`/`group` are chown'd when given.
//!
//! Every part is checked before its file is written (absolute path without
//! `..`, mode digits 0-7 up to 7777, owner/group names); a pair that fails
//! a check ends the upload with a 400. Files of earlier, valid pairs stay
//! written (as with execd, an upload is not a transaction).

use crate::error::OsbError;
use serde::Deserialize;

/// Largest `metadata` part accepted.
pub const MAX_METADATA_BYTES: u64 = 64 * 1024;

/// One file's `metadata` part, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct UploadMeta {
    pub path: String,
    /// Permission bits (0o7777 at most).
    pub mode: Option<u32>,
    pub owner: Option<String>,
    pub group: Option<String>,
}

#[derive(Deserialize)]
struct RawMeta {
    path: Option<String>,
    #[serde(default)]
    mode: Option<serde_json::Value>,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    group: Option<String>,
}

impl UploadMeta {
    /// Parses and checks a `metadata` part's JSON.
    pub fn parse(bytes: &[u8]) -> Result<UploadMeta, OsbError> {
        let raw: RawMeta = serde_json::from_slice(bytes)
            .map_err(|e| OsbError::invalid(format!("metadata part is not valid JSON: {e}")))?;
        let path = raw
            .path
            .ok_or_else(|| OsbError::invalid("metadata part has no path"))?;
        check_path(&path)?;
        let mode = match raw.mode {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Number(n)) => {
                let n = n.as_u64().ok_or_else(|| {
                    OsbError::invalid(format!("mode {n} is not a non-negative integer"))
                })?;
                Some(parse_mode(n)?)
            }
            Some(other) => {
                return Err(OsbError::invalid(format!(
                    "mode must be an integer of octal digits (755), got {other}"
                )))
            }
        };
        for (what, name) in [("owner", &raw.owner), ("group", &raw.group)] {
            if let Some(n) = name {
                check_account(what, n)?;
            }
        }
        Ok(UploadMeta {
            path,
            mode,
            owner: raw.owner,
            group: raw.group,
        })
    }
}

/// The permission bits of an execd mode: the integer's decimal digits read
/// as octal (755 → 0o755), as execd's `ParseUint(Itoa(mode), 8)`.
pub fn parse_mode(mode: u64) -> Result<u32, OsbError> {
    let digits = mode.to_string();
    let bits = u32::from_str_radix(&digits, 8)
        .ok()
        .filter(|b| *b <= 0o7777)
        .ok_or_else(|| {
            OsbError::invalid(format!(
                "mode {mode} is not a permission in octal digits (0-7, at most 7777)"
            ))
        })?;
    Ok(bits)
}

/// The integer an execd client sends for permission bits (0o755 → 755).
pub fn mode_digits(bits: u32) -> u64 {
    format!("{:o}", bits & 0o7777).parse().unwrap_or(0)
}

/// An absolute path inside the sandbox, without `..` or NUL.
pub fn check_path(path: &str) -> Result<(), OsbError> {
    aviary_core::paths::check_client_path(path).map_err(|e| match e {
        aviary_core::paths::ClientPathError::TooLong
        | aviary_core::paths::ClientPathError::ContainsNul => {
            OsbError::invalid(format!("path {e}"))
        }
        _ => OsbError::invalid(format!("path {path:?} {e}")),
    })
}

/// A user or group name (or number) as `chown` takes it.
pub fn check_account(what: &str, name: &str) -> Result<(), OsbError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(OsbError::invalid(format!(
            "{what} {name:?} is not a user or group name"
        )))
    }
}

/// The parent directory of an absolute path (`None` for `/` and top-level
/// names, whose parent always exists).
pub fn parent_dir(path: &str) -> Option<&str> {
    let trimmed = path.trim_end_matches('/');
    let cut = trimmed.rfind('/')?;
    (cut > 0).then(|| &trimmed[..cut])
}

/// Pairs parts by index: what each `file` part is written with.
#[derive(Default)]
pub struct Pairing {
    metas: Vec<UploadMeta>,
    files: usize,
}

impl Pairing {
    pub fn metadata(&mut self, meta: UploadMeta) {
        self.metas.push(meta);
    }

    /// The metadata of the next `file` part.
    pub fn file(&mut self) -> Result<UploadMeta, OsbError> {
        let meta = self.metas.get(self.files).cloned().ok_or_else(|| {
            OsbError::invalid(format!(
                "file part {} has no metadata part before it",
                self.files + 1
            ))
        })?;
        self.files += 1;
        Ok(meta)
    }

    /// At the end of the body: every metadata part had its file, and there
    /// was at least one.
    pub fn finish(&self) -> Result<usize, OsbError> {
        if self.metas.len() != self.files {
            return Err(OsbError::invalid(format!(
                "{} metadata parts but {} file parts",
                self.metas.len(),
                self.files
            )));
        }
        if self.files == 0 {
            return Err(OsbError::invalid(
                "no file in the upload (expected metadata and file parts)",
            ));
        }
        Ok(self.files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_digits_are_octal() {
        assert_eq!(parse_mode(755).unwrap(), 0o755);
        assert_eq!(parse_mode(644).unwrap(), 0o644);
        // what the SDK sends for 0o644, read as execd reads it
        assert_eq!(parse_mode(420).unwrap(), 0o420);
        assert_eq!(parse_mode(0).unwrap(), 0);
        assert_eq!(parse_mode(4755).unwrap(), 0o4755);
        assert_eq!(mode_digits(0o755), 755);
        assert_eq!(mode_digits(0o4755), 4755);
        for bad in [8, 19, 798, 17777, 77777] {
            assert_eq!(parse_mode(bad).unwrap_err().status(), 400, "{bad}");
        }
    }

    #[test]
    fn metadata_parses_and_checks() {
        let m = UploadMeta::parse(
            br#"{"path": "/tmp/a.txt", "owner": null, "group": null, "mode": 755}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            UploadMeta {
                path: "/tmp/a.txt".into(),
                mode: Some(0o755),
                owner: None,
                group: None
            }
        );
        let m = UploadMeta::parse(br#"{"path": "/w/b", "owner": "root", "group": "0"}"#).unwrap();
        assert_eq!((m.mode, m.owner.as_deref()), (None, Some("root")));
        for bad in [
            &br#"{"mode": 755}"#[..],
            br#"{"path": "tmp/a", "mode": 755}"#,
            br#"{"path": "/tmp/../etc/passwd"}"#,
            br#"{"path": "/tmp/a", "mode": "755"}"#,
            br#"{"path": "/tmp/a", "mode": -1}"#,
            br#"{"path": "/tmp/a", "mode": 999}"#,
            br#"{"path": "/tmp/a", "owner": "-rf"}"#,
            br#"{"path": "/tmp/a", "group": "a b"}"#,
            br#"not json"#,
            br#"[]"#,
        ] {
            let e = UploadMeta::parse(bad).unwrap_err();
            assert_eq!(e.status(), 400, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn paths_must_be_absolute_without_dotdot() {
        check_path("/a/b.txt").unwrap();
        check_path("/a/..b/c").unwrap();
        for bad in ["a", "", "../x", "/a/../../x", "/a/..", "/a\0b"] {
            check_path(bad).unwrap_err();
        }
        assert_eq!(parent_dir("/tmp/a.txt"), Some("/tmp"));
        assert_eq!(parent_dir("/w/x/y"), Some("/w/x"));
        assert_eq!(parent_dir("/a.txt"), None);
    }

    #[test]
    fn parts_pair_by_index() {
        let meta = |p: &str| UploadMeta {
            path: p.into(),
            mode: None,
            owner: None,
            group: None,
        };
        let mut p = Pairing::default();
        p.metadata(meta("/a"));
        p.metadata(meta("/b"));
        assert_eq!(p.file().unwrap().path, "/a");
        assert_eq!(p.file().unwrap().path, "/b");
        assert_eq!(p.finish().unwrap(), 2);

        // a file part before any metadata
        assert_eq!(Pairing::default().file().unwrap_err().status(), 400);
        // a metadata part whose file never came
        let mut p = Pairing::default();
        p.metadata(meta("/a"));
        assert_eq!(p.finish().unwrap_err().status(), 400);
        // nothing at all
        assert_eq!(Pairing::default().finish().unwrap_err().status(), 400);
    }
}
