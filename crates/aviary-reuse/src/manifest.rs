//! The environment manifest of a sandbox (seed 002 §5.4, `sandbox_environment`)
//! and the probe that gathers it.
//!
//! The probe is a handful of POSIX `sh` commands ([`PROBE_COMMANDS`], or all of
//! them as one [`probe_script`] so a single exec suffices) run inside the
//! sandbox; [`EnvironmentManifest::from_probe_outputs`] turns their output into
//! a manifest. Every command tolerates a missing tool: no `python3` means no
//! `python` runtime and no pip package set, not an error.
//!
//! Trust: the probe output comes from inside an untrusted sandbox, so the
//! parsers accept any bytes without panicking, and a forged output can only
//! misdescribe that sandbox's own environment. The security checks of the reuse
//! checker (tenant, user, scope, taint, policy) never read the manifest.
//!
//! Dirty level ([`DirtyLevel`]), from the paths a sandbox changed relative to
//! its template (e.g. its overlay upper dir):
//! - 0 `Clean`: nothing but ephemeral state (`/tmp`, `/run`, logs, caches).
//! - 1 `Workspace`: the user's files under `/workspace` changed.
//! - 2 `Dependencies`: package-manager territory changed (`/usr`, `/opt`,
//!   virtualenvs, `site-packages`, `node_modules`, dpkg state): known, recorded
//!   in the package sets.
//! - 3 `Unknown`: anything else (`/etc`, `/bin`, dot-files such as `.bashrc` or
//!   `.ssh`): pollution nobody can describe; such a sandbox is never reused
//!   (seed 002 §5.7 "Dependency未知污染 → 禁止").

use crate::version::{Ecosystem, PackageRequirement, VersionReq};
use aviary_core::SandboxId;
use aviary_registry::EnvironmentRecord;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use time::OffsetDateTime;

/// How much state earlier work left behind (see the module docs).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
#[serde(into = "u8", try_from = "u8")]
pub enum DirtyLevel {
    #[default]
    Clean = 0,
    Workspace = 1,
    Dependencies = 2,
    Unknown = 3,
}

impl From<DirtyLevel> for u8 {
    fn from(l: DirtyLevel) -> u8 {
        l as u8
    }
}

impl TryFrom<u8> for DirtyLevel {
    type Error = String;
    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(DirtyLevel::Clean),
            1 => Ok(DirtyLevel::Workspace),
            2 => Ok(DirtyLevel::Dependencies),
            3 => Ok(DirtyLevel::Unknown),
            other => Err(format!("dirty level {other} is not in 0..=3")),
        }
    }
}

impl DirtyLevel {
    /// The level one changed path puts a sandbox at.
    pub fn of_path(path: &str) -> DirtyLevel {
        let comps: Vec<&str> = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        let Some(&top) = comps.first() else {
            return DirtyLevel::Clean;
        };
        let second = comps.get(1).copied().unwrap_or("");
        let dependency_dir = comps.iter().any(|c| {
            matches!(
                *c,
                "site-packages"
                    | "dist-packages"
                    | "node_modules"
                    | ".venv"
                    | "venv"
                    | "__pycache__"
            )
        });
        match top {
            // `.aviary` holds the platform's envd mount point, not user state
            "tmp" | "run" | "dev" | "proc" | "sys" | ".aviary" => DirtyLevel::Clean,
            "var" if matches!(second, "tmp" | "log" | "cache" | "run" | "lock") => {
                DirtyLevel::Clean
            }
            "workspace" => DirtyLevel::Workspace,
            "usr" | "opt" => DirtyLevel::Dependencies,
            "var" if second == "lib" && matches!(comps.get(2).copied(), Some("dpkg" | "apt")) => {
                DirtyLevel::Dependencies
            }
            "etc" if matches!(second, "alternatives" | "ld.so.cache") => DirtyLevel::Dependencies,
            "root" | "home" => {
                // Home directories: caches are fine, package-manager dirs are
                // dependencies, anything else (rc files, .ssh) is unknown.
                let rest: Vec<&str> = if top == "home" {
                    comps.iter().skip(2).copied().collect()
                } else {
                    comps.iter().skip(1).copied().collect()
                };
                match rest.first().copied() {
                    None => DirtyLevel::Clean,
                    Some(".cache")
                    | Some(".bash_history")
                    | Some(".python_history")
                    | Some(".wget-hsts")
                    | Some(".lesshst") => DirtyLevel::Clean,
                    Some(".local") | Some(".npm") | Some(".npm-global") | Some(".pyenv")
                    | Some(".nvm") => DirtyLevel::Dependencies,
                    Some("workspace") => DirtyLevel::Workspace,
                    _ if dependency_dir => DirtyLevel::Dependencies,
                    _ => DirtyLevel::Unknown,
                }
            }
            _ if dependency_dir => DirtyLevel::Dependencies,
            _ => DirtyLevel::Unknown,
        }
    }

    pub fn as_u8(self) -> u8 {
        self as u8
    }
}

/// The installed packages of one ecosystem with a hash over them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PackageSet {
    /// SHA-256 (hex) over the sorted `name==version` lines: equal sets hash
    /// equally whatever order or format the tool printed them in.
    pub hash: String,
    /// Normalized name → version (empty when the tool did not say).
    pub packages: BTreeMap<String, String>,
}

