//! The in-memory file tree behind [`crate::FakeEnvd`]'s file calls.
//!
//! Paths are normalised with envd-proto's [`normalize_path`] (so `..` never
//! climbs above `/`) and the tree is a map from normalised components to
//! nodes; `/` always exists. The error codes are the ones the real envd
//! derives from errnos (`crates/aviary-envd/src/files.rs`): a missing entry or
//! parent is `NotFound`, a file where a directory is needed (and the
//! reverse) is `InvalidPath`, `EEXIST` is `AlreadyExists`, `ENOTEMPTY` is
//! `NotEmpty`. No symlinks, owners, special files or disk quota.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::{SystemTime, UNIX_EPOCH};

use aviary_envd_proto::{
    join_components, normalize_path, ErrorBody, ErrorCode, FileKind, FileStat,
};

type Comps = Vec<String>;

#[derive(Debug, Clone)]
enum Node {
    Dir {
        mode: u32,
        modified: i64,
    },
    File {
        data: Vec<u8>,
        mode: u32,
        modified: i64,
    },
}

/// A file system of directories and regular files.
#[derive(Debug)]
pub(crate) struct FileTree {
    nodes: BTreeMap<Comps, Node>,
}

fn err(code: ErrorCode, path: &str, what: &str) -> ErrorBody {
    ErrorBody {
        code,
        message: format!("{path}: {what}"),
    }
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn parse(path: &str) -> Result<Comps, ErrorBody> {
    normalize_path(path).map_err(|e| err(ErrorCode::InvalidPath, path, &e.to_string()))
}

impl FileTree {
    /// A tree with `/` and the given (empty) directories.
    pub(crate) fn with_dirs(dirs: &[&str]) -> FileTree {
        let mut tree = FileTree {
            nodes: BTreeMap::new(),
        };
        tree.nodes.insert(Vec::new(), dir_node());
        for d in dirs {
            // Only fixed, well-formed paths are passed here.
            let _ = tree.mkdir(d, true);
        }
        tree
    }

    /// The parent of `comps` must exist and be a directory.
    fn check_parent(&self, path: &str, comps: &[String]) -> Result<(), ErrorBody> {
        let Some((_, parent)) = comps.split_last() else {
            return Err(err(ErrorCode::InvalidPath, path, "is the sandbox root"));
        };
        // The nearest ancestor decides: a file on the way is ENOTDIR, a gap ENOENT.
        for i in 1..=parent.len() {
            match self.nodes.get(&parent[..i]) {
                Some(Node::Dir { .. }) => {}
                Some(Node::File { .. }) => {
                    return Err(err(ErrorCode::InvalidPath, path, "not a directory"))
                }
                None => return Err(err(ErrorCode::NotFound, path, "no such file or directory")),
            }
        }
        Ok(())
    }

    fn lookup(&self, path: &str, comps: &[String]) -> Result<&Node, ErrorBody> {
        if !comps.is_empty() {
            self.check_parent(path, comps)?;
        }
        self.nodes
            .get(comps)
            .ok_or_else(|| err(ErrorCode::NotFound, path, "no such file or directory"))
    }

    /// The content of a regular file.
    pub(crate) fn read(&self, path: &str) -> Result<Vec<u8>, ErrorBody> {
        let comps = parse(path)?;
        match self.lookup(path, &comps)? {
            Node::File { data, .. } => Ok(data.clone()),
            Node::Dir { .. } => Err(err(ErrorCode::InvalidPath, path, "is a directory")),
        }
    }

    /// Checks that `path` can be written (what envd checks before it reads the
    /// data); returns the mode the file will get.
    pub(crate) fn check_write(&self, path: &str, mode: Option<u32>) -> Result<u32, ErrorBody> {
        let comps = parse(path)?;
        self.check_parent(path, &comps)?;
        let existing = match self.nodes.get(&comps) {
            Some(Node::Dir { .. }) => {
                return Err(err(ErrorCode::InvalidPath, path, "is a directory"))
            }
            Some(Node::File { mode, .. }) => Some(*mode),
            None => None,
        };
        Ok(mode.or(existing).unwrap_or(0o644) & 0o7777)
    }

    /// Creates or replaces a regular file.
    pub(crate) fn write(
        &mut self,
        path: &str,
        mode: Option<u32>,
        data: Vec<u8>,
    ) -> Result<u64, ErrorBody> {
        let mode = self.check_write(path, mode)?;
        let comps = parse(path)?;
        let len = data.len() as u64;
        self.nodes.insert(
            comps,
            Node::File {
                data,
                mode,
                modified: now_unix(),
            },
        );
        Ok(len)
    }

    /// Writes a file, creating missing parent directories (for test set-up).
    pub(crate) fn put(&mut self, path: &str, data: Vec<u8>) -> Result<u64, ErrorBody> {
        let comps = parse(path)?;
        if let Some((_, parent)) = comps.split_last() {
            self.mkdir(&join_components(parent), true)?;
        }
        self.write(path, None, data)
    }

    pub(crate) fn stat(&self, path: &str) -> Result<FileStat, ErrorBody> {
        let comps = parse(path)?;
        let node = self.lookup(path, &comps)?;
        Ok(stat_of(&comps, node))
    }

    /// A directory's entries, sorted by name.
    pub(crate) fn list(&self, path: &str) -> Result<Vec<FileStat>, ErrorBody> {
        let comps = parse(path)?;
        if let Node::File { .. } = self.lookup(path, &comps)? {
            return Err(err(ErrorCode::InvalidPath, path, "not a directory"));
        }
        Ok(self
            .descendants(&comps)
            .filter(|(k, _)| k.len() == comps.len() + 1)
            .map(|(k, n)| stat_of(k, n))
            .collect())
    }

    pub(crate) fn mkdir(&mut self, path: &str, parents: bool) -> Result<(), ErrorBody> {
        let comps = parse(path)?;
        if !parents {
            self.check_parent(path, &comps)?;
            if self.nodes.contains_key(&comps) {
                return Err(err(ErrorCode::AlreadyExists, path, "file exists"));
            }
            self.nodes.insert(comps, dir_node());
            return Ok(());
        }
        for i in 1..=comps.len() {
            match self.nodes.get(&comps[..i]) {
                Some(Node::Dir { .. }) => {}
                Some(Node::File { .. }) => {
                    return Err(err(ErrorCode::InvalidPath, path, "not a directory"))
                }
                None => {
                    self.nodes.insert(comps[..i].to_vec(), dir_node());
                }
            }
        }
        Ok(())
    }

    pub(crate) fn remove(&mut self, path: &str, recursive: bool) -> Result<(), ErrorBody> {
        let comps = parse(path)?;
        self.check_parent(path, &comps)?;
        match self.nodes.get(&comps) {
            None => return Err(err(ErrorCode::NotFound, path, "no such file or directory")),
            Some(Node::Dir { .. }) => {
                let below: Vec<Comps> = self.descendants(&comps).map(|(k, _)| k.clone()).collect();
                if !below.is_empty() && !recursive {
                    return Err(err(ErrorCode::NotEmpty, path, "directory not empty"));
                }
                for k in below {
                    self.nodes.remove(&k);
                }
            }
            Some(Node::File { .. }) => {}
        }
        self.nodes.remove(&comps);
        Ok(())
    }

    /// Every regular file, by absolute path, in path order.
    pub(crate) fn files(&self) -> Vec<(String, Vec<u8>)> {
        self.nodes
            .iter()
            .filter_map(|(k, n)| match n {
                Node::File { data, .. } => Some((join_components(k), data.clone())),
                Node::Dir { .. } => None,
            })
            .collect()
    }

    /// Every entry strictly below `comps` (keys sharing a prefix are
    /// contiguous in the map's lexicographic order).
    fn descendants<'a>(
        &'a self,
        comps: &'a [String],
    ) -> impl Iterator<Item = (&'a Comps, &'a Node)> {
        self.nodes
            .range::<[String], _>((Bound::Excluded(comps), Bound::Unbounded))
            .take_while(move |(k, _)| k.starts_with(comps))
    }
}

