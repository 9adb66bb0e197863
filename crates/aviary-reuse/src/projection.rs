//! Workspace projection (seed 000): configured host roots (`AGENTS.md`,
//! `skills/`, `knowledge/`, …) synced one-way into a sandbox on every start.
//!
//! [`ProjectionPlanner::plan`] walks the roots, hashes every file (SHA-256) and
//! compares with the [`RemoteIndex`] of the last sync: unchanged files are
//! skipped, new and changed files uploaded, files that disappeared from the
//! host (or whose root was dropped from the configuration) deleted in the
//! sandbox. [`apply`] carries a plan out over a [`ProjectionTarget`] (the server
//! implements it over envd; [`LocalDirTarget`] is a local directory). The caller
//! stores [`ProjectionPlan::next_index`] once `apply` succeeded; after a failed
//! apply the remote state is unknown and the caller should sync from an empty
//! index.
//!
//! Invariants:
//! - No file is read that resolves outside its root: a root that is itself a
//!   symlink, or an entry whose symlink leads outside the root (e.g. to
//!   `/etc`), fails the whole plan, so nothing is applied from it. Symlinks
//!   that stay inside the root are projected as copies of their target.
//! - Sandbox paths are absolute, normalized and free of `..`.
//! - Between plan and apply a file is re-opened without following symlinks,
//!   re-checked to be inside its root and re-hashed; a changed file fails the
//!   apply instead of projecting content that was never planned.
//! - Only regular files are projected (with mode 0644, or 0755 when any execute
//!   bit is set); directories are created as needed, empty host directories are
//!   not mirrored, and directories emptied by deletions are left in place.
//!
//! Concurrency: planning is synchronous file-system work (call it from a
//! blocking thread in async code); [`apply`] is async and reads files through
//! tokio.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use tokio::io::AsyncReadExt;

/// Errors of a [`ProjectionTarget`], boxed so every backend can bring its own.
pub type TargetError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    #[error("sandbox path {path:?} of root {root} must be absolute, without `.`, `..` or empty components")]
    InvalidSandboxPath { root: PathBuf, path: String },
    #[error("projection root {root} is a symlink")]
    SymlinkedRoot { root: PathBuf },
    #[error("{entry} in projection root {root} is a symlink leading outside the root")]
    EscapeRoot { root: PathBuf, entry: PathBuf },
    #[error("read projection root {root} at {entry}")]
    ReadRoot {
        root: PathBuf,
        entry: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{entry} is not valid UTF-8")]
    NonUtf8Path { entry: PathBuf },
    #[error("{entry} is {size} bytes, over the {limit} byte limit")]
    FileTooLarge {
        entry: PathBuf,
        size: u64,
        limit: u64,
    },
    #[error("{entry} is neither a regular file nor a directory")]
    UnsupportedFileType { entry: PathBuf },
    #[error("more than {limit} files in the projection roots")]
    TooManyFiles { limit: usize },
    #[error("two projected files collide at {path}")]
    OverlappingTargets { path: String },
    #[error("read {entry}")]
    ReadFile {
        entry: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{entry} changed since the plan was made")]
    FileChangedSincePlan { entry: PathBuf },
    #[error("write {path} in the sandbox")]
    WriteFile {
        path: String,
        #[source]
        source: TargetError,
    },
    #[error("remove {path} in the sandbox")]
    RemovePath {
        path: String,
        #[source]
        source: TargetError,
    },
    #[error("create directory {path} in the sandbox")]
    CreateDir {
        path: String,
        #[source]
        source: TargetError,
    },
}

/// One configured root: a host file or directory and where it lands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectionRoot {
    pub host_path: PathBuf,
    /// Absolute path in the sandbox (`/workspace/skills`).
    pub sandbox_path: String,
}

impl ProjectionRoot {
    pub fn new(host_path: impl Into<PathBuf>, sandbox_path: impl Into<String>) -> Self {
        ProjectionRoot {
            host_path: host_path.into(),
            sandbox_path: sandbox_path.into(),
        }
    }
}

/// Sandbox path → SHA-256 (hex) of what the last sync put there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RemoteIndex {
    pub files: BTreeMap<String, String>,
}

