//! Sandbox path checks shared by every crate that takes a path from a
//! client, a config file or a stored record before it reaches envd.
//!
//! These are lexical checks on strings: nothing here touches a file system.
//! envd confines every path again inside the sandbox (its own
//! `aviary_envd_proto::normalize_path`, kept separate because envd is a
//! static binary that does not link this crate); these functions give the
//! early, clear refusal.

/// Longest accepted sandbox path, in bytes (the same bound envd applies).
pub const MAX_SANDBOX_PATH: usize = 4096;

/// `path` in canonical form, if it is a *clean* absolute sandbox path:
/// starts with `/`, has only normal components (no empty, `.` or `..`
/// component, no NUL), is at most [`MAX_SANDBOX_PATH`] bytes and is not `/`
/// itself. One trailing `/` is accepted and dropped.
///
/// ```
/// use aviary_core::paths::clean_absolute;
/// assert_eq!(clean_absolute("/workspace/src/").as_deref(), Some("/workspace/src"));
/// assert_eq!(clean_absolute("/a/../etc"), None);
/// assert_eq!(clean_absolute("/"), None);
/// ```
pub fn clean_absolute(path: &str) -> Option<String> {
    let trimmed = path.strip_suffix('/').unwrap_or(path);
    let rest = trimmed.strip_prefix('/')?;
    if rest.is_empty() || path.len() > MAX_SANDBOX_PATH || !is_clean_relative(rest) {
        return None;
    }
    Some(trimmed.to_owned())
}

/// Whether `path` is a clean relative path: not empty, no leading `/`, every
/// component normal (no empty, `.` or `..` component) and no NUL.
pub fn is_clean_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\0')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Why [`check_client_path`] refused a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientPathError {
    NotAbsolute,
    TooLong,
    ContainsNul,
    ParentComponent,
}

impl std::fmt::Display for ClientPathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ClientPathError::NotAbsolute => "must be absolute",
            ClientPathError::TooLong => "is longer than 4096 bytes",
            ClientPathError::ContainsNul => "contains a NUL byte",
            ClientPathError::ParentComponent => "must not contain '..'",
        })
    }
}

/// The check an API route applies to a path a client names inside a
/// sandbox (files, cwd, upload targets): absolute, bounded, no NUL and no
/// `..` component. Empty and `.` components are allowed here (envd
/// normalises them away); `..` is refused outright so no path ever relies on
/// envd's confinement to stay inside the sandbox.
pub fn check_client_path(path: &str) -> Result<(), ClientPathError> {
    if !path.starts_with('/') {
        return Err(ClientPathError::NotAbsolute);
    }
    if path.len() > MAX_SANDBOX_PATH {
        return Err(ClientPathError::TooLong);
    }
    if path.contains('\0') {
        return Err(ClientPathError::ContainsNul);
    }
    if path.split('/').any(|c| c == "..") {
        return Err(ClientPathError::ParentComponent);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn clean_absolute_accepts_only_normal_components() {
        assert_eq!(clean_absolute("/a").as_deref(), Some("/a"));
        assert_eq!(clean_absolute("/a/b/").as_deref(), Some("/a/b"));
        for bad in [
            "", "/", "a", "a/b", "//", "/a//b", "/a/./b", "/a/..", "/..", "/a\0b", "/a//",
        ] {
            assert_eq!(clean_absolute(bad), None, "{bad:?}");
        }
        assert_eq!(
            clean_absolute(&format!("/{}", "a".repeat(MAX_SANDBOX_PATH))),
            None
        );
    }

    #[test]
    fn clean_relative() {
        assert!(is_clean_relative("a/b.txt"));
        for bad in ["", "/a", "a/", "a//b", "./a", "a/..", "a\0"] {
            assert!(!is_clean_relative(bad), "{bad:?}");
        }
    }

    #[test]
    fn client_paths() {
        assert_eq!(check_client_path("/workspace//./x"), Ok(()));
        assert_eq!(check_client_path("x"), Err(ClientPathError::NotAbsolute));
        assert_eq!(
            check_client_path("/a/../b"),
            Err(ClientPathError::ParentComponent)
        );
        assert_eq!(check_client_path("/a\0"), Err(ClientPathError::ContainsNul));
        let long = format!("/{}", "a".repeat(MAX_SANDBOX_PATH));
        assert_eq!(check_client_path(&long), Err(ClientPathError::TooLong));
    }

    proptest! {
        #[test]
        fn clean_paths_never_climb(s in "[/a.]{0,16}") {
            if let Some(n) = clean_absolute(&s) {
                prop_assert!(n.starts_with('/'));
                prop_assert!(n.split('/').skip(1).all(|c| !c.is_empty() && c != "." && c != ".."));
                prop_assert_eq!(clean_absolute(&n), Some(n.clone()));
            }
        }
    }
}