fn dir_node() -> Node {
    Node::Dir {
        mode: 0o755,
        modified: now_unix(),
    }
}

fn stat_of(comps: &[String], node: &Node) -> FileStat {
    let name = comps.last().cloned().unwrap_or_else(|| "/".to_owned());
    let (kind, size, mode, modified) = match node {
        Node::Dir { mode, modified } => (FileKind::Dir, 0, *mode, *modified),
        Node::File {
            data,
            mode,
            modified,
        } => (FileKind::File, data.len() as u64, *mode, *modified),
    };
    FileStat {
        name,
        path: join_components(comps),
        kind,
        size,
        mode,
        modified_unix: modified,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code<T: std::fmt::Debug>(r: Result<T, ErrorBody>) -> ErrorCode {
        r.unwrap_err().code
    }

    #[test]
    fn errors_have_the_codes_envd_derives_from_errnos() {
        let mut t = FileTree::with_dirs(&["/workspace"]);
        t.write("/workspace/f", None, b"x".to_vec()).unwrap();
        assert_eq!(code(t.read("/nope")), ErrorCode::NotFound);
        assert_eq!(code(t.read("/nope/f")), ErrorCode::NotFound);
        assert_eq!(code(t.read("/workspace")), ErrorCode::InvalidPath);
        assert_eq!(code(t.read("/workspace/f/g")), ErrorCode::InvalidPath);
        assert_eq!(code(t.read("/../etc")), ErrorCode::InvalidPath);
        assert_eq!(code(t.write("/a/b", None, vec![])), ErrorCode::NotFound);
        assert_eq!(
            code(t.write("/workspace", None, vec![])),
            ErrorCode::InvalidPath
        );
        assert_eq!(code(t.write("/", None, vec![])), ErrorCode::InvalidPath);
        assert_eq!(code(t.mkdir("/workspace", false)), ErrorCode::AlreadyExists);
        assert_eq!(
            code(t.mkdir("/workspace/f", false)),
            ErrorCode::AlreadyExists
        );
        assert_eq!(
            code(t.mkdir("/workspace/f/g", true)),
            ErrorCode::InvalidPath
        );
        assert_eq!(code(t.remove("/workspace", false)), ErrorCode::NotEmpty);
        assert_eq!(code(t.remove("/", true)), ErrorCode::InvalidPath);
        assert_eq!(code(t.list("/workspace/f")), ErrorCode::InvalidPath);
        assert_eq!(code(t.stat("/x")), ErrorCode::NotFound);
    }

    #[test]
    fn mkdir_list_and_recursive_remove() {
        let mut t = FileTree::with_dirs(&[]);
        t.mkdir("/a/b/c", true).unwrap();
        t.mkdir("/a/b/c", true).unwrap();
        t.put("/a/z.txt", b"zz".to_vec()).unwrap();
        t.put("/ab", b"sibling".to_vec()).unwrap();
        let names: Vec<String> = t.list("/a").unwrap().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["b", "z.txt"]);
        let st = t.stat("/a/z.txt").unwrap();
        assert_eq!(
            (st.kind, st.size, st.mode, st.path.as_str()),
            (FileKind::File, 2, 0o644, "/a/z.txt")
        );
        assert_eq!(t.stat("/").unwrap().name, "/");
        t.remove("/a", true).unwrap();
        assert_eq!(code(t.stat("/a/b")), ErrorCode::NotFound);
        assert_eq!(t.read("/ab").unwrap(), b"sibling");
    }

    #[test]
    fn a_replaced_file_keeps_its_mode_unless_given() {
        let mut t = FileTree::with_dirs(&[]);
        t.write("/f", Some(0o100755), vec![]).unwrap();
        assert_eq!(t.stat("/f").unwrap().mode, 0o755);
        t.write("/f", None, b"new".to_vec()).unwrap();
        assert_eq!(t.stat("/f").unwrap().mode, 0o755);
        t.write("/f", Some(0o600), vec![]).unwrap();
        assert_eq!(t.stat("/f").unwrap().mode, 0o600);
    }
}
