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

/// Bytes of randomness in a lease token's secret.
pub const LEASE_SECRET_LEN: usize = 16;

/// A lease's token: the **fence** — a number strictly increasing per sandbox
/// across restarts, which orders writes (a write carrying a lower fence than
/// the current one is stale) — plus a random 128-bit **secret**. Fence
/// numbers are small and guessable and appear in events; the pair is the
/// write capability, so only the holder, who got it from the grant, can
/// write. Written `FENCE.SECRETHEX` (e.g. `7.9f86d081884c7d659a2feaa0c55ad015`)
/// in JSON, headers and the CLI. `Debug` never shows the secret; `Display`
/// does (it is what the holder passes back), so never log a token with `{}`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseToken {
    fence: u64,
    secret: [u8; LEASE_SECRET_LEN],
}

impl LeaseToken {
    /// A new token with fence `fence` and a fresh random secret.
    pub fn generate(fence: u64) -> LeaseToken {
        let mut secret = [0u8; LEASE_SECRET_LEN];
        rand::thread_rng().fill(&mut secret[..]);
        LeaseToken { fence, secret }
    }

    pub fn from_parts(fence: u64, secret: [u8; LEASE_SECRET_LEN]) -> LeaseToken {
        LeaseToken { fence, secret }
    }

    /// The fencing number: ordering only, not a capability.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The secret, for storage by a lease store.
    pub fn secret(&self) -> &[u8; LEASE_SECRET_LEN] {
        &self.secret
    }

    /// The secret as lowercase hex (the stored form).
    pub fn secret_hex(&self) -> String {
        self.secret.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses the stored hex form of a secret.
    pub fn secret_from_hex(hex: &str) -> Option<[u8; LEASE_SECRET_LEN]> {
        if hex.len() != LEASE_SECRET_LEN * 2 || !hex.is_ascii() {
            return None;
        }
        let mut out = [0u8; LEASE_SECRET_LEN];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(out)
    }

    /// Whether `other` is the same capability, comparing the secrets in
    /// constant time.
    pub fn matches(&self, other: &LeaseToken) -> bool {
        let diff = self
            .secret
            .iter()
            .zip(other.secret.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        self.fence == other.fence && diff == 0
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken(fence {}, secret redacted)", self.fence)
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.fence, self.secret_hex())
    }
}

/// Why a lease token string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a lease token is FENCE.SECRET (a number, a dot, 32 hex digits), as the grant returned it")]
pub struct LeaseTokenError;

impl FromStr for LeaseToken {
    type Err = LeaseTokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (fence, secret) = s.trim().split_once('.').ok_or(LeaseTokenError)?;
        if fence.is_empty() || !fence.bytes().all(|b| b.is_ascii_digit()) {
            return Err(LeaseTokenError);
        }
        let fence = fence.parse::<u64>().map_err(|_| LeaseTokenError)?;
        let secret = LeaseToken::secret_from_hex(secret).ok_or(LeaseTokenError)?;
        Ok(LeaseToken { fence, secret })
    }
}

impl Serialize for LeaseToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LeaseToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl utoipa::PartialSchema for LeaseToken {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(r"^[0-9]{1,20}\.[0-9a-f]{32}$"))
            .description(Some(
                "Lease token FENCE.SECRET as returned by the grant: the fence orders writes, the secret makes it a capability",
            ))
            .examples([serde_json::json!("7.9f86d081884c7d659a2feaa0c55ad015")])
            .into()
    }
}

impl utoipa::ToSchema for LeaseToken {}

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

    #[test]
    fn lease_tokens_round_trip_and_hide_their_secret() {
        let t = LeaseToken::generate(7);
        let text = t.to_string();
        assert!(text.starts_with("7."), "{text}");
        assert_eq!(text.parse::<LeaseToken>().unwrap(), t);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<LeaseToken>(&json).unwrap(), t);
        assert!(!format!("{t:?}").contains(&t.secret_hex()), "{t:?}");
        assert_ne!(LeaseToken::generate(7), t, "secrets are random");
        assert!(t.matches(&t) && !t.matches(&LeaseToken::generate(7)));
        for bad in [
            "7",
            "7.",
            "x.00",
            "7.zz",
            "-1.00000000000000000000000000000000",
            "7",
        ] {
            assert!(bad.parse::<LeaseToken>().is_err(), "{bad}");
        }
        assert!(
            serde_json::from_str::<LeaseToken>("7").is_err(),
            "bare numbers are not tokens"
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
