//! Identifiers. Sandbox ids are `sbx-` followed by 20 lowercase base32 characters
//! (100 random bits): unguessable, URL-safe and safe to use as a path component.

use rand::Rng;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
const ID_BODY_LEN: usize = 20;

/// A new random id `PREFIX-xxxxxxxxxxxxxxxxxxxx`.
pub fn new_id(prefix: &str) -> String {
    let mut rng = rand::thread_rng();
    let body: String = (0..ID_BODY_LEN)
        .map(|_| ALPHABET[rng.gen_range(0..32)] as char)
        .collect();
    format!("{prefix}-{body}")
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("malformed {kind} id")]
    Malformed { kind: &'static str },
}

/// Id of one sandbox. Parsing validates the shape, so a `SandboxId` can be
/// joined onto a filesystem path without escaping it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(try_from = "String", into = "String")]
#[schema(value_type = String, example = "sbx-abcdefghij234567abcd")]
pub struct SandboxId(String);

impl SandboxId {
    pub fn generate() -> Self {
        SandboxId(new_id("sbx"))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SandboxId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let body = s
            .strip_prefix("sbx-")
            .ok_or(IdError::Malformed { kind: "sandbox" })?;
        if body.len() == ID_BODY_LEN && body.bytes().all(|b| ALPHABET.contains(&b)) {
            Ok(SandboxId(s.to_owned()))
        } else {
            Err(IdError::Malformed { kind: "sandbox" })
        }
    }
}

impl TryFrom<String> for SandboxId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A lease's fencing token. Strictly increasing per sandbox, across restarts:
/// a write carrying a token lower than the current one is stale.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Debug,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(transparent)]
pub struct LeaseToken(pub u64);

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn generated_ids_parse() {
        for _ in 0..100 {
            let id = SandboxId::generate();
            assert_eq!(id.as_str().parse::<SandboxId>().unwrap(), id);
        }
    }

    #[test]
    fn traversal_is_not_an_id() {
        assert_eq!(
            "sbx-../../etc/passwd".parse::<SandboxId>().unwrap_err(),
            IdError::Malformed { kind: "sandbox" }
        );
    }

    proptest! {
        #[test]
        fn parsed_ids_are_path_safe(s in ".*") {
            if let Ok(id) = s.parse::<SandboxId>() {
                prop_assert!(id.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
                prop_assert_eq!(id.as_str().len(), 24);
            }
        }

        #[test]
        fn serde_round_trip(_seed in 0u8..10) {
            let id = SandboxId::generate();
            let json = serde_json::to_string(&id).unwrap();
            let back: SandboxId = serde_json::from_str(&json).unwrap();
            prop_assert_eq!(back, id);
        }
    }
}