impl PackageSet {
    pub fn new(packages: BTreeMap<String, String>) -> Self {
        let mut h = Sha256::new();
        for (name, version) in &packages {
            h.update(name.as_bytes());
            h.update(b"==");
            h.update(version.as_bytes());
            h.update(b"\n");
        }
        PackageSet {
            hash: hex::encode(h.finalize()),
            packages,
        }
    }

    pub fn version_of(&self, name: &str) -> Option<&str> {
        self.packages.get(name).map(String::as_str)
    }
}

/// What one probe command asks.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum ProbeKey {
    /// The default `python3` version.
    Python,
    /// Every `python3.X` interpreter on the usual paths (venv candidates).
    PythonInterpreters,
    Pip,
    Node,
    NpmGlobal,
    /// The project in `/workspace`, when it has a `package.json`.
    NpmWorkspace,
    Apt,
    /// Well-known tools on `PATH` (browsers, compilers, GPU tools).
    Tools,
}

impl ProbeKey {
    pub const ALL: [ProbeKey; 8] = [
        ProbeKey::Python,
        ProbeKey::PythonInterpreters,
        ProbeKey::Pip,
        ProbeKey::Node,
        ProbeKey::NpmGlobal,
        ProbeKey::NpmWorkspace,
        ProbeKey::Apt,
        ProbeKey::Tools,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKey::Python => "python",
            ProbeKey::PythonInterpreters => "python-interpreters",
            ProbeKey::Pip => "pip",
            ProbeKey::Node => "node",
            ProbeKey::NpmGlobal => "npm-global",
            ProbeKey::NpmWorkspace => "npm-workspace",
            ProbeKey::Apt => "apt",
            ProbeKey::Tools => "tools",
        }
    }

    pub fn parse(s: &str) -> Option<ProbeKey> {
        ProbeKey::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for ProbeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One probe: a POSIX `sh -c` command line, run inside the sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeCommand {
    pub key: ProbeKey,
    pub shell: &'static str,
}

/// Tools whose presence becomes a capability (and the capability they imply).
const TOOLS: &[(&str, &str)] = &[
    ("chromium", "browser"),
    ("chromium-browser", "browser"),
    ("google-chrome", "browser"),
    ("google-chrome-stable", "browser"),
    ("firefox", "browser"),
    ("nvidia-smi", "gpu"),
    ("gcc", "compiler"),
    ("cc", "compiler"),
    ("clang", "compiler"),
    ("make", "make"),
    ("git", "git"),
    ("java", "java"),
    ("go", "go"),
    ("rustc", "rust"),
];

/// The probe, one command per [`ProbeKey`]. Each prints nothing (and usually
/// exits non-zero) when its tool is missing.
pub const PROBE_COMMANDS: &[ProbeCommand] = &[
    ProbeCommand {
        key: ProbeKey::Python,
        shell: "python3 -V 2>&1",
    },
    ProbeCommand {
        key: ProbeKey::PythonInterpreters,
        shell: "for p in /usr/bin/python3.* /usr/local/bin/python3.* /opt/*/bin/python3.*; do \
                case \"${p##*/}\" in python3.[0-9]|python3.[0-9][0-9]) [ -x \"$p\" ] && \"$p\" -V 2>&1;; esac; \
                done; true",
    },
    ProbeCommand {
        key: ProbeKey::Pip,
        // importlib.metadata (Python >= 3.8) is about 4x faster than pip
        // freeze (measured 0.38 s vs 1.46 s here); the first distribution of a
        // name wins, as on sys.path. pip freeze is the fallback.
        shell: "python3 -c 'import importlib.metadata as m;s=set();\
                [print(n+\"==\"+(d.version or \"\")) or s.add(n.lower()) for d in m.distributions() \
                for n in [d.metadata[\"Name\"]] if n and n.lower() not in s]' 2>/dev/null \
                || python3 -m pip freeze --all --disable-pip-version-check 2>/dev/null",
    },
    ProbeCommand {
        key: ProbeKey::Node,
        shell: "node -v 2>/dev/null",
    },
    ProbeCommand {
        key: ProbeKey::NpmGlobal,
        shell: "npm ls -g --json --depth=0 2>/dev/null",
    },
    ProbeCommand {
        key: ProbeKey::NpmWorkspace,
        shell: "cd /workspace 2>/dev/null && [ -f package.json ] && npm ls --json --depth=0 2>/dev/null",
    },
    ProbeCommand {
        key: ProbeKey::Apt,
        shell: "dpkg-query -W -f='${db:Status-Abbrev}\\t${binary:Package}\\t${Version}\\n' 2>/dev/null",
    },
    ProbeCommand {
        key: ProbeKey::Tools,
        shell: "for t in chromium chromium-browser google-chrome google-chrome-stable firefox nvidia-smi \
                gcc cc clang make git java go rustc; do command -v \"$t\" >/dev/null 2>&1 && echo \"$t\"; \
                done; true",
    },
];

const MARK_BEGIN: &str = "@@aviary-probe:begin ";
const MARK_END: &str = "@@aviary-probe:end ";

/// All of [`PROBE_COMMANDS`] as one `sh` script whose stdout
/// [`ProbeOutputs::parse_script_output`] splits again: one exec instead of eight.
pub fn probe_script() -> String {
    let mut s = String::new();
    for p in PROBE_COMMANDS {
        s.push_str(&format!(
            "echo '{MARK_BEGIN}{key}'; ( {cmd} ) </dev/null; printf '\\n{MARK_END}{key} %d\\n' \"$?\"\n",
            key = p.key,
            cmd = p.shell
        ));
    }
    s
}

/// The output of one probe command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeOutput {
    pub exit_code: i32,
    pub stdout: String,
}