impl RemoteIndex {
    /// An index from `sha256sum` output run inside the sandbox (`HASH  PATH`
    /// lines), for a sync against what is really there rather than against the
    /// last recorded sync. Malformed lines are skipped.
    pub fn from_sha256sum_output(text: &str) -> RemoteIndex {
        let mut files = BTreeMap::new();
        for line in text.lines() {
            let Some((hash, rest)) = line.split_once(' ') else {
                continue;
            };
            // Text mode prints two spaces, binary mode " *".
            let path = rest
                .strip_prefix(' ')
                .or_else(|| rest.strip_prefix('*'))
                .unwrap_or(rest);
            if hash.len() == 64
                && hash.bytes().all(|b| b.is_ascii_hexdigit())
                && path.starts_with('/')
            {
                files.insert(path.to_owned(), hash.to_ascii_lowercase());
            }
        }
        RemoteIndex { files }
    }
}

/// One file to upload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upload {
    /// The file to read: resolved, inside `host_root`, not a symlink.
    pub host_path: PathBuf,
    /// Canonical root the file must still be inside at apply time.
    pub host_root: PathBuf,
    pub sandbox_path: String,
    pub sha256: String,
    pub size: u64,
    pub mode: u32,
}

/// What a sync will do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectionPlan {
    pub uploads: Vec<Upload>,
    /// Sandbox paths to remove (files, or directories a file replaces).
    pub deletes: Vec<String>,
    /// Unchanged files (sandbox paths).
    pub skipped: Vec<String>,
    /// Directories to create (parents of uploads), shallowest first.
    pub mkdirs: Vec<String>,
    /// The remote index once the plan is applied.
    pub next_index: RemoteIndex,
}

/// What [`apply`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyReport {
    pub uploaded: usize,
    pub deleted: usize,
    pub skipped: usize,
    pub bytes_uploaded: u64,
}

/// Plans projections. The limits bound the work one misconfigured root can cause.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectionPlanner {
    pub max_file_bytes: u64,
    pub max_files: usize,
}

impl Default for ProjectionPlanner {
    fn default() -> Self {
        ProjectionPlanner {
            max_file_bytes: 64 << 20,
            max_files: 100_000,
        }
    }
}

use aviary_core::paths::clean_absolute as normalize_sandbox_path;

fn mode_of(meta: &std::fs::Metadata) -> u32 {
    if meta.permissions().mode() & 0o111 != 0 {
        0o755
    } else {
        0o644
    }
}

struct Walk<'a> {
    planner: &'a ProjectionPlanner,
    /// sandbox path → upload candidate
    files: BTreeMap<String, Upload>,
}

