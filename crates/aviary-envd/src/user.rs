//! Who an exec runs as: an image's `User` (`name`, `uid`, `name:group`,
//! `uid:gid`) resolved against the sandbox's own `/etc/passwd` and
//! `/etc/group`, as Docker does. Those files are the sandbox's to write; the
//! worst they can do is pick another user *inside* the sandbox, whose user
//! namespace bounds every id.

use std::fs;

/// A resolved user: ids and home directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Longest `/etc/passwd` or `/etc/group` read (the sandbox writes them).
const MAX_DB_BYTES: u64 = 4 * 1024 * 1024;

fn read_db(path: &str) -> String {
    use std::io::Read;
    let mut out = String::new();
    if let Ok(f) = fs::File::open(path) {
        let _ = f.take(MAX_DB_BYTES).read_to_string(&mut out);
    }
    out
}

/// `(name, id, gid, home)` of each well-formed `passwd` line.
fn passwd_entries(db: &str) -> impl Iterator<Item = (&str, u32, u32, &str)> {
    db.lines().filter_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        Some((f[0], f[2].parse().ok()?, f[3].parse().ok()?, f[5]))
    })
}

fn group_id(db: &str, name: &str) -> Option<u32> {
    db.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && f[0] == name).then(|| f[2].parse().ok())?
    })
}

/// Resolves `spec` against the given database contents.
pub fn resolve_in(spec: &str, passwd: &str, group: &str) -> Result<RunAs, String> {
    let (user, grp) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if user.is_empty() {
        return Err(format!("user {spec:?} names no user"));
    }
    let entry = match user.parse::<u32>() {
        Ok(uid) => passwd_entries(passwd)
            .find(|e| e.1 == uid)
            .map(|e| (e.1, e.2, e.3.to_owned()))
            // a uid the image does not name runs with gid 0, as in Docker
            .unwrap_or((uid, 0, "/".to_owned())),
        Err(_) => passwd_entries(passwd)
            .find(|e| e.0 == user)
            .map(|e| (e.1, e.2, e.3.to_owned()))
            .ok_or_else(|| format!("user {user:?} is not in the sandbox's /etc/passwd"))?,
    };
    let gid = match grp {
        None => entry.1,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => group_id(group, g)
                .ok_or_else(|| format!("group {g:?} is not in the sandbox's /etc/group"))?,
        },
    };
    Ok(RunAs {
        uid: entry.0,
        gid,
        home: if entry.2.is_empty() {
            "/".into()
        } else {
            entry.2
        },
    })
}

/// Resolves `spec` against this sandbox's `/etc/passwd` and `/etc/group`.
pub fn resolve(spec: &str) -> Result<RunAs, String> {
    resolve_in(spec, &read_db("/etc/passwd"), &read_db("/etc/group"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        garbage line\n\
        app:x:1000:1001:App:/home/app:/bin/sh\n\
        nohome:x:1002:1002::::\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:app\napp:x:1001:\n";

    #[test]
    fn names_ids_and_groups_resolve_as_docker_does() {
        let r = |s| resolve_in(s, PASSWD, GROUP);
        assert_eq!(
            r("app").unwrap(),
            RunAs {
                uid: 1000,
                gid: 1001,
                home: "/home/app".into()
            }
        );
        assert_eq!(r("1000").unwrap().gid, 1001, "a known uid takes its group");
        assert_eq!(
            r("4242").unwrap(),
            RunAs {
                uid: 4242,
                gid: 0,
                home: "/".into()
            },
            "an unknown uid runs with gid 0"
        );
        assert_eq!(r("app:staff").unwrap().gid, 50);
        assert_eq!(r("app:77").unwrap().gid, 77);
        assert_eq!(r("0:0").unwrap().uid, 0);
        assert_eq!(r("nohome").unwrap().home, "/");
        for bad in ["ghost", "app:ghosts", ":staff", "garbage line"] {
            r(bad).unwrap_err();
        }
    }
}