/// Outputs of the probe commands that ran; a missing key is a probe that did
/// not run (treated like a missing tool).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeOutputs {
    pub outputs: BTreeMap<ProbeKey, ProbeOutput>,
}

impl ProbeOutputs {
    pub fn insert(&mut self, key: ProbeKey, exit_code: i32, stdout: impl Into<String>) {
        self.outputs.insert(
            key,
            ProbeOutput {
                exit_code,
                stdout: stdout.into(),
            },
        );
    }

    pub fn get(&self, key: ProbeKey) -> Option<&ProbeOutput> {
        self.outputs.get(&key)
    }

    /// Splits the stdout of [`probe_script`]. Sections without an end marker
    /// (output cut short) are dropped; the first section of a key wins.
    pub fn parse_script_output(stdout: &str) -> ProbeOutputs {
        let mut out = ProbeOutputs::default();
        let mut current: Option<(ProbeKey, Vec<&str>)> = None;
        for line in stdout.split('\n') {
            if let Some(key) = line.strip_prefix(MARK_BEGIN).and_then(ProbeKey::parse) {
                current = Some((key, Vec::new()));
                continue;
            }
            if let Some(rest) = line.strip_prefix(MARK_END) {
                let mut parts = rest.split(' ');
                let key = parts.next().and_then(ProbeKey::parse);
                let code = parts.next().and_then(|c| c.trim().parse::<i32>().ok());
                if let (Some((open, lines)), Some(key), Some(code)) = (current.take(), key, code) {
                    if open == key && !out.outputs.contains_key(&key) {
                        // The newline printed before the end marker is the
                        // separator of the last piece, so joining restores
                        // the command's output exactly.
                        let body = lines.join("\n");
                        out.insert(key, code, body);
                    }
                }
                continue;
            }
            if let Some((_, lines)) = current.as_mut() {
                lines.push(line);
            }
        }
        out
    }
}

/// A sandbox's environment: what its template was, what the agent installed on
/// top and how dirty it is. Stored per sandbox and per snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EnvironmentManifest {
    /// Digest of the template the sandbox was made from.
    pub base_template_digest: String,
    /// Default version per language runtime (`python` → `3.12.4`, `node` → `20.11.1`).
    #[serde(default)]
    pub runtimes: BTreeMap<String, String>,
    /// Every Python interpreter found (full versions), the default included:
    /// the interpreters a new virtualenv could use.
    #[serde(default)]
    pub python_interpreters: BTreeSet<String>,
    /// `None` when the tool is missing.
    #[serde(default)]
    pub pip: Option<PackageSet>,
    #[serde(default)]
    pub npm: Option<PackageSet>,
    #[serde(default)]
    pub apt: Option<PackageSet>,
    /// Tools and what they imply (`chromium`, `browser`, `gpu`, `compiler`, …).
    #[serde(default)]
    pub capabilities: BTreeSet<String>,
    /// Changed paths outside ephemeral state, collapsed to their top two
    /// components (`/workspace`, `/opt/venv`, `/usr/local`).
    #[serde(default)]
    pub dirty_paths: Vec<String>,
    #[serde(default)]
    #[schema(value_type = u8, minimum = 0, maximum = 3)]
    pub dirty_level: DirtyLevel,
    #[serde(default)]
    pub workspace_id: Option<String>,
    #[serde(default)]
    pub last_snapshot_id: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: OffsetDateTime,
    /// The fresh virtual environment a `new_venv` hand-out made for the
    /// task the sandbox serves now: its execs run with it first on `PATH`.
    /// Not probed: the control plane sets it and carries it across probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_venv: Option<ActiveVenv>,
}

/// A virtual environment made inside a reused sandbox for one task's
/// dependencies (the checker's `new_venv`), so an earlier task's
/// conflicting packages are not on its path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ActiveVenv {
    /// The venv's directory inside the sandbox (`VIRTUAL_ENV`).
    pub path: String,
    /// The Python version it was made with.
    pub python: String,
    /// A fresh npm prefix (its `lib/node_modules` is `NODE_PATH`), when the
    /// sandbox has Node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_prefix: Option<String>,
    /// The session it was made for: a hand-out to another session drops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

impl ActiveVenv {
    /// The environment an exec in this venv gets (`PATH` with the venv's
    /// `bin` first, before `default_path`).
    pub fn exec_env(&self, default_path: &str) -> Vec<(String, String)> {
        let mut path = format!("{}/bin", self.path);
        let mut env = vec![("VIRTUAL_ENV".to_owned(), self.path.clone())];
        if let Some(prefix) = &self.node_prefix {
            path.push_str(&format!(":{prefix}/bin"));
            env.push(("NODE_PATH".to_owned(), format!("{prefix}/lib/node_modules")));
            env.push(("npm_config_prefix".to_owned(), prefix.clone()));
        }
        env.push(("PATH".to_owned(), format!("{path}:{default_path}")));
        env
    }
}