impl Walk<'_> {
    fn read_err(root: &Path, entry: &Path) -> impl FnOnce(std::io::Error) -> ProjectionError {
        let (root, entry) = (root.to_owned(), entry.to_owned());
        move |source| ProjectionError::ReadRoot {
            root,
            entry,
            source,
        }
    }

    fn add_file(
        &mut self,
        root: &ProjectionRoot,
        canon_root: &Path,
        file: &Path,
        sandbox_path: String,
    ) -> Result<(), ProjectionError> {
        let meta = std::fs::metadata(file).map_err(Self::read_err(&root.host_path, file))?;
        if meta.len() > self.planner.max_file_bytes {
            return Err(ProjectionError::FileTooLarge {
                entry: file.to_owned(),
                size: meta.len(),
                limit: self.planner.max_file_bytes,
            });
        }
        if self.files.len() >= self.planner.max_files {
            return Err(ProjectionError::TooManyFiles {
                limit: self.planner.max_files,
            });
        }
        let (sha256, size) = hash_file(file, self.planner.max_file_bytes).map_err(|source| {
            ProjectionError::ReadFile {
                entry: file.to_owned(),
                source,
            }
        })?;
        let upload = Upload {
            host_path: file.to_owned(),
            host_root: canon_root.to_owned(),
            sandbox_path: sandbox_path.clone(),
            sha256,
            size,
            mode: mode_of(&meta),
        };
        if self.files.insert(sandbox_path.clone(), upload).is_some() {
            return Err(ProjectionError::OverlappingTargets { path: sandbox_path });
        }
        Ok(())
    }

    fn walk_root(&mut self, root: &ProjectionRoot) -> Result<(), ProjectionError> {
        let sandbox_root = normalize_sandbox_path(&root.sandbox_path).ok_or_else(|| {
            ProjectionError::InvalidSandboxPath {
                root: root.host_path.clone(),
                path: root.sandbox_path.clone(),
            }
        })?;
        let meta = std::fs::symlink_metadata(&root.host_path)
            .map_err(Self::read_err(&root.host_path, &root.host_path))?;
        if meta.file_type().is_symlink() {
            return Err(ProjectionError::SymlinkedRoot {
                root: root.host_path.clone(),
            });
        }
        let canon_root = std::fs::canonicalize(&root.host_path)
            .map_err(Self::read_err(&root.host_path, &root.host_path))?;
        if meta.is_file() {
            return self.add_file(root, &canon_root, &canon_root, sandbox_root);
        }
        if !meta.is_dir() {
            return Err(ProjectionError::UnsupportedFileType {
                entry: root.host_path.clone(),
            });
        }
        // (directory on the host, its sandbox path); visited holds canonical
        // directories so that symlinks inside the root cannot loop.
        let mut stack = vec![(canon_root.clone(), sandbox_root)];
        let mut visited = HashSet::new();
        visited.insert(canon_root.clone());
        while let Some((dir, sandbox_dir)) = stack.pop() {
            let mut entries: Vec<_> = std::fs::read_dir(&dir)
                .map_err(Self::read_err(&root.host_path, &dir))?
                .collect::<Result<_, _>>()
                .map_err(Self::read_err(&root.host_path, &dir))?;
            entries.sort_by_key(|e| e.file_name());
            for entry in entries {
                let path = entry.path();
                let name = entry.file_name();
                let name = name.to_str().ok_or_else(|| ProjectionError::NonUtf8Path {
                    entry: path.clone(),
                })?;
                let sandbox_path = format!("{sandbox_dir}/{name}");
                let ft = entry
                    .file_type()
                    .map_err(Self::read_err(&root.host_path, &path))?;
                let (real, is_dir) = if ft.is_symlink() {
                    let target = std::fs::canonicalize(&path)
                        .map_err(Self::read_err(&root.host_path, &path))?;
                    if !target.starts_with(&canon_root) {
                        return Err(ProjectionError::EscapeRoot {
                            root: root.host_path.clone(),
                            entry: path,
                        });
                    }
                    let tmeta = std::fs::metadata(&target)
                        .map_err(Self::read_err(&root.host_path, &path))?;
                    if !tmeta.is_file() && !tmeta.is_dir() {
                        return Err(ProjectionError::UnsupportedFileType { entry: path });
                    }
                    (target, tmeta.is_dir())
                } else if ft.is_dir() {
                    (path, true)
                } else if ft.is_file() {
                    (path, false)
                } else {
                    return Err(ProjectionError::UnsupportedFileType { entry: path });
                };
                if is_dir {
                    if visited.insert(real.clone()) {
                        stack.push((real, sandbox_path));
                    }
                } else {
                    self.add_file(root, &canon_root, &real, sandbox_path)?;
                }
            }
        }
        Ok(())
    }
}

/// SHA-256 (hex) and size of a file, reading at most `limit + 1` bytes.
fn hash_file(path: &Path, limit: u64) -> std::io::Result<(String, u64)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let mut reader = f.take(limit + 1);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut size = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((hex::encode(h.finalize()), size))
}

fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/')
        .filter(|(i, _)| *i > 0)
        .map(move |(i, _)| &path[..i])
}

