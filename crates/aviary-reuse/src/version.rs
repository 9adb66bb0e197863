//! Versions and version requirements.
//!
//! The ordering is a deliberately small common core of PEP 440, semver and
//! Debian versions: an optional `epoch:`, then runs of digits (compared
//! numerically) and letters (pre-release tags, which sort *before* the release
//! they qualify: `1.0rc1 < 1.0`); missing trailing components count as zero
//! (`1.5 == 1.5.0`); a leading `v` is ignored. It is enough to decide "does the
//! installed pandas satisfy `==1.5`", not a full resolver.
//!
//! Requirement syntax (comma-separated clauses, all must hold): `==V` (exact,
//! zero-padded), `==V.*` or a bare `V` (prefix: `3.9` matches `3.9.18`), `!=V`,
//! `>=V`, `<=V`, `>V`, `<V`, `~=V` (PEP 440 compatible release), `^V` and `~V`
//! (npm caret/tilde), `*` or empty (any version).

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VersionError {
    #[error("empty package name in requirement {spec:?}")]
    MissingName { spec: String },
    #[error("malformed version clause {clause:?}")]
    ParseClause { clause: String },
}

/// Which package manager a package belongs to.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Ecosystem {
    Pip,
    Npm,
    Apt,
}

impl Ecosystem {
    pub fn as_str(self) -> &'static str {
        match self {
            Ecosystem::Pip => "pip",
            Ecosystem::Npm => "npm",
            Ecosystem::Apt => "apt",
        }
    }

    /// The canonical form of a package name in this ecosystem (PEP 503 for
    /// pip: lowercase, runs of `-_.` become `-`; lowercase for npm and apt,
    /// with a dpkg `:arch` suffix dropped).
    pub fn normalize_name(self, name: &str) -> String {
        let name = name.trim();
        match self {
            Ecosystem::Pip => {
                let mut out = String::with_capacity(name.len());
                let mut in_sep = false;
                for c in name.chars() {
                    if matches!(c, '-' | '_' | '.') {
                        if !in_sep {
                            out.push('-');
                        }
                        in_sep = true;
                    } else {
                        out.extend(c.to_lowercase());
                        in_sep = false;
                    }
                }
                out
            }
            Ecosystem::Npm => name.to_lowercase(),
            Ecosystem::Apt => name.split(':').next().unwrap_or(name).to_lowercase(),
        }
    }
}

impl fmt::Display for Ecosystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Token<'a> {
    Num(u64),
    Tag(&'a str),
}

fn split_epoch(v: &str) -> (u64, &str) {
    let v = v.trim();
    let v = v.strip_prefix(['v', 'V']).unwrap_or(v);
    match v.split_once(':') {
        Some((epoch, rest)) if !epoch.is_empty() && epoch.bytes().all(|b| b.is_ascii_digit()) => {
            (epoch.parse().unwrap_or(u64::MAX), rest)
        }
        _ => (0, v),
    }
}

fn tokens(v: &str) -> Vec<Token<'_>> {
    let mut out = Vec::new();
    let bytes = v.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        if bytes[i].is_ascii_digit() {
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            // Absurdly long digit runs saturate instead of failing.
            out.push(Token::Num(v[start..i].parse().unwrap_or(u64::MAX)));
        } else if bytes[i].is_ascii_alphabetic() {
            while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
                i += 1;
            }
            out.push(Token::Tag(&v[start..i]));
        } else {
            i += 1;
        }
    }
    out
}

/// Rank of a pre-release tag: dev < alpha < beta < rc < anything else.
fn tag_rank(tag: &str) -> (u8, String) {
    let lower = tag.to_ascii_lowercase();
    let rank = match lower.as_str() {
        "dev" => 0,
        "a" | "alpha" => 1,
        "b" | "beta" => 2,
        "c" | "rc" | "pre" | "preview" => 3,
        _ => 4,
    };
    (rank, lower)
}