fn python_version(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next()? == "Python")
            .then(|| words.next())
            .flatten()
            .filter(|v| v.starts_with(|c: char| c.is_ascii_digit()))
            .map(str::to_owned)
    })
}

fn parse_pip_freeze(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('-') {
            continue;
        }
        let (name, version) = if let Some((n, v)) = line.split_once("===") {
            (n, v)
        } else if let Some((n, v)) = line.split_once("==") {
            (n, v)
        } else if let Some((n, _url)) = line.split_once(" @ ") {
            (n, "")
        } else {
            continue;
        };
        let name = Ecosystem::Pip.normalize_name(name);
        if !name.is_empty() {
            out.insert(name, version.trim().to_owned());
        }
    }
    out
}

fn parse_npm_ls(text: &str, into: &mut BTreeMap<String, String>) -> bool {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return false;
    };
    if let Some(deps) = value.get("dependencies").and_then(|d| d.as_object()) {
        for (name, info) in deps {
            let version = info
                .get("version")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            into.insert(Ecosystem::Npm.normalize_name(name), version.to_owned());
        }
    }
    true
}

fn parse_dpkg(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let mut f = line.split('\t');
        let (Some(status), Some(name), Some(version)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        // `ii`: wanted install, installed. Removed packages with leftover
        // config files (`rc`) are not installed.
        if status.trim_end().starts_with("ii") {
            out.insert(
                Ecosystem::Apt.normalize_name(name),
                version.trim().to_owned(),
            );
        }
    }
    out
}

/// Folds changed paths into collapsed dirty paths and the highest level.
#[derive(Default)]
struct DirtyAccumulator {
    level: DirtyLevel,
    roots: BTreeSet<String>,
}

impl DirtyAccumulator {
    fn add(&mut self, path: &str) {
        let l = DirtyLevel::of_path(path);
        self.level = self.level.max(l);
        if l == DirtyLevel::Clean {
            return;
        }
        let comps: Vec<&str> = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        let take = if l == DirtyLevel::Workspace && comps.first() == Some(&"workspace") {
            1
        } else {
            2
        };
        self.roots
            .insert(format!("/{}", comps[..take.min(comps.len())].join("/")));
    }

    fn store(self, m: &mut EnvironmentManifest) {
        m.dirty_paths = self.roots.into_iter().collect();
        m.dirty_level = self.level;
    }
}

impl EnvironmentManifest {
    /// An empty manifest of a fresh sandbox of the template `base_template_digest`.
    pub fn new(base_template_digest: impl Into<String>, updated_at: OffsetDateTime) -> Self {
        EnvironmentManifest {
            base_template_digest: base_template_digest.into(),
            runtimes: BTreeMap::new(),
            python_interpreters: BTreeSet::new(),
            pip: None,
            npm: None,
            apt: None,
            capabilities: BTreeSet::new(),
            dirty_paths: Vec::new(),
            dirty_level: DirtyLevel::Clean,
            workspace_id: None,
            last_snapshot_id: None,
            updated_at,
            active_venv: None,
        }
    }

    /// Builds a manifest from the probe's outputs. Missing tools leave their
    /// fields empty; garbage output is ignored line by line. Dirty paths,
    /// workspace and snapshot ids are not probed: set them with
    /// [`Self::with_changed_paths`] and the public fields.
    pub fn from_probe_outputs(
        base_template_digest: impl Into<String>,
        outputs: &ProbeOutputs,
        updated_at: OffsetDateTime,
    ) -> Self {
        let mut m = EnvironmentManifest::new(base_template_digest, updated_at);
        let ok = |key| {
            outputs
                .get(key)
                .filter(|o| o.exit_code == 0)
                .map(|o| o.stdout.as_str())
        };

        if let Some(v) = ok(ProbeKey::Python).and_then(python_version) {
            m.python_interpreters.insert(v.clone());
            m.runtimes.insert("python".into(), v);
        }
        if let Some(o) = outputs.get(ProbeKey::PythonInterpreters) {
            for line in o.stdout.lines() {
                if let Some(v) = python_version(line) {
                    m.python_interpreters.insert(v);
                }
            }
        }
        if let Some(text) = ok(ProbeKey::Pip) {
            m.pip = Some(PackageSet::new(parse_pip_freeze(text)));
        }
        if let Some(v) = ok(ProbeKey::Node)
            .and_then(|t| t.lines().next())
            .map(|l| l.trim().trim_start_matches('v'))
            .filter(|v| v.starts_with(|c: char| c.is_ascii_digit()))
        {
            m.runtimes.insert("node".into(), v.to_owned());
        }
        // `npm ls` exits non-zero for extraneous or missing packages but still
        // prints its JSON, so the exit code is not consulted.
        let mut npm = BTreeMap::new();
        let mut npm_seen = false;
        for key in [ProbeKey::NpmGlobal, ProbeKey::NpmWorkspace] {
            if let Some(o) = outputs.get(key) {
                npm_seen |= parse_npm_ls(&o.stdout, &mut npm);
            }
        }
        if npm_seen {
            m.npm = Some(PackageSet::new(npm));
        }
        if let Some(text) = ok(ProbeKey::Apt) {
            m.apt = Some(PackageSet::new(parse_dpkg(text)));
        }
        if let Some(o) = outputs.get(ProbeKey::Tools) {
            for line in o.stdout.lines() {
                if let Some((tool, capability)) = TOOLS.iter().find(|(t, _)| *t == line.trim()) {
                    m.capabilities.insert((*tool).to_owned());
                    m.capabilities.insert((*capability).to_owned());
                }
            }
        }
        m
    }