impl ProjectionPlanner {
    /// Plans the sync of `host_roots` into a sandbox whose last sync left
    /// `remote_state`. Fails as a whole on any bad root, so nothing is applied
    /// from a root that tries to escape.
    pub fn plan(
        &self,
        host_roots: &[ProjectionRoot],
        remote_state: &RemoteIndex,
    ) -> Result<ProjectionPlan, ProjectionError> {
        let mut walk = Walk {
            planner: self,
            files: BTreeMap::new(),
        };
        for root in host_roots {
            walk.walk_root(root)?;
        }
        // A file may not sit where another projected file needs a directory.
        for path in walk.files.keys() {
            if let Some(a) = ancestors(path).find(|a| walk.files.contains_key(*a)) {
                return Err(ProjectionError::OverlappingTargets { path: a.to_owned() });
            }
        }

        let mut plan = ProjectionPlan::default();
        let mut deletes: BTreeSet<String> = remote_state
            .files
            .keys()
            .filter(|p| !walk.files.contains_key(*p))
            .cloned()
            .collect();
        // A file replacing a directory of the last sync: remove the directory.
        for path in walk.files.keys() {
            let prefix = format!("{path}/");
            if remote_state
                .files
                .range(prefix.clone()..)
                .next()
                .is_some_and(|(k, _)| k.starts_with(&prefix))
            {
                deletes.insert(path.clone());
            }
        }
        // Drop deletes already covered by a deleted ancestor directory.
        let covered: Vec<String> = deletes
            .iter()
            .filter(|d| ancestors(d).any(|a| deletes.contains(a)))
            .cloned()
            .collect();
        for c in covered {
            deletes.remove(&c);
        }
        plan.deletes = deletes.into_iter().collect();

        let mut mkdirs = BTreeSet::new();
        for (path, upload) in walk.files {
            plan.next_index
                .files
                .insert(path.clone(), upload.sha256.clone());
            if remote_state.files.get(&path) == Some(&upload.sha256) {
                plan.skipped.push(path);
            } else {
                if let Some((parent, _)) = path.rsplit_once('/') {
                    if !parent.is_empty() {
                        mkdirs.insert(parent.to_owned());
                    }
                }
                plan.uploads.push(upload);
            }
        }
        let mut mkdirs: Vec<String> = mkdirs.into_iter().collect();
        mkdirs.sort_by_key(|d| (d.matches('/').count(), d.clone()));
        plan.mkdirs = mkdirs;
        Ok(plan)
    }
}

/// Where projected files go. Paths are absolute sandbox paths, already
/// validated by the planner.
#[async_trait]
pub trait ProjectionTarget: Send {
    /// Creates or replaces a regular file with exactly `content`.
    async fn write_file(
        &mut self,
        path: &str,
        content: &[u8],
        mode: u32,
    ) -> Result<(), TargetError>;
    /// Removes a file or a whole directory tree; a missing path is not an error.
    async fn remove(&mut self, path: &str) -> Result<(), TargetError>;
    /// Creates a directory and its missing parents.
    async fn mkdir(&mut self, path: &str) -> Result<(), TargetError>;
}

async fn read_verified(u: &Upload, limit: u64) -> Result<Vec<u8>, ProjectionError> {
    let read_err = |source| ProjectionError::ReadFile {
        entry: u.host_path.clone(),
        source,
    };
    // The planned path must still resolve inside its root…
    let canon = tokio::fs::canonicalize(&u.host_path)
        .await
        .map_err(read_err)?;
    if canon != u.host_path || !canon.starts_with(&u.host_root) {
        return Err(ProjectionError::FileChangedSincePlan {
            entry: u.host_path.clone(),
        });
    }
    // …be opened without following a symlink swapped in since…
    let f = tokio::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&u.host_path)
        .await
        .map_err(read_err)?;
    let mut bytes = Vec::with_capacity(usize::try_from(u.size).unwrap_or(0));
    f.take(limit + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(read_err)?;
    // …and hash to what was planned.
    if hex::encode(Sha256::digest(&bytes)) != u.sha256 {
        return Err(ProjectionError::FileChangedSincePlan {
            entry: u.host_path.clone(),
        });
    }
    Ok(bytes)
}

/// Applies `plan` to `target`: deletes, then directories, then uploads (each
/// file re-verified against the plan first). Stops at the first error.
pub async fn apply(
    plan: &ProjectionPlan,
    target: &mut dyn ProjectionTarget,
) -> Result<ApplyReport, ProjectionError> {
    let mut report = ApplyReport {
        skipped: plan.skipped.len(),
        ..ApplyReport::default()
    };
    for path in &plan.deletes {
        target
            .remove(path)
            .await
            .map_err(|source| ProjectionError::RemovePath {
                path: path.clone(),
                source,
            })?;
        report.deleted += 1;
    }
    for dir in &plan.mkdirs {
        target
            .mkdir(dir)
            .await
            .map_err(|source| ProjectionError::CreateDir {
                path: dir.clone(),
                source,
            })?;
    }
    for u in &plan.uploads {
        let bytes = read_verified(u, u.size).await?;
        target
            .write_file(&u.sandbox_path, &bytes, u.mode)
            .await
            .map_err(|source| ProjectionError::WriteFile {
                path: u.sandbox_path.clone(),
                source,
            })?;
        report.uploaded += 1;
        report.bytes_uploaded += bytes.len() as u64;
    }
    Ok(report)
}