fn cmp_tokens(a: &[Token<'_>], b: &[Token<'_>]) -> Ordering {
    let n = a.len().max(b.len());
    for i in 0..n {
        let ord = match (a.get(i), b.get(i)) {
            (Some(Token::Num(x)), Some(Token::Num(y))) => x.cmp(y),
            (Some(Token::Tag(x)), Some(Token::Tag(y))) => tag_rank(x).cmp(&tag_rank(y)),
            // A tag where the other side has a number (or nothing) is a
            // pre-release of that position: 1.0a1 < 1.0.1 and 1.0a1 < 1.0.
            (Some(Token::Tag(_)), _) => Ordering::Less,
            (_, Some(Token::Tag(_))) => Ordering::Greater,
            (Some(Token::Num(x)), None) => x.cmp(&0),
            (None, Some(Token::Num(y))) => 0.cmp(y),
            (None, None) => Ordering::Equal,
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
    Ordering::Equal
}

/// Orders two version strings (see the module docs for the rules).
pub fn compare_versions(a: &str, b: &str) -> Ordering {
    let (ea, ra) = split_epoch(a);
    let (eb, rb) = split_epoch(b);
    ea.cmp(&eb)
        .then_with(|| cmp_tokens(&tokens(ra), &tokens(rb)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Eq,
    Prefix,
    Ne,
    Ge,
    Le,
    Gt,
    Lt,
    Compatible,
    Caret,
    Tilde,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Clause {
    op: Op,
    version: String,
}

/// Numeric release components of a version (`1.24.0rc1` → `[1, 24, 0]`).
fn release(v: &str) -> Vec<u64> {
    let (_, rest) = split_epoch(v);
    tokens(rest)
        .into_iter()
        .map_while(|t| match t {
            Token::Num(n) => Some(n),
            Token::Tag(_) => None,
        })
        .collect()
}

fn has_prefix(version: &str, prefix: &[u64]) -> bool {
    let rel = release(version);
    prefix
        .iter()
        .enumerate()
        .all(|(i, p)| rel.get(i).copied().unwrap_or(0) == *p)
}

impl Clause {
    fn matches(&self, v: &str) -> bool {
        let ord = compare_versions(v, &self.version);
        match self.op {
            Op::Eq => ord == Ordering::Equal,
            Op::Ne => ord != Ordering::Equal,
            Op::Ge => ord != Ordering::Less,
            Op::Le => ord != Ordering::Greater,
            Op::Gt => ord == Ordering::Greater,
            Op::Lt => ord == Ordering::Less,
            Op::Prefix => has_prefix(v, &release(&self.version)),
            Op::Compatible => {
                let mut rel = release(&self.version);
                if rel.len() > 1 {
                    rel.pop();
                }
                ord != Ordering::Less && has_prefix(v, &rel)
            }
            Op::Caret => {
                let rel = release(&self.version);
                // Everything up to and including the first non-zero component
                // is fixed (^1.2 → 1.x, ^0.2 → 0.2.x).
                let fixed = rel
                    .iter()
                    .position(|&c| c != 0)
                    .map_or(rel.len(), |i| i + 1);
                ord != Ordering::Less && has_prefix(v, &rel[..fixed.min(rel.len())])
            }
            Op::Tilde => {
                let rel = release(&self.version);
                let fixed = if rel.len() >= 2 { 2 } else { rel.len() };
                ord != Ordering::Less && has_prefix(v, &rel[..fixed])
            }
        }
    }
}

/// A version requirement: comma-separated clauses that must all hold. Serialized
/// as the string it was parsed from.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VersionReq {
    text: String,
    clauses: Vec<Clause>,
}

impl VersionReq {
    /// Matches every version.
    pub fn any() -> Self {
        VersionReq {
            text: String::new(),
            clauses: Vec::new(),
        }
    }

    pub fn is_any(&self) -> bool {
        self.clauses.is_empty()
    }

    pub fn matches(&self, version: &str) -> bool {
        self.clauses.iter().all(|c| c.matches(version))
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for VersionReq {
    type Err = VersionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const OPS: &[(&str, Op)] = &[
            ("===", Op::Eq),
            ("==", Op::Eq),
            ("!=", Op::Ne),
            (">=", Op::Ge),
            ("<=", Op::Le),
            ("~=", Op::Compatible),
            (">", Op::Gt),
            ("<", Op::Lt),
            ("^", Op::Caret),
            ("~", Op::Tilde),
            ("=", Op::Eq),
        ];
        let mut clauses = Vec::new();
        for raw in s.split(',') {
            let clause = raw.trim();
            if clause.is_empty() || clause == "*" {
                continue;
            }
            let (mut op, rest) = OPS
                .iter()
                .find_map(|(p, op)| clause.strip_prefix(p).map(|r| (*op, r.trim())))
                .unwrap_or((Op::Prefix, clause));
            let mut version = rest;
            if let Some(stripped) = rest.strip_suffix(".*") {
                if matches!(op, Op::Eq | Op::Prefix) {
                    op = Op::Prefix;
                    version = stripped;
                }
            }
            let valid = !version.is_empty()
                && version.bytes().all(|b| {
                    b.is_ascii_alphanumeric()
                        || matches!(b, b'.' | b'-' | b'+' | b'_' | b':' | b'~')
                })
                && version.bytes().any(|b| b.is_ascii_digit());
            if !valid {
                return Err(VersionError::ParseClause {
                    clause: clause.to_owned(),
                });
            }
            clauses.push(Clause {
                op,
                version: version.to_owned(),
            });
        }
        Ok(VersionReq {
            text: s.trim().to_owned(),
            clauses,
        })
    }
}

// In OpenAPI a requirement is the plain string it serializes to.
impl utoipa::PartialSchema for VersionReq {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        <String as utoipa::PartialSchema>::schema()
    }
}

impl utoipa::ToSchema for VersionReq {}

impl TryFrom<String> for VersionReq {
    type Error = VersionError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<VersionReq> for String {
    fn from(r: VersionReq) -> String {
        r.text
    }
}

impl fmt::Display for VersionReq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for VersionReq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VersionReq({:?})", self.text)
    }
}

/// A package a request needs, e.g. pip `pandas==1.5` or npm `playwright@^1.40`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PackageRequirement {
    pub ecosystem: Ecosystem,
    /// Normalized name ([`Ecosystem::normalize_name`]).
    pub name: String,
    #[serde(default = "VersionReq::any")]
    pub version: VersionReq,
}

impl PackageRequirement {
    /// Parses a requirement in the ecosystem's own syntax: pip
    /// `name[extras]<op>version` (environment markers after `;` are ignored),
    /// npm `name@range` (scoped names like `@playwright/test@1.40` work), apt
    /// `name` or `name=version`.
    pub fn parse(ecosystem: Ecosystem, spec: &str) -> Result<Self, VersionError> {
        let spec_trim = spec.trim();
        let (name, range) = match ecosystem {
            Ecosystem::Pip => {
                let no_marker = spec_trim.split(';').next().unwrap_or("").trim();
                let end = no_marker
                    .find(['=', '<', '>', '!', '~', '[', ' ', '('])
                    .unwrap_or(no_marker.len());
                let mut range = no_marker[end..].trim();
                if let Some(close) = range.strip_prefix('[').and_then(|r| r.find(']')) {
                    range = range[close + 2..].trim();
                }
                let range = range.trim_start_matches('(').trim_end_matches(')');
                (&no_marker[..end], range)
            }
            // A leading `@` starts a scoped name, not a version.
            Ecosystem::Npm => match spec_trim.rfind('@') {
                Some(at) if at > 0 => (&spec_trim[..at], &spec_trim[at + 1..]),
                _ => (spec_trim, ""),
            },
            Ecosystem::Apt => match spec_trim.split_once('=') {
                Some((n, v)) => (n, v),
                None => (spec_trim, ""),
            },
        };
        let name = ecosystem.normalize_name(name);
        if name.is_empty() {
            return Err(VersionError::MissingName {
                spec: spec.to_owned(),
            });
        }
        let range = range.trim();
        // apt's `=` and a bare npm version both mean "exactly this".
        let version = if !range.is_empty()
            && matches!(ecosystem, Ecosystem::Apt | Ecosystem::Npm)
            && range.starts_with(|c: char| c.is_ascii_digit())
        {
            format!("=={range}").parse()?
        } else {
            range.parse()?
        };
        Ok(PackageRequirement {
            ecosystem,
            name,
            version,
        })
    }

    pub fn pip(spec: &str) -> Result<Self, VersionError> {
        Self::parse(Ecosystem::Pip, spec)
    }

    pub fn npm(spec: &str) -> Result<Self, VersionError> {
        Self::parse(Ecosystem::Npm, spec)
    }

    pub fn apt(spec: &str) -> Result<Self, VersionError> {
        Self::parse(Ecosystem::Apt, spec)
    }
}

impl fmt::Display for PackageRequirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.version.is_any() {
            write!(f, "{}:{}", self.ecosystem, self.name)
        } else {
            write!(f, "{}:{} {}", self.ecosystem, self.name, self.version)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(s: &str) -> VersionReq {
        s.parse().unwrap()
    }

    #[test]
    fn ordering_follows_release_then_prerelease() {
        assert_eq!(compare_versions("1.5", "1.5.0"), Ordering::Equal);
        assert_eq!(compare_versions("1.24.0rc1", "1.24.0"), Ordering::Less);
        assert_eq!(compare_versions("1.0a1", "1.0b1"), Ordering::Less);
        assert_eq!(compare_versions("1.0.dev1", "1.0a1"), Ordering::Less);
        assert_eq!(compare_versions("2.10", "2.9"), Ordering::Greater);
        assert_eq!(compare_versions("v20.11.1", "20.11.1"), Ordering::Equal);
        assert_eq!(compare_versions("1:1.0", "2.0"), Ordering::Greater);
        assert_eq!(
            compare_versions("2.36-9+deb12u3", "2.36-9+deb12u4"),
            Ordering::Less
        );
    }

    #[test]
    fn seed_requirements_match_as_pip_would() {
        assert!(req("==1.5").matches("1.5.0"));
        assert!(!req("==1.5").matches("1.5.3"));
        assert!(!req("==1.5").matches("2.2.2"));
        assert!(req("==1.5.*").matches("1.5.3"));
        assert!(req("<1.24").matches("1.23.5"));
        assert!(!req("<1.24").matches("1.24.0"));
        assert!(req("3.9").matches("3.9.18"));
        assert!(!req("3.9").matches("3.12.4"));
        assert!(!req("3.9").matches("3.10.1"));
        assert!(req(">=1.5,<2").matches("1.5.3"));
        assert!(!req(">=1.5,<2").matches("2.0.0"));
        assert!(req("~=1.4.2").matches("1.4.9"));
        assert!(!req("~=1.4.2").matches("1.5.0"));
        assert!(req("^1.40").matches("1.45.0"));
        assert!(!req("^1.40").matches("2.0.0"));
        assert!(!req("^0.2.3").matches("0.3.0"));
        assert!(req("~1.2.3").matches("1.2.9"));
        assert!(!req("~1.2.3").matches("1.3.0"));
        assert!(req("!=1.0").matches("1.0.1"));
        assert!(req("").matches("anything"));
        assert!(req("*").is_any());
    }

    #[test]
    fn malformed_clauses_are_errors() {
        assert_eq!(
            ">=".parse::<VersionReq>().unwrap_err(),
            VersionError::ParseClause {
                clause: ">=".into()
            }
        );
        ">=abc".parse::<VersionReq>().unwrap_err();
        "==1.0; rm -rf /".parse::<VersionReq>().unwrap_err();
    }

    #[test]
    fn package_specs_parse_per_ecosystem() {
        let p = PackageRequirement::pip("Pandas_Stubs[extra]>=1.5 ; python_version<'3.9'").unwrap();
        assert_eq!(p.name, "pandas-stubs");
        assert_eq!(p.version.as_str(), ">=1.5");
        let p = PackageRequirement::pip("numpy<1.24").unwrap();
        assert_eq!((p.name.as_str(), p.version.as_str()), ("numpy", "<1.24"));
        let p = PackageRequirement::pip("matplotlib").unwrap();
        assert!(p.version.is_any());
        let n = PackageRequirement::npm("@playwright/test@^1.40").unwrap();
        assert_eq!(
            (n.name.as_str(), n.version.as_str()),
            ("@playwright/test", "^1.40")
        );
        let n = PackageRequirement::npm("playwright@1.40.0").unwrap();
        assert!(n.version.matches("1.40.0"));
        assert!(!n.version.matches("1.41.0"));
        let n = PackageRequirement::npm("@scope/pkg").unwrap();
        assert_eq!(n.name, "@scope/pkg");
        assert!(n.version.is_any());
        let a = PackageRequirement::apt("ffmpeg=7:5.1.6-0+deb12u1").unwrap();
        assert!(a.version.matches("7:5.1.6-0+deb12u1"));
        assert!(!a.version.matches("7:5.1.5-0+deb12u1"));
        PackageRequirement::pip("==1.0").unwrap_err();
    }

    #[test]
    fn requirement_round_trips_through_json() {
        let p = PackageRequirement::pip("pandas==1.5").unwrap();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"ecosystem":"pip","name":"pandas","version":"==1.5"}"#
        );
        let back: PackageRequirement = serde_json::from_str(&json).unwrap();
        assert_eq!(back, p);
    }

    fn version() -> impl Strategy<Value = String> {
        prop::collection::vec(0u64..30, 1..5).prop_map(|parts| {
            parts
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(".")
        })
    }

    proptest! {
        #[test]
        fn ordering_is_antisymmetric_and_transitive(a in version(), b in version(), c in version()) {
            prop_assert_eq!(compare_versions(&a, &b), compare_versions(&b, &a).reverse());
            if compare_versions(&a, &b) != Ordering::Greater && compare_versions(&b, &c) != Ordering::Greater {
                prop_assert_ne!(compare_versions(&a, &c), Ordering::Greater);
            }
        }

        #[test]
        fn exact_pin_matches_only_equal_versions(a in version(), b in version()) {
            let r: VersionReq = format!("=={a}").parse().unwrap();
            prop_assert_eq!(r.matches(&b), compare_versions(&a, &b) == Ordering::Equal);
        }

        #[test]
        fn range_clauses_agree_with_the_ordering(a in version(), b in version()) {
            let ge: VersionReq = format!(">={a}").parse().unwrap();
            let lt: VersionReq = format!("<{a}").parse().unwrap();
            prop_assert_ne!(ge.matches(&b), lt.matches(&b));
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(s in ".{0,40}") {
            let _ = s.parse::<VersionReq>();
            let _ = PackageRequirement::pip(&s);
            let _ = PackageRequirement::npm(&s);
            let _ = PackageRequirement::apt(&s);
            let _ = compare_versions(&s, "1.0");
        }
    }
}