    /// Records the paths the sandbox changed relative to its template:
    /// collapses them into `dirty_paths` and sets `dirty_level` to the highest
    /// level among them. The list replaces the previous one.
    pub fn with_changed_paths<I, S>(mut self, changed: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut acc = DirtyAccumulator::default();
        for p in changed {
            acc.add(p.as_ref());
        }
        acc.store(&mut self);
        self
    }

    /// Like [`Self::with_changed_paths`], with the changes read from the
    /// sandbox's overlayfs upper directory on the host: every entry that is
    /// not a directory (files, symlinks, whiteouts of deleted files) and every
    /// empty directory is a changed path. Symlinks are not followed; memory
    /// stays bounded by the number of collapsed dirty paths, not of files.
    pub fn with_upper_dir(mut self, upper: &Path) -> std::io::Result<Self> {
        let mut acc = DirtyAccumulator::default();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let mut empty = true;
            for entry in std::fs::read_dir(upper.join(&rel))? {
                let entry = entry?;
                empty = false;
                let child = rel.join(entry.file_name());
                if entry.file_type()?.is_dir() {
                    stack.push(child);
                } else {
                    acc.add(&format!("/{}", child.to_string_lossy()));
                }
            }
            if empty && !rel.as_os_str().is_empty() {
                acc.add(&format!("/{}", rel.to_string_lossy()));
            }
        }
        acc.store(&mut self);
        Ok(self)
    }

    /// Names of everything installed: pip, npm and apt packages plus
    /// capabilities (the seed's `installed_capabilities`).
    pub fn installed_capabilities(&self) -> BTreeSet<String> {
        let mut out = self.capabilities.clone();
        for set in [&self.pip, &self.npm, &self.apt].into_iter().flatten() {
            out.extend(set.packages.keys().cloned());
        }
        out
    }

    pub fn package_set(&self, ecosystem: Ecosystem) -> Option<&PackageSet> {
        match ecosystem {
            Ecosystem::Pip => self.pip.as_ref(),
            Ecosystem::Npm => self.npm.as_ref(),
            Ecosystem::Apt => self.apt.as_ref(),
        }
    }

    /// The installed version of a package, `None` when it is not installed.
    pub fn installed_version(&self, ecosystem: Ecosystem, name: &str) -> Option<&str> {
        self.package_set(ecosystem)?.version_of(name)
    }

    /// Whether `req` is installed in a matching version.
    pub fn satisfies(&self, req: &PackageRequirement) -> bool {
        self.installed_version(req.ecosystem, &req.name)
            .is_some_and(|v| req.version.matches(v))
    }

    /// The first Python interpreter matching `req` (the default one first).
    pub fn python_matching(&self, req: &VersionReq) -> Option<&str> {
        self.runtimes
            .get("python")
            .filter(|v| req.matches(v))
            .or_else(|| {
                self.python_interpreters
                    .iter()
                    .rev()
                    .find(|v| req.matches(v))
            })
            .map(String::as_str)
    }

    /// A stable hash over runtime versions, interpreters, package sets and
    /// capabilities: equal environments (for reuse) have equal fingerprints.
    /// Dirty paths, ids and timestamps do not take part. `env-` + 32 hex digits.
    pub fn dependency_fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"aviary-env-v1\n");
        for (lang, v) in &self.runtimes {
            h.update(format!("runtime {lang} {v}\n").as_bytes());
        }
        for v in &self.python_interpreters {
            h.update(format!("python-interpreter {v}\n").as_bytes());
        }
        for (eco, set) in [("pip", &self.pip), ("npm", &self.npm), ("apt", &self.apt)] {
            match set {
                Some(s) => h.update(format!("{eco} {}\n", s.hash).as_bytes()),
                None => h.update(format!("{eco} absent\n").as_bytes()),
            }
        }
        for c in &self.capabilities {
            h.update(format!("capability {c}\n").as_bytes());
        }
        let digest = h.finalize();
        format!("env-{}", hex::encode(&digest[..16]))
    }

    /// The registry row of this manifest (`sandbox_environment`).
    pub fn to_record(&self, sandbox_id: SandboxId, environment_version: i64) -> EnvironmentRecord {
        EnvironmentRecord {
            sandbox_id,
            base_image_digest: self.base_template_digest.clone(),
            dependency_hash: self.dependency_fingerprint(),
            workspace_id: self.workspace_id.clone(),
            snapshot_id: self.last_snapshot_id.clone(),
            environment_version,
            dirty_level: i32::from(self.dirty_level.as_u8()),
            manifest: serde_json::to_value(self).unwrap_or_default(),
        }
    }

    /// The manifest stored in a record by [`Self::to_record`], if any.
    pub fn from_record(record: &EnvironmentRecord) -> Option<EnvironmentManifest> {
        serde_json::from_value(record.manifest.clone()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::process::Command;

    fn at() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    #[test]
    fn parses_typical_probe_outputs() {
        let mut o = ProbeOutputs::default();
        o.insert(ProbeKey::Python, 0, "Python 3.12.4\n");
        o.insert(
            ProbeKey::PythonInterpreters,
            0,
            "Python 3.12.4\nPython 3.9.18\n",
        );
        o.insert(
            ProbeKey::Pip,
            0,
            "openpyxl==3.1.2\npandas==2.2.2\n-e git+https://x/y.git#egg=z\n\
             Typing_Extensions==4.12.0\nlocalpkg @ file:///tmp/localpkg\ngarbage line\n",
        );
        o.insert(ProbeKey::Node, 0, "v20.11.1\n");
        o.insert(
            ProbeKey::NpmGlobal,
            1, // npm ls exits 1 on extraneous packages; the JSON still counts
            r#"{"name":"lib","dependencies":{"npm":{"version":"10.2.4"},"@playwright/test":{"version":"1.40.0"}}}"#,
        );
        o.insert(
            ProbeKey::Apt,
            0,
            "ii \tlibc6:amd64\t2.36-9+deb12u4\nrc \told-pkg\t1.0\nii \tpython3\t3.11.2-1+b1\n",
        );
        o.insert(ProbeKey::Tools, 0, "chromium\ngcc\nmake\nnot-a-tool\n");
        let m = EnvironmentManifest::from_probe_outputs("sha256:tpl", &o, at());
        assert_eq!(m.runtimes["python"], "3.12.4");
        assert_eq!(m.runtimes["node"], "20.11.1");
        assert_eq!(
            m.python_interpreters.iter().collect::<Vec<_>>(),
            ["3.12.4", "3.9.18"]
        );
        let pip = m.pip.as_ref().unwrap();
        assert_eq!(pip.version_of("pandas"), Some("2.2.2"));
        assert_eq!(pip.version_of("typing-extensions"), Some("4.12.0"));
        assert_eq!(pip.version_of("localpkg"), Some(""));
        assert_eq!(pip.packages.len(), 4);
        assert_eq!(
            m.installed_version(Ecosystem::Npm, "@playwright/test"),
            Some("1.40.0")
        );
        assert_eq!(
            m.installed_version(Ecosystem::Apt, "libc6"),
            Some("2.36-9+deb12u4")
        );
        assert_eq!(m.installed_version(Ecosystem::Apt, "old-pkg"), None);
        assert!(m.capabilities.contains("browser"));
        assert!(m.capabilities.contains("compiler"));
        assert!(!m.capabilities.contains("not-a-tool"));
        assert!(m.installed_capabilities().contains("openpyxl"));
    }

    #[test]
    fn missing_tools_leave_fields_empty() {
        let mut o = ProbeOutputs::default();
        o.insert(ProbeKey::Python, 127, "sh: 1: python3: not found\n");
        o.insert(ProbeKey::Pip, 127, "");
        o.insert(ProbeKey::Node, 127, "");
        o.insert(ProbeKey::NpmGlobal, 127, "");
        o.insert(ProbeKey::Apt, 0, "");
        let m = EnvironmentManifest::from_probe_outputs("sha256:tpl", &o, at());
        assert!(m.runtimes.is_empty());
        assert!(m.pip.is_none());
        assert!(m.npm.is_none());
        // dpkg ran and listed nothing: an empty set, not an absent one.
        assert_eq!(m.apt.as_ref().unwrap().packages.len(), 0);
        let empty =
            EnvironmentManifest::from_probe_outputs("sha256:tpl", &ProbeOutputs::default(), at());
        assert!(empty.apt.is_none());
        assert_ne!(m.dependency_fingerprint(), empty.dependency_fingerprint());
    }

    #[test]
    fn probe_script_runs_on_this_host_and_parses() {
        // The real thing: the script under /bin/sh on this Debian host, whose
        // dpkg database is always present.
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(probe_script())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let outputs = ProbeOutputs::parse_script_output(&stdout);
        assert_eq!(outputs.outputs.len(), ProbeKey::ALL.len(), "{stdout}");
        let m = EnvironmentManifest::from_probe_outputs("sha256:host", &outputs, at());
        let apt = m.apt.as_ref().expect("dpkg-query on a Debian host");
        assert!(
            apt.packages.contains_key("dpkg"),
            "{:?}",
            apt.packages.keys().take(5).collect::<Vec<_>>()
        );
        // Cross-check against the tools directly, where they exist.
        if let Ok(py) = Command::new("python3").arg("-V").output() {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&py.stdout),
                String::from_utf8_lossy(&py.stderr)
            );
            assert_eq!(m.runtimes.get("python").cloned(), python_version(&text));
        } else {
            assert!(!m.runtimes.contains_key("python"));
        }
        if let Some(freeze) = Command::new("python3")
            .args(["-m", "pip", "freeze", "--all"])
            .output()
            .ok()
            .filter(|o| o.status.success())
        {
            // The fast importlib probe agrees with pip freeze.
            let pip = m.pip.as_ref().unwrap();
            let want = parse_pip_freeze(&String::from_utf8_lossy(&freeze.stdout));
            assert!(!want.is_empty());
            for (name, version) in want {
                assert_eq!(pip.version_of(&name), Some(version.as_str()), "{name}");
            }
        }
        if let Ok(node) = Command::new("node").arg("-v").output() {
            let v = String::from_utf8_lossy(&node.stdout)
                .trim()
                .trim_start_matches('v')
                .to_owned();
            assert_eq!(m.runtimes.get("node"), Some(&v));
        }
        // Probing twice gives the same fingerprint.
        let again = Command::new("/bin/sh")
            .arg("-c")
            .arg(probe_script())
            .output()
            .unwrap();
        let m2 = EnvironmentManifest::from_probe_outputs(
            "sha256:host",
            &ProbeOutputs::parse_script_output(&String::from_utf8_lossy(&again.stdout)),
            at(),
        );
        assert_eq!(m.dependency_fingerprint(), m2.dependency_fingerprint());
    }

    #[test]
    fn script_parser_keeps_output_without_trailing_newline() {
        let text = "@@aviary-probe:begin node\nv20.1.0\n\n@@aviary-probe:end node 0\n\
                    @@aviary-probe:begin python\nPython 3.9.1\n@@aviary-probe:end python 0\n\
                    @@aviary-probe:begin pip\npandas==1.5.0\n";
        let o = ProbeOutputs::parse_script_output(text);
        assert_eq!(o.get(ProbeKey::Node).unwrap().stdout, "v20.1.0\n");
        assert_eq!(o.get(ProbeKey::Python).unwrap().stdout, "Python 3.9.1");
        // Cut short: no end marker, no output.
        assert!(o.get(ProbeKey::Pip).is_none());
    }

    #[test]
    fn dirty_levels_classify_paths() {
        use DirtyLevel::*;
        for (p, l) in [
            ("/tmp/x", Clean),
            ("/var/log/apt/history.log", Clean),
            ("/root/.cache/pip/http/1", Clean),
            ("/workspace/data.xlsx", Workspace),
            (
                "/opt/venv/lib/python3.12/site-packages/pandas/__init__.py",
                Dependencies,
            ),
            ("/usr/local/lib/python3.12/site-packages/x.py", Dependencies),
            ("/var/lib/dpkg/status", Dependencies),
            ("/workspace/node_modules/x/index.js", Workspace),
            (
                "/home/u/.local/lib/python3.12/site-packages/a.py",
                Dependencies,
            ),
            ("/srv/app/node_modules/a/b.js", Dependencies),
            ("/etc/passwd", Unknown),
            ("/root/.bashrc", Unknown),
            ("/home/u/.ssh/authorized_keys", Unknown),
            ("/bin/sh", Unknown),
        ] {
            assert_eq!(DirtyLevel::of_path(p), l, "{p}");
        }
        let m = EnvironmentManifest::new("d", at()).with_changed_paths([
            "/tmp/a",
            "/workspace/a/b.csv",
            "/opt/venv/bin/python",
            "/opt/venv/lib/x",
        ]);
        assert_eq!(m.dirty_paths, ["/opt/venv", "/workspace"]);
        assert_eq!(m.dirty_level, Dependencies);
        let m = m.with_changed_paths(["/etc/cron.d/evil"]);
        assert_eq!(m.dirty_level, Unknown);
        assert_eq!(m.dirty_paths, ["/etc/cron.d"]);
    }

    #[test]
    fn dirty_paths_from_a_real_overlay_upper_dir() {
        // The real thing: an overlay mount whose upper dir records what the
        // "sandbox" changed, including a whiteout for a deleted template file.
        let dir = tempfile::tempdir().unwrap();
        let (lower, upper, work, merged) = (
            dir.path().join("lower"),
            dir.path().join("upper"),
            dir.path().join("work"),
            dir.path().join("merged"),
        );
        for d in [&lower, &upper, &work, &merged] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::create_dir_all(lower.join("etc")).unwrap();
        std::fs::write(lower.join("etc/motd"), "hi").unwrap();
        std::fs::create_dir_all(lower.join("workspace")).unwrap();
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        let mounted = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&merged)
            .status();
        if !mounted.is_ok_and(|s| s.success()) {
            eprintln!("SKIP dirty_paths_from_a_real_overlay_upper_dir: cannot mount overlayfs here (needs root)");
            return;
        }
        let changes = || -> std::io::Result<()> {
            std::fs::write(merged.join("workspace/data.csv"), "a,b")?;
            std::fs::create_dir_all(merged.join("opt/venv/lib/site-packages/pandas"))?;
            std::fs::write(
                merged.join("opt/venv/lib/site-packages/pandas/__init__.py"),
                "",
            )?;
            std::fs::create_dir_all(merged.join("tmp/scratch"))?;
            Ok(())
        };
        /// Unmounts even when an assertion fails half-way.
        struct Mounted<'a>(&'a Path);
        impl Drop for Mounted<'_> {
            fn drop(&mut self) {
                let _ = Command::new("umount").arg(self.0).status();
            }
        }
        let mount = Mounted(&merged);
        changes().unwrap();
        let m = EnvironmentManifest::new("d", at())
            .with_upper_dir(&upper)
            .unwrap();
        assert_eq!(m.dirty_paths, ["/opt/venv", "/workspace"]);
        assert_eq!(m.dirty_level, DirtyLevel::Dependencies);
        // Deleting a template file leaves a whiteout: unknown pollution.
        std::fs::remove_file(merged.join("etc/motd")).unwrap();
        drop(mount);
        let m = m.with_upper_dir(&upper).unwrap();
        assert_eq!(m.dirty_paths, ["/etc/motd", "/opt/venv", "/workspace"]);
        assert_eq!(m.dirty_level, DirtyLevel::Unknown);
    }

    #[test]
    fn manifest_round_trips_and_maps_to_the_registry_row() {
        let mut m =
            EnvironmentManifest::new("sha256:abc", at()).with_changed_paths(["/workspace/a"]);
        m.runtimes.insert("python".into(), "3.12.4".into());
        m.pip = Some(PackageSet::new(
            [("pandas".to_owned(), "2.2.2".to_owned())].into(),
        ));
        m.workspace_id = Some("ws-392".into());
        m.last_snapshot_id = Some("snap-1".into());
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(json["dirty_level"], 1);
        let back: EnvironmentManifest = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
        let id = SandboxId::generate();
        let rec = m.to_record(id.clone(), 7);
        assert_eq!(rec.sandbox_id, id);
        assert_eq!(rec.base_image_digest, "sha256:abc");
        assert_eq!(rec.dependency_hash, m.dependency_fingerprint());
        assert_eq!(rec.dirty_level, 1);
        assert_eq!(rec.workspace_id.as_deref(), Some("ws-392"));
        assert_eq!(rec.snapshot_id.as_deref(), Some("snap-1"));
        serde_json::from_str::<EnvironmentManifest>(
            r#"{"base_template_digest":"d","dirty_level":4,"updated_at":"2026-01-01T00:00:00Z"}"#,
        )
        .unwrap_err();
    }

    #[test]
    fn openapi_schema_describes_the_manifest() {
        let schema =
            serde_json::to_value(<EnvironmentManifest as utoipa::PartialSchema>::schema()).unwrap();
        let props = &schema["properties"];
        assert_eq!(props["dirty_level"]["type"], "integer");
        assert_eq!(props["dirty_level"]["maximum"], 3);
        assert_eq!(props["updated_at"]["format"], "date-time");
        for field in [
            "base_template_digest",
            "runtimes",
            "pip",
            "npm",
            "apt",
            "capabilities",
            "dirty_paths",
            "workspace_id",
            "last_snapshot_id",
        ] {
            assert!(props.get(field).is_some(), "{field} missing from {schema}");
        }
        let decision =
            serde_json::to_value(<crate::ReuseDecision as utoipa::PartialSchema>::schema())
                .unwrap();
        assert_eq!(
            decision["properties"]["install"]["items"]["$ref"],
            "#/components/schemas/PackageRequirement"
        );
    }

    fn packages() -> impl Strategy<Value = BTreeMap<String, String>> {
        prop::collection::btree_map("[a-z]{1,8}", "[0-9]{1,2}\\.[0-9]{1,2}", 0..8)
    }

    proptest! {
        #[test]
        fn fingerprint_ignores_order_and_volatile_fields(pkgs in packages(), ws in "[a-z]{0,5}") {
            let mut a = EnvironmentManifest::new("d", at());
            a.pip = Some(PackageSet::new(pkgs.clone()));
            let freeze: String = pkgs.iter().rev().map(|(n, v)| format!("{n}=={v}\n")).collect();
            let mut o = ProbeOutputs::default();
            o.insert(ProbeKey::Pip, 0, freeze);
            let mut b = EnvironmentManifest::from_probe_outputs("other-digest", &o, at() + time::Duration::hours(1));
            b.workspace_id = Some(ws);
            b = b.with_changed_paths(["/workspace/x"]);
            prop_assert_eq!(a.dependency_fingerprint(), b.dependency_fingerprint());
        }

        #[test]
        fn fingerprint_changes_with_any_version(pkgs in packages(), bump in 0usize..8) {
            prop_assume!(!pkgs.is_empty());
            let mut changed = pkgs.clone();
            let key = changed.keys().nth(bump % pkgs.len()).unwrap().clone();
            changed.get_mut(&key).unwrap().push_str(".1");
            let mut a = EnvironmentManifest::new("d", at());
            a.pip = Some(PackageSet::new(pkgs));
            let mut b = a.clone();
            b.pip = Some(PackageSet::new(changed));
            prop_assert_ne!(a.dependency_fingerprint(), b.dependency_fingerprint());
        }

        #[test]
        fn probe_parsers_accept_any_bytes(text in ".{0,200}", code in -1i32..3) {
            let mut o = ProbeOutputs::default();
            for k in ProbeKey::ALL {
                o.insert(k, code, text.clone());
            }
            let _ = EnvironmentManifest::from_probe_outputs("d", &o, at());
            let _ = ProbeOutputs::parse_script_output(&text);
            let _ = DirtyLevel::of_path(&text);
        }
    }
}