/// A [`ProjectionTarget`] over a local directory standing in for the sandbox's
/// `/`: sandbox path `/a/b` is `<root>/a/b`. It never follows a symlink below
/// the root, so a sandbox that planted `skills -> /etc` in its own tree cannot
/// redirect writes onto the host. Uses blocking `std::fs` calls: meant for
/// tests and local tools, not for async hot paths.
#[derive(Clone, Debug)]
pub struct LocalDirTarget {
    pub root: PathBuf,
}

impl LocalDirTarget {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalDirTarget { root: root.into() }
    }

    /// The host path of a sandbox path; every existing component below the
    /// root (the last one included) must not be a symlink.
    fn resolve(&self, path: &str) -> Result<PathBuf, TargetError> {
        let norm =
            normalize_sandbox_path(path).ok_or_else(|| format!("invalid sandbox path {path:?}"))?;
        let mut host = self.root.clone();
        for comp in Path::new(&norm).components() {
            match comp {
                Component::RootDir => continue,
                Component::Normal(c) => host.push(c),
                _ => return Err(format!("invalid sandbox path {path:?}").into()),
            }
            match std::fs::symlink_metadata(&host) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(format!("refusing to follow symlink at {}", host.display()).into());
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(host)
    }
}

#[async_trait]
impl ProjectionTarget for LocalDirTarget {
    async fn write_file(
        &mut self,
        path: &str,
        content: &[u8],
        mode: u32,
    ) -> Result<(), TargetError> {
        let host = self.resolve(path)?;
        if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_dir()) {
            std::fs::remove_dir_all(&host)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(mode)
            .open(&host)?;
        std::io::Write::write_all(&mut f, content)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        Ok(())
    }

    async fn remove(&mut self, path: &str) -> Result<(), TargetError> {
        let host = self.resolve(path)?;
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&host)?,
            Ok(_) => std::fs::remove_file(&host)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    async fn mkdir(&mut self, path: &str) -> Result<(), TargetError> {
        let norm =
            normalize_sandbox_path(path).ok_or_else(|| format!("invalid sandbox path {path:?}"))?;
        // Component by component, so no symlink is ever followed.
        let mut partial = String::new();
        for comp in norm.split('/').skip(1) {
            partial.push('/');
            partial.push_str(comp);
            let host = self.resolve(&partial)?;
            match std::fs::symlink_metadata(&host) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    // A file where a directory must be (a projected file became a directory).
                    std::fs::remove_file(&host)?;
                    std::fs::create_dir(&host)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&host)?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn write(path: &Path, content: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    /// Host workspace with AGENTS.md, skills/ (nested) and knowledge/.
    fn host() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let h = dir.path();
        write(&h.join("AGENTS.md"), "# agent\n");
        write(&h.join("skills/excel/SKILL.md"), "read excel\n");
        write(&h.join("skills/excel/scripts/run.py"), "print(1)\n");
        fs::set_permissions(
            h.join("skills/excel/scripts/run.py"),
            fs::Permissions::from_mode(0o750),
        )
        .unwrap();
        write(&h.join("skills/web/SKILL.md"), "browse\n");
        write(&h.join("knowledge/a/b/c/deep.txt"), "deep\n");
        dir
    }

    fn roots(h: &Path) -> Vec<ProjectionRoot> {
        vec![
            ProjectionRoot::new(h.join("AGENTS.md"), "/workspace/AGENTS.md"),
            ProjectionRoot::new(h.join("skills"), "/workspace/skills"),
            ProjectionRoot::new(h.join("knowledge"), "/workspace/knowledge/"),
        ]
    }

    fn sandbox_files(root: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_owned()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else {
                    let rel = format!("/{}", e.path().strip_prefix(root).unwrap().display());
                    out.insert(rel, fs::read_to_string(e.path()).unwrap());
                }
            }
        }
        out
    }

    async fn sync(h: &Path, sandbox: &Path, index: &RemoteIndex) -> (ProjectionPlan, ApplyReport) {
        let plan = ProjectionPlanner::default().plan(&roots(h), index).unwrap();
        let report = apply(&plan, &mut LocalDirTarget::new(sandbox))
            .await
            .unwrap();
        (plan, report)
    }

    #[tokio::test]
    async fn first_sync_uploads_everything_nested() {
        let h = host();
        let sb = tempfile::tempdir().unwrap();
        let (plan, report) = sync(h.path(), sb.path(), &RemoteIndex::default()).await;
        assert_eq!(report.uploaded, 5);
        assert_eq!(report.skipped, 0);
        assert_eq!(report.deleted, 0);
        let files = sandbox_files(sb.path());
        assert_eq!(files["/workspace/AGENTS.md"], "# agent\n");
        assert_eq!(files["/workspace/knowledge/a/b/c/deep.txt"], "deep\n");
        assert_eq!(
            files["/workspace/skills/excel/scripts/run.py"],
            "print(1)\n"
        );
        assert_eq!(files.len(), 5);
        let mode = fs::metadata(sb.path().join("workspace/skills/excel/scripts/run.py"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
        let mode = fs::metadata(sb.path().join("workspace/AGENTS.md"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o644);
        assert_eq!(
            plan.next_index.files["/workspace/AGENTS.md"],
            hex::encode(Sha256::digest(b"# agent\n"))
        );
    }

    #[tokio::test]
    async fn unchanged_files_are_skipped_and_deletions_propagate() {
        let h = host();
        let sb = tempfile::tempdir().unwrap();
        let (plan, _) = sync(h.path(), sb.path(), &RemoteIndex::default()).await;

        // Nothing changed: everything skipped.
        let (plan2, report) = sync(h.path(), sb.path(), &plan.next_index).await;
        assert_eq!((report.uploaded, report.skipped, report.deleted), (0, 5, 0));
        assert_eq!(plan2.next_index, plan.next_index);

        // One edit, one deletion, one new nested file.
        write(&h.path().join("skills/web/SKILL.md"), "browse v2\n");
        fs::remove_file(h.path().join("skills/excel/scripts/run.py")).unwrap();
        write(&h.path().join("skills/pdf/x/y/SKILL.md"), "pdf\n");
        let (plan3, report) = sync(h.path(), sb.path(), &plan2.next_index).await;
        assert_eq!((report.uploaded, report.skipped, report.deleted), (2, 3, 1));
        assert_eq!(plan3.deletes, ["/workspace/skills/excel/scripts/run.py"]);
        let files = sandbox_files(sb.path());
        assert_eq!(files["/workspace/skills/web/SKILL.md"], "browse v2\n");
        assert_eq!(files["/workspace/skills/pdf/x/y/SKILL.md"], "pdf\n");
        assert!(!files.contains_key("/workspace/skills/excel/scripts/run.py"));
        assert_eq!(files.len(), 5);

        // A root dropped from the configuration is removed from the sandbox.
        let plan4 = ProjectionPlanner::default()
            .plan(&roots(h.path())[..2], &plan3.next_index)
            .unwrap();
        assert_eq!(plan4.deletes, ["/workspace/knowledge/a/b/c/deep.txt"]);
        apply(&plan4, &mut LocalDirTarget::new(sb.path()))
            .await
            .unwrap();
        assert!(!sandbox_files(sb.path()).contains_key("/workspace/knowledge/a/b/c/deep.txt"));
    }

    #[tokio::test]
    async fn a_file_replacing_a_directory_and_back() {
        let h = host();
        let sb = tempfile::tempdir().unwrap();
        let (plan, _) = sync(h.path(), sb.path(), &RemoteIndex::default()).await;
        fs::remove_dir_all(h.path().join("skills/web")).unwrap();
        write(&h.path().join("skills/web"), "now a file\n");
        let (plan2, _) = sync(h.path(), sb.path(), &plan.next_index).await;
        assert_eq!(plan2.deletes, ["/workspace/skills/web"]);
        assert_eq!(
            sandbox_files(sb.path())["/workspace/skills/web"],
            "now a file\n"
        );
        fs::remove_file(h.path().join("skills/web")).unwrap();
        write(&h.path().join("skills/web/SKILL.md"), "dir again\n");
        sync(h.path(), sb.path(), &plan2.next_index).await;
        assert_eq!(
            sandbox_files(sb.path())["/workspace/skills/web/SKILL.md"],
            "dir again\n"
        );
    }

    #[test]
    fn symlink_to_etc_rejects_the_root() {
        let h = host();
        symlink("/etc", h.path().join("skills/etc")).unwrap();
        let err = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::EscapeRoot { ref entry, .. } if entry.ends_with("skills/etc")),
            "{err}"
        );

        let h = host();
        symlink("/etc/passwd", h.path().join("knowledge/passwd")).unwrap();
        let err = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap_err();
        assert!(matches!(err, ProjectionError::EscapeRoot { .. }), "{err}");

        // A sibling root is outside this root too.
        let h = host();
        symlink(h.path().join("AGENTS.md"), h.path().join("skills/agents")).unwrap();
        let err = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap_err();
        assert!(matches!(err, ProjectionError::EscapeRoot { .. }), "{err}");
    }

    #[test]
    fn a_root_that_is_a_symlink_is_rejected() {
        let h = host();
        symlink("/etc", h.path().join("etc-root")).unwrap();
        let r = [ProjectionRoot::new(
            h.path().join("etc-root"),
            "/workspace/etc",
        )];
        let err = ProjectionPlanner::default()
            .plan(&r, &RemoteIndex::default())
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::SymlinkedRoot { .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn symlinks_inside_the_root_are_copied_and_loops_end() {
        let h = host();
        symlink("excel/SKILL.md", h.path().join("skills/alias.md")).unwrap();
        symlink(".", h.path().join("skills/self")).unwrap();
        let sb = tempfile::tempdir().unwrap();
        let (plan, _) = sync(h.path(), sb.path(), &RemoteIndex::default()).await;
        let files = sandbox_files(sb.path());
        assert_eq!(files["/workspace/skills/alias.md"], "read excel\n");
        assert!(plan
            .uploads
            .iter()
            .all(|u| !u.sandbox_path.contains("/self/")));
    }

    #[test]
    fn dot_dot_in_sandbox_paths_is_an_error() {
        let h = host();
        for bad in [
            "/workspace/../etc",
            "workspace/x",
            "/workspace/./x",
            "/",
            "//x",
            "/a\0b",
        ] {
            let r = [ProjectionRoot::new(h.path().join("skills"), bad)];
            let err = ProjectionPlanner::default()
                .plan(&r, &RemoteIndex::default())
                .unwrap_err();
            assert!(
                matches!(err, ProjectionError::InvalidSandboxPath { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn overlapping_roots_are_an_error() {
        let h = host();
        let r = [
            ProjectionRoot::new(
                h.path().join("AGENTS.md"),
                "/workspace/skills/excel/SKILL.md",
            ),
            ProjectionRoot::new(h.path().join("skills"), "/workspace/skills"),
        ];
        let err = ProjectionPlanner::default()
            .plan(&r, &RemoteIndex::default())
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::OverlappingTargets { .. }),
            "{err}"
        );
        let r = [
            ProjectionRoot::new(h.path().join("AGENTS.md"), "/workspace/skills"),
            ProjectionRoot::new(h.path().join("skills"), "/workspace/skills"),
        ];
        let err = ProjectionPlanner::default()
            .plan(&r, &RemoteIndex::default())
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::OverlappingTargets { .. }),
            "{err}"
        );
    }

    #[test]
    fn limits_and_missing_roots_are_errors() {
        let h = host();
        let small = ProjectionPlanner {
            max_file_bytes: 4,
            max_files: 100,
        };
        let err = small
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap_err();
        assert!(matches!(err, ProjectionError::FileTooLarge { .. }), "{err}");
        let few = ProjectionPlanner {
            max_file_bytes: 1 << 20,
            max_files: 2,
        };
        let err = few
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::TooManyFiles { limit: 2 }),
            "{err}"
        );
        let r = [ProjectionRoot::new(
            h.path().join("nope"),
            "/workspace/nope",
        )];
        let err = ProjectionPlanner::default()
            .plan(&r, &RemoteIndex::default())
            .unwrap_err();
        assert!(matches!(err, ProjectionError::ReadRoot { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_file_changed_after_planning_is_not_projected() {
        let h = host();
        let sb = tempfile::tempdir().unwrap();
        let plan = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap();
        write(&h.path().join("AGENTS.md"), "# swapped\n");
        let err = apply(&plan, &mut LocalDirTarget::new(sb.path()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::FileChangedSincePlan { .. }),
            "{err}"
        );
        assert!(!sandbox_files(sb.path())
            .values()
            .any(|v| v.contains("swapped")));

        // Swapped for a symlink to /etc/passwd after planning.
        let plan = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap();
        fs::remove_file(h.path().join("knowledge/a/b/c/deep.txt")).unwrap();
        symlink("/etc/passwd", h.path().join("knowledge/a/b/c/deep.txt")).unwrap();
        let err = apply(&plan, &mut LocalDirTarget::new(sb.path()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProjectionError::FileChangedSincePlan { .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn local_target_refuses_symlinks_planted_in_the_sandbox() {
        let h = host();
        let sb = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::create_dir_all(sb.path().join("workspace")).unwrap();
        symlink(outside.path(), sb.path().join("workspace/skills")).unwrap();
        let plan = ProjectionPlanner::default()
            .plan(&roots(h.path()), &RemoteIndex::default())
            .unwrap();
        let err = apply(&plan, &mut LocalDirTarget::new(sb.path()))
            .await
            .unwrap_err();
        assert!(matches!(err, ProjectionError::CreateDir { .. }), "{err}");
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
    }

    #[test]
    fn remote_index_from_sha256sum() {
        let a = hex::encode(Sha256::digest(b"a"));
        let text =
            format!("{a}  /workspace/AGENTS.md\n{a} */workspace/bin\nbad line\n{a}  relative\n");
        let idx = RemoteIndex::from_sha256sum_output(&text);
        assert_eq!(idx.files.len(), 2);
        assert_eq!(idx.files["/workspace/AGENTS.md"], a);
        // And a real `sha256sum` run agrees with the planner's hashes.
        let h = host();
        let out = std::process::Command::new("sha256sum")
            .arg(h.path().join("AGENTS.md"))
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let real = RemoteIndex::from_sha256sum_output(&text);
        let plan = ProjectionPlanner::default()
            .plan(&roots(h.path())[..1], &RemoteIndex::default())
            .unwrap();
        assert_eq!(real.files.values().next(), Some(&plan.uploads[0].sha256));
    }

    proptest! {
        #[test]
        fn normalized_sandbox_paths_never_climb(s in "[/a.]{0,12}") {
            if let Some(n) = normalize_sandbox_path(&s) {
                prop_assert!(n.starts_with('/'));
                prop_assert!(!n.split('/').any(|c| c == ".." || c == "."));
                prop_assert!(!n.ends_with('/'));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn sync_converges_to_the_host_tree(
            first in prop::collection::btree_map("[a-c]{1,2}(/[a-c]{1,2}){0,2}", "[x-z]{0,3}", 0..8),
            second in prop::collection::btree_map("[a-c]{1,2}(/[a-c]{1,2}){0,2}", "[x-z]{0,3}", 0..8),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let sb = tempfile::tempdir().unwrap();
            let mut index = RemoteIndex::default();
            for tree in [first, second] {
                // Drop paths that are a prefix directory of another path.
                let tree: BTreeMap<String, String> = tree
                    .iter()
                    .filter(|(p, _)| !tree.keys().any(|q| q.starts_with(&format!("{p}/"))))
                    .map(|(p, c)| (p.clone(), c.clone()))
                    .collect();
                let h = tempfile::tempdir().unwrap();
                fs::create_dir(h.path().join("root")).unwrap();
                for (p, c) in &tree {
                    write(&h.path().join("root").join(p), c);
                }
                let roots = [ProjectionRoot::new(h.path().join("root"), "/w")];
                let plan = ProjectionPlanner::default().plan(&roots, &index).unwrap();
                rt.block_on(apply(&plan, &mut LocalDirTarget::new(sb.path()))).unwrap();
                index = plan.next_index;
                let got = if sb.path().join("w").exists() { sandbox_files(sb.path()) } else { BTreeMap::new() };
                let want: BTreeMap<String, String> = tree.iter().map(|(p, c)| (format!("/w/{p}"), c.clone())).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}
