use super::*;

const ORIGIN: &str = "aviary.toml";

/// A small valid file; the error tests each break one line of it.
const BASE: &str = r#"[server]
listen = "127.0.0.1:7500"
default_class = "small"

[[network_profile]]
name = "none"
kind = "none"

[[network_profile]]
name = "pypi"
kind = "allowlist"
allow = ["pypi.org", "*.pythonhosted.org"]

[[class]]
name = "small"
cpu = 1.0
memory_mb = 1024
disk_mb = 2048
pids = 128
network_profiles = ["none", "pypi"]

[[class]]
name = "big"
cpu = 4
memory_mb = 8192
disk_mb = 8192
pids = 1024
gpu = true
runtimes = ["crun"]

[[tenant]]
name = "acme"
max_sandboxes = 3
max_cpu = 6.0
max_memory_mb = 16384
allowed_classes = ["small"]
allowed_network_profiles = ["none"]
allowed_runtimes = ["crun"]

[[pool]]
class = "small"
template = "default"
runtime = "crun"
pool_min = 1
pool_max = 4
buffer_min = 1
buffer_max = 2
"#;

/// BASE with the first occurrence of `from` replaced by `to`.
fn edit(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "BASE has no {from:?}");
    BASE.replacen(from, to, 1)
}

/// 1-based line of the first occurrence of `needle` in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    let at = text.find(needle).unwrap();
    text[..at].matches('\n').count() + 1
}

#[track_caller]
fn expect_error(text: &str, line: usize, key: &str, message_part: &str) -> ConfigError {
    let err = Config::from_str(text, ORIGIN).unwrap_err();
    let shown = err.to_string();
    assert_eq!(
        err.position().map(|p| p.line),
        Some(line),
        "wrong line in: {shown}"
    );
    assert_eq!(err.key(), Some(key), "wrong key in: {shown}");
    assert!(
        shown.starts_with(&format!("{ORIGIN}:{line}:")),
        "no origin:line prefix: {shown}"
    );
    assert!(
        shown.contains(message_part),
        "{message_part:?} not in: {shown}"
    );
    err
}

#[test]
fn example_file_equals_the_builtin_defaults() {
    let parsed = Config::from_str(EXAMPLE_TOML, "aviary.example.toml").unwrap();
    assert_eq!(parsed, Config::default());
}

#[test]
fn example_file_on_disk_is_the_embedded_one() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../aviary.example.toml");
    let loaded = Config::load(&path).unwrap();
    assert_eq!(loaded, Config::default());
}

#[test]
fn defaults_ship_the_seed_classes_profiles_tenant_and_pool() {
    let c = Config::default();
    let limits = |n: &str| c.class(n).unwrap().limits();
    assert_eq!(
        limits("python-small"),
        ResourceLimits {
            cpu: 1.0,
            memory_mb: 2048,
            disk_mb: 10240,
            pids: 512
        }
    );
    assert_eq!(limits("python-ds").memory_mb, 4096);
    assert_eq!(limits("build-medium").cpu, 4.0);
    assert_eq!(limits("browser-medium").disk_mb, 30 * 1024);
    assert_eq!(limits("compute-large").memory_mb, 16 * 1024);
    assert_eq!(limits("compute-large").disk_mb, 50 * 1024);
    // aviary-core's default limits are python-small's.
    assert_eq!(limits("python-small"), ResourceLimits::default());
    assert_eq!(
        c.network_profile("pypi-readonly").unwrap().allow,
        ["pypi.org", "files.pythonhosted.org"]
    );
    assert_eq!(
        c.network_profile("none").unwrap().kind,
        NetworkProfile::None
    );
    assert_eq!(
        c.network_profile("open").unwrap().kind,
        NetworkProfile::Open
    );
    let t = c.tenant("default").unwrap();
    assert!(t.allowed_classes.allows_name("compute-large"));
    assert!(t.allowed_runtimes.allows(&Runtime::Runc));
    assert_eq!(c.pools.len(), 1);
    assert_eq!(c.pools[0].pool_min, 0);
    assert_eq!(c.server.default_class, "python-small");
}

#[test]
fn commented_llm_block_of_the_example_parses_when_uncommented() {
    let uncommented: String = EXAMPLE_TOML
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest)
                if rest.starts_with("[planner.llm]")
                    || ["base_url", "model", "api_key_env", "timeout_ms"]
                        .iter()
                        .any(|k| rest.starts_with(k)) =>
            {
                rest
            }
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let c = Config::from_str(&uncommented, "x").unwrap();
    let llm = c.planner.llm.unwrap();
    assert_eq!(llm.base_url, "http://127.0.0.1:8000/v1");
    assert_eq!(llm.model, "qwen2.5-7b-instruct");
    assert_eq!(llm.api_key_env.as_deref(), Some("AVIARY_LLM_API_KEY"));
    assert_eq!(llm.timeout_ms, 5000);
}

#[test]
fn base_file_parses_with_its_values() {
    let c = Config::from_str(BASE, ORIGIN).unwrap();
    assert_eq!(c.server.listen.port(), 7500);
    // Left-out server keys keep their defaults.
    assert_eq!(c.server.data_dir, PathBuf::from("/var/lib/aviary"));
    assert_eq!(c.classes.len(), 2);
    let small = c.class("small").unwrap();
    assert_eq!(small.runtimes, crate::local_runtimes());
    assert!(!small.gpu);
    let big = c.class("big").unwrap();
    assert_eq!(big.cpu, 4.0, "integers are accepted for cpu");
    assert!(big.gpu);
    assert_eq!(big.network_profiles, ["none"], "default profile list");
    let t = c.tenant("acme").unwrap();
    assert_eq!(t.allowed_classes, Allowed::Only(vec!["small".into()]));
    assert_eq!(t.allowed_runtimes, Allowed::Only(vec![Runtime::Crun]));
    assert!(!t.allowed_classes.allows_name("big"));
    // Sections left out take their defaults as a whole.
    assert_eq!(c.planner.history_window, 50);
    assert_eq!(
        c.overcommit,
        Overcommit {
            cpu_ratio: 4.0,
            memory_ratio: 1.5
        }
    );
}

#[test]
fn empty_file_is_the_default() {
    assert_eq!(Config::from_str("", ORIGIN).unwrap(), Config::default());
}

#[test]
fn syntax_error_names_line_and_column() {
    let text = edit("pids = 128", "pids = = 128");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    let pos = err.position().unwrap();
    assert_eq!(pos.line, line_of(&text, "pids = = 128"));
    assert_eq!(pos.column, 8, "{err}");
    assert!(matches!(err, ConfigError::ParseToml { .. }), "{err:?}");
}

#[test]
fn unclosed_table_header_is_a_syntax_error() {
    let text = edit("[[tenant]]", "[[tenant]");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "[[tenant]"));
}

#[test]
fn unknown_key_names_line_and_key() {
    let text = edit("pids = 128", "pids = 128\ncpus = 2");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "cpus = 2"));
    assert_eq!(err.key(), Some("class.cpus"));
    let shown = err.to_string();
    assert!(shown.contains("unknown field `cpus`"), "{shown}");
    assert!(shown.starts_with("aviary.toml:"), "{shown}");
}

#[test]
fn unknown_top_level_section_is_rejected() {
    let text = format!("{BASE}\n[sever]\nlisten = \"x\"\n");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "[sever]"));
    assert!(err.to_string().contains("unknown field `sever`"), "{err}");
}

#[test]
fn wrong_type_names_line_and_key() {
    let text = edit("memory_mb = 1024", "memory_mb = \"1G\"");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(
        err.position().unwrap().line,
        line_of(&text, "memory_mb = \"1G\"")
    );
    assert_eq!(err.key(), Some("class.memory_mb"));
    assert!(err.to_string().contains("invalid type"), "{err}");
}

#[test]
fn negative_unsigned_value_is_rejected_at_its_line() {
    let text = edit("max_sandboxes = 3", "max_sandboxes = -3");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(
        err.position().unwrap().line,
        line_of(&text, "max_sandboxes = -3")
    );
    assert_eq!(err.key(), Some("tenant.max_sandboxes"));
}

#[test]
fn unknown_runtime_is_rejected_at_its_line() {
    let text = edit(
        "runtime = \"crun\"\npool_min",
        "runtime = \"crux\"\npool_min",
    );
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "\"crux\""));
    assert!(err.to_string().contains("crux"), "{err}");
}

#[test]
fn missing_required_key_is_reported_in_its_table() {
    let text = edit("pids = 1024\n", "");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert!(err.to_string().contains("missing field `pids`"), "{err}");
}

#[test]
fn duplicate_class_name_points_at_the_second() {
    let text = edit("name = \"big\"", "name = \"small\"");
    let line = line_of(&text, "cpu = 4\n") - 1;
    expect_error(
        &text,
        line,
        "class[1].name",
        "class \"small\" is defined twice",
    );
}

#[test]
fn zero_or_negative_cpu_is_rejected() {
    for bad in ["cpu = 0.0", "cpu = -1.5", "cpu = nan", "cpu = inf"] {
        let text = edit("cpu = 1.0", bad);
        expect_error(
            &text,
            line_of(&text, bad),
            "class[0].cpu",
            "cpu must be > 0",
        );
    }
}

#[test]
fn zero_memory_disk_pids_are_rejected() {
    for (bad, key) in [
        ("memory_mb = 0", "class[0].memory_mb"),
        ("disk_mb = 0", "class[0].disk_mb"),
        ("pids = 0", "class[0].pids"),
    ] {
        let field = bad.split(' ').next().unwrap();
        let good = BASE
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap()
            .to_owned();
        let text = edit(&good, bad);
        expect_error(&text, line_of(&text, bad), key, "must be > 0");
    }
}

#[test]
fn empty_runtime_list_is_rejected() {
    let text = edit("runtimes = [\"crun\"]", "runtimes = []");
    expect_error(
        &text,
        line_of(&text, "runtimes = []"),
        "class[1].runtimes",
        "must not be empty",
    );
}

#[test]
fn class_naming_an_unknown_network_profile_is_rejected() {
    let text = edit(
        "network_profiles = [\"none\", \"pypi\"]",
        "network_profiles = [\"none\",\n  \"pypy\"]",
    );
    expect_error(
        &text,
        line_of(&text, "\"pypy\""),
        "class[0].network_profiles",
        "network profile \"pypy\" is not defined",
    );
}

#[test]
fn invalid_class_name_is_rejected() {
    let text = edit("name = \"big\"", "name = \"Big Class!\"");
    expect_error(
        &text,
        line_of(&text, "Big Class"),
        "class[1].name",
        "is invalid",
    );
}

#[test]
fn pool_min_above_pool_max_is_rejected() {
    let text = edit("pool_min = 1", "pool_min = 9");
    expect_error(
        &text,
        line_of(&text, "pool_min = 9"),
        "pool[0].pool_min",
        "pool_min (9) > pool_max (4)",
    );
}

#[test]
fn buffer_min_above_buffer_max_is_rejected() {
    let text = edit("buffer_min = 1", "buffer_min = 3");
    expect_error(
        &text,
        line_of(&text, "buffer_min = 3"),
        "pool[0].buffer_min",
        "buffer_min (3) > buffer_max (2)",
    );
}

#[test]
fn buffer_max_above_pool_max_is_rejected() {
    let text = edit("buffer_max = 2", "buffer_max = 5");
    expect_error(
        &text,
        line_of(&text, "buffer_max = 5"),
        "pool[0].buffer_max",
        "buffer_max (5) > pool_max (4)",
    );
}

#[test]
fn pool_for_unknown_class_is_rejected() {
    let text = edit("class = \"small\"\ntemplate", "class = \"tiny\"\ntemplate");
    expect_error(
        &text,
        line_of(&text, "\"tiny\""),
        "pool[0].class",
        "class \"tiny\" is not defined",
    );
}

#[test]
fn pool_on_a_runtime_the_class_does_not_allow_is_rejected() {
    let text = format!(
        "{BASE}\n[[pool]]\nclass = \"big\"\ntemplate = \"default\"\nruntime = \"runc\"\npool_min = 0\npool_max = 1\nbuffer_min = 0\nbuffer_max = 1\n"
    );
    expect_error(
        &text,
        line_of(&text, "runtime = \"runc\""),
        "pool[1].runtime",
        "does not allow runtime runc",
    );
}

#[test]
fn duplicate_pool_is_rejected() {
    let pool = &BASE[BASE.find("[[pool]]").unwrap()..];
    let text = format!("{BASE}\n{pool}");
    let second = BASE.len() + 1 + pool.find("class").unwrap();
    let line = text[..second].matches('\n').count() + 1;
    expect_error(&text, line, "pool[1].class", "defined twice");
}

#[test]
fn tenant_allowing_an_unknown_class_is_rejected() {
    let text = edit(
        "allowed_classes = [\"small\"]",
        "allowed_classes = [\"small\", \"huge\"]",
    );
    let err = expect_error(
        &text,
        line_of(&text, "\"huge\""),
        "tenant[0].allowed_classes",
        "tenant \"acme\": class \"huge\" is not defined",
    );
    // The column points at the offending element, not the key.
    let col = text
        .lines()
        .nth(line_of(&text, "\"huge\"") - 1)
        .unwrap()
        .find("\"huge\"")
        .unwrap()
        + 1;
    assert_eq!(err.position().unwrap().column, col);
}

#[test]
fn tenant_allowing_an_unknown_profile_or_runtime_is_rejected() {
    let text = edit(
        "allowed_network_profiles = [\"none\"]",
        "allowed_network_profiles = [\"wifi\"]",
    );
    expect_error(
        &text,
        line_of(&text, "\"wifi\""),
        "tenant[0].allowed_network_profiles",
        "network profile \"wifi\"",
    );
    let text = edit(
        "allowed_runtimes = [\"crun\"]",
        "allowed_runtimes = [\"kata\"]",
    );
    expect_error(
        &text,
        line_of(&text, "\"kata\""),
        "tenant[0].allowed_runtimes",
        "unknown runtime \"kata\"",
    );
}

#[test]
fn allowed_list_must_be_star_or_a_list() {
    let text = edit("allowed_classes = [\"small\"]", "allowed_classes = \"all\"");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "\"all\""));
    assert!(
        err.to_string().contains(r#""*" or a list of names"#),
        "{err}"
    );
}

#[test]
fn star_allows_everything() {
    let text = edit("allowed_classes = [\"small\"]", "allowed_classes = \"*\"");
    let c = Config::from_str(&text, ORIGIN).unwrap();
    assert_eq!(c.tenant("acme").unwrap().allowed_classes, Allowed::All);
}

#[test]
fn duplicate_tenant_and_bad_quota_are_rejected() {
    let tenant = &BASE[BASE.find("[[tenant]]").unwrap()..BASE.find("[[pool]]").unwrap()];
    let text = format!("{BASE}\n{tenant}");
    let second = BASE.len() + 1 + tenant.find("name").unwrap();
    let line = text[..second].matches('\n').count() + 1;
    expect_error(
        &text,
        line,
        "tenant[1].name",
        "tenant \"acme\" is defined twice",
    );

    let text = edit("max_cpu = 6.0", "max_cpu = 0.0");
    expect_error(
        &text,
        line_of(&text, "max_cpu = 0.0"),
        "tenant[0].max_cpu",
        "max_cpu must be > 0",
    );
    let text = edit("max_memory_mb = 16384", "max_memory_mb = 0");
    expect_error(
        &text,
        line_of(&text, "max_memory_mb = 0"),
        "tenant[0].max_memory_mb",
        "must be > 0",
    );
}

#[test]
fn invalid_listen_address_is_rejected() {
    let text = edit("listen = \"127.0.0.1:7500\"", "listen = \"localhost\"");
    expect_error(
        &text,
        2,
        "server.listen",
        "listen \"localhost\" is not an address",
    );
}

#[test]
fn unknown_default_class_is_rejected() {
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"python-small\"",
    );
    expect_error(
        &text,
        3,
        "server.default_class",
        "default_class \"python-small\" is not a configured class",
    );
}

#[test]
fn default_class_left_out_must_still_exist() {
    let text = edit("default_class = \"small\"\n", "");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.default_class"));
    assert!(err.to_string().contains("python-small"), "{err}");
}

#[test]
fn builtin_pool_needs_its_class() {
    let text = edit("default_class = \"small\"", "default_class = \"small\"");
    let without_pools = &text[..text.find("[[pool]]").unwrap()];
    let err = Config::from_str(without_pools, ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("pool"));
    assert!(err.to_string().contains("pool = []"), "{err}");
    let c = Config::from_str(&format!("pool = []\n{without_pools}"), ORIGIN).unwrap();
    assert!(c.pools.is_empty());
}

#[test]
fn network_profile_rules() {
    let text = edit(
        "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
        "allow = []",
    );
    expect_error(
        &text,
        line_of(&text, "kind = \"allowlist\""),
        "network_profile[1].allow",
        "needs a non-empty allow list",
    );
    let text = edit("kind = \"none\"", "kind = \"none\"\nallow = [\"x.org\"]");
    expect_error(
        &text,
        line_of(&text, "\"x.org\""),
        "network_profile[0].allow",
        "allow is only for kind \"allowlist\"",
    );
    let text = edit("\"pypi.org\"", "\"https://pypi.org\"");
    expect_error(
        &text,
        line_of(&text, "https://"),
        "network_profile[1].allow",
        "is not a domain",
    );
    let text = edit("kind = \"none\"", "kind = \"closed\"");
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert_eq!(err.position().unwrap().line, line_of(&text, "\"closed\""));
    let text = edit("name = \"pypi\"", "name = \"none\"");
    expect_error(
        &text,
        line_of(&text, "kind = \"allowlist\"") - 1,
        "network_profile[1].name",
        "defined twice",
    );
}

#[test]
fn allowlist_profiles_carry_egress_rules() {
    let rules = "allow = [\"pypi.org\", \"*.pythonhosted.org\"]\ndeny = [\"evil.pythonhosted.org\"]\nmethods = { \"pypi.org\" = [\"GET\", \"HEAD\"] }\nresolve = { \"pypi.org\" = \"127.0.0.1:8080\", \"x.pythonhosted.org\" = \"10.1.2.3\" }\nmax_connections = 8\nidle_timeout_s = 30\nmax_header_bytes = 4096";
    let text = edit("allow = [\"pypi.org\", \"*.pythonhosted.org\"]", rules);
    let c = Config::from_str(&text, ORIGIN).unwrap();
    let p = c.network_profile("pypi").unwrap().egress_policy().unwrap();
    assert_eq!(p.profile, "pypi");
    assert_eq!(p.deny, ["evil.pythonhosted.org"]);
    assert_eq!(p.allow[0].domain, "pypi.org");
    assert_eq!(
        p.allow[0].methods.as_deref(),
        Some(&["GET".to_owned(), "HEAD".to_owned()][..])
    );
    assert_eq!(p.allow[1].methods, None);
    assert_eq!(p.resolve["pypi.org"], "127.0.0.1:8080");
    assert_eq!(
        (
            p.limits.max_connections,
            p.limits.idle_timeout_s,
            p.limits.max_header_bytes
        ),
        (8, 30, 4096)
    );
    assert_eq!(c.network_profile("none").unwrap().egress_policy(), None);
    // defaults when no limits are given
    let c = Config::from_str(BASE, ORIGIN).unwrap();
    let p = c.network_profile("pypi").unwrap().egress_policy().unwrap();
    assert_eq!(p.limits, aviary_core::egress::EgressLimits::default());

    for (from, to, needle, key, message) in [
        (
            "kind = \"none\"",
            "kind = \"none\"\ndeny = [\"x.org\"]",
            "deny =",
            "network_profile[0].deny",
            "only for kind \"allowlist\"",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\ndeny = [\"Evil.org\"]",
            "deny =",
            "network_profile[1].deny",
            "is not a domain",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nmethods = { \"other.org\" = [\"GET\"] }",
            "methods =",
            "network_profile[1].methods",
            "not in allow",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nmethods = { \"pypi.org\" = [\"get\"] }",
            "methods =",
            "network_profile[1].methods",
            "upper-case",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nmethods = { \"pypi.org\" = [] }",
            "methods =",
            "network_profile[1].methods",
            "non-empty",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nresolve = { \"pypi.org\" = \"localhost\" }",
            "resolve =",
            "network_profile[1].resolve",
            "not an IP address",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nresolve = { \"*.pypi.org\" = \"1.2.3.4\" }",
            "resolve =",
            "network_profile[1].resolve",
            "not a domain name",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nmax_connections = 0",
            "max_connections",
            "network_profile[1].max_connections",
            "between 1 and",
        ),
        (
            "allow = [\"pypi.org\", \"*.pythonhosted.org\"]",
            "allow = [\"pypi.org\"]\nmax_header_bytes = 100",
            "max_header_bytes",
            "network_profile[1].max_header_bytes",
            "between 1024 and",
        ),
        (
            "kind = \"none\"",
            "kind = \"none\"\nidle_timeout_s = 5",
            "idle_timeout_s",
            "network_profile[0].idle_timeout_s",
            "only for kind \"allowlist\"",
        ),
    ] {
        let text = edit(from, to);
        expect_error(&text, line_of(&text, needle), key, message);
    }
}

#[test]
fn planner_and_llm_rules() {
    let llm = "\n[planner]\nhistory_window = 20\n\n[planner.llm]\nbase_url = \"http://127.0.0.1:9/v1/\"\nmodel = \"m\"\napi_key = \"sk-secret\"\ntimeout_ms = 250\n";
    let c = Config::from_str(&format!("{BASE}{llm}"), ORIGIN).unwrap();
    assert_eq!(c.planner.history_window, 20);
    let l = c.planner.llm.clone().unwrap();
    assert_eq!(
        l.base_url, "http://127.0.0.1:9/v1",
        "trailing slash trimmed"
    );
    assert_eq!(l.resolve_api_key().as_deref(), Some("sk-secret"));
    assert!(
        !format!("{l:?}").contains("sk-secret"),
        "Debug must redact the key"
    );

    let text = format!("{BASE}{}", llm.replace("http://127.0.0.1:9/v1/", "ftp://x"));
    expect_error(
        &text,
        line_of(&text, "ftp://"),
        "planner.llm.base_url",
        "must be an http:// or https:// URL",
    );
    let text = format!(
        "{BASE}{}",
        llm.replace("timeout_ms = 250", "timeout_ms = 0")
    );
    expect_error(
        &text,
        line_of(&text, "timeout_ms = 0"),
        "planner.llm.timeout_ms",
        "timeout_ms must be",
    );
    let text = format!(
        "{BASE}{}",
        llm.replace("timeout_ms = 250", "api_key_env = \"K\"")
    );
    expect_error(
        &text,
        line_of(&text, "api_key_env"),
        "planner.llm.api_key_env",
        "not both",
    );
    let text = format!(
        "{BASE}{}",
        llm.replace("history_window = 20", "history_window = 0")
    );
    expect_error(
        &text,
        line_of(&text, "history_window = 0"),
        "planner.history_window",
        "history_window must be",
    );
    let text = format!("{BASE}{}", llm.replace("model = \"m\"\n", ""));
    let err = Config::from_str(&text, ORIGIN).unwrap_err();
    assert!(err.to_string().contains("missing field `model`"), "{err}");
}

#[test]
fn api_key_env_is_read_at_use_time() {
    let var = "AVIARY_CONFIG_TEST_LLM_KEY";
    let llm = LlmSettings {
        base_url: "http://x".into(),
        model: "m".into(),
        api_key: None,
        api_key_env: Some(var.into()),
        timeout_ms: 1,
    };
    // The variable is unique to this test, so no other test races on it.
    std::env::remove_var(var);
    assert_eq!(llm.resolve_api_key(), None);
    std::env::set_var(var, "from-env");
    assert_eq!(llm.resolve_api_key().as_deref(), Some("from-env"));
    std::env::remove_var(var);
}

#[test]
fn overcommit_rules_and_capacity() {
    let text = format!("{BASE}\n[overcommit]\ncpu_ratio = 2.5\n");
    let c = Config::from_str(&text, ORIGIN).unwrap();
    assert_eq!(c.overcommit.cpu_ratio, 2.5);
    assert_eq!(
        c.overcommit.memory_ratio, 1.5,
        "left-out key keeps its default"
    );
    assert_eq!(c.overcommit.cpu_capacity(2.0), 5.0);
    assert_eq!(c.overcommit.memory_capacity_mb(1000), 1500);
    let text = format!("{BASE}\n[overcommit]\nmemory_ratio = 0\n");
    expect_error(
        &text,
        line_of(&text, "memory_ratio = 0"),
        "overcommit.memory_ratio",
        "memory_ratio must be > 0",
    );
}

#[test]
fn load_reports_a_missing_file_and_names_the_path_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml");
    let err = Config::load(&missing).unwrap_err();
    assert!(matches!(err, ConfigError::ReadFile { .. }), "{err:?}");
    assert!(err.to_string().contains("nope.toml"));

    let path = dir.path().join("aviary.toml");
    let text = edit("cpu = 1.0", "cpu = 0.0");
    std::fs::write(&path, &text).unwrap();
    let err = Config::load(&path).unwrap_err();
    let shown = err.to_string();
    let line = line_of(&text, "cpu = 0.0");
    assert!(
        shown.starts_with(&format!(
            "{}:{line}:7: class \"small\": cpu must be > 0",
            path.display()
        )),
        "{shown}"
    );
}

#[test]
fn long_template_names_follow_the_template_store_rule() {
    let long = "t".repeat(128);
    let text = edit("template = \"default\"", &format!("template = \"{long}\""));
    assert_eq!(
        Config::from_str(&text, ORIGIN).unwrap().pools[0].template,
        long
    );
    let text = edit("template = \"default\"", &format!("template = \"{long}x\""));
    expect_error(
        &text,
        line_of(&text, &long),
        "pool[0].template",
        "template name",
    );
}

mod robustness {
    use super::*;
    use proptest::prelude::*;

    fn lines() -> Vec<&'static str> {
        EXAMPLE_TOML.lines().collect()
    }

    proptest! {
        /// Mangling the example (dropping, duplicating or replacing a line)
        /// never panics, and every error points inside the text.
        #[test]
        fn mangled_example_gives_a_config_or_a_located_error(
            at in 0usize..lines().len(),
            op in 0u8..3,
            junk in prop_oneof![
                Just("cpu = -1".to_owned()),
                Just("[[class]]".to_owned()),
                Just("name = \"python-small\"".to_owned()),
                Just("pool_max = 0".to_owned()),
                Just("allowed_classes = [\"x\"]".to_owned()),
                "[ -~]{0,40}",
            ],
        ) {
            let mut ls: Vec<String> = lines().into_iter().map(str::to_owned).collect();
            match op {
                0 => { ls.remove(at); }
                1 => { let l = ls[at].clone(); ls.insert(at, l); }
                _ => ls[at] = junk,
            }
            let text = ls.join("\n");
            match Config::from_str(&text, ORIGIN) {
                Ok(c) => prop_assert!(!c.classes.is_empty()),
                Err(e) => {
                    let pos = e.position().unwrap();
                    prop_assert!(pos.line >= 1 && pos.line <= ls.len() + 1, "{}", e);
                    prop_assert!(e.to_string().starts_with("aviary.toml:"), "{}", e);
                }
            }
        }

        /// Arbitrary text never panics the parser.
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
            if let Err(e) = Config::from_str(&text, ORIGIN) {
                prop_assert!(e.position().is_some());
            }
        }
    }
}

/// BASE plus `[[projection]]` tables, one per (host, sandbox).
fn with_projections(list: &[(&str, &str)]) -> String {
    let mut text = BASE.to_owned();
    for (host, sandbox) in list {
        text.push_str(&format!(
            "\n[[projection]]\nhost = {host:?}\nsandbox = {sandbox:?}\n"
        ));
    }
    text
}

#[test]
fn projections_parse_and_normalize() {
    let dir = tempfile::tempdir().unwrap();
    let skills = dir.path().join("skills");
    std::fs::create_dir(&skills).unwrap();
    let agents = dir.path().join("AGENTS.md");
    std::fs::write(&agents, "# agent\n").unwrap();
    let text = with_projections(&[
        (agents.to_str().unwrap(), "/workspace/AGENTS.md"),
        (skills.to_str().unwrap(), "/workspace/.agent/skills/"),
    ]);
    let c = Config::from_str(&text, ORIGIN).unwrap();
    assert_eq!(
        c.projections,
        [
            Projection {
                host: agents,
                sandbox: "/workspace/AGENTS.md".into()
            },
            Projection {
                host: skills,
                sandbox: "/workspace/.agent/skills".into()
            },
        ]
    );
    // Absent means none; an explicit empty list too.
    assert!(Config::from_str(BASE, ORIGIN)
        .unwrap()
        .projections
        .is_empty());
    let empty = format!("projection = []\n{BASE}");
    assert!(Config::from_str(&empty, ORIGIN)
        .unwrap()
        .projections
        .is_empty());
}

#[test]
fn bad_projections_name_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let skills = dir.path().join("skills");
    std::fs::create_dir(&skills).unwrap();
    let link = dir.path().join("etc-link");
    std::os::unix::fs::symlink("/etc", &link).unwrap();
    let skills = skills.to_str().unwrap();
    let missing = dir.path().join("nope");
    let missing = missing.to_str().unwrap();
    let link = link.to_str().unwrap();
    // (projections, text on the offending line, field, message part)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str, &'a str);
    let cases: [Case<'_>; 8] = [
        (
            &[("relative/skills", "/workspace/s")],
            "relative/skills",
            "host",
            "must be an absolute path",
        ),
        (
            &[(missing, "/workspace/s")],
            missing,
            "host",
            "cannot be read",
        ),
        (&[(link, "/workspace/s")], link, "host", "is a symlink"),
        (
            &[(skills, "/workspace/../etc")],
            "/workspace/../etc",
            "sandbox",
            "without `.`, `..`",
        ),
        (
            &[(skills, "workspace/s")],
            "workspace/s",
            "sandbox",
            "must be absolute",
        ),
        (&[(skills, "/")], "sandbox = \"/\"", "sandbox", "not `/`"),
        (
            &[(skills, "/run/aviary/x")],
            "/run/aviary/x",
            "sandbox",
            "which the platform owns",
        ),
        (
            &[(skills, "/workspace/s"), ("/etc", "/workspace/s/")],
            "/workspace/s/",
            "sandbox",
            "is a target twice",
        ),
    ];
    for (list, needle, field, message) in cases {
        let text = with_projections(list);
        let index = list.len() - 1;
        expect_error(
            &text,
            line_of(&text, needle),
            &format!("projection[{index}].{field}"),
            message,
        );
    }
}

#[test]
fn snapshot_stores_parse_and_incomplete_ones_name_their_line() {
    let s3 = "[snapshots]\nstore = \"s3\"\nendpoint = \"http://127.0.0.1:9000\"\nbucket = \"b\"\naccess_key_env = \"AK\"\nsecret_key_env = \"SK\"\n";
    let c = Config::from_str(s3, "t.toml").unwrap();
    assert!(
        matches!(c.snapshots.store, crate::SnapshotStore::S3 { ref bucket, .. } if bucket == "b")
    );
    let redis = "[snapshots]\nstore = \"redis\"\nurl = \"redis://127.0.0.1:6379/0\"\n";
    assert!(matches!(
        Config::from_str(redis, "t.toml").unwrap().snapshots.store,
        crate::SnapshotStore::Redis { .. }
    ));
    let text = "[snapshots]\nstore = \"s3\"\nendpoint = \"http://x:1\"\n";
    expect_error(
        text,
        line_of(text, "store = \"s3\""),
        "snapshots.bucket",
        "needs `bucket`",
    );
    let text = "[snapshots]\nstore = \"ftp\"\n";
    expect_error(
        text,
        line_of(text, "store = \"ftp\""),
        "snapshots.store",
        "must be local, s3, redis or postgres",
    );
    let text = "[snapshots]\nstore = \"local\"\nbukket = 1\n";
    let e = Config::from_str(text, "t.toml").unwrap_err();
    assert!(e.to_string().contains("bukket"), "{e}");
}

#[test]
fn edge_limits_parse_and_default_one_by_one() {
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"small\"\nheader_read_timeout_ms = 250\nmax_connections = 8\nrate_limit_per_s = 2.5\nmetrics_token_env = \"\"",
    );
    let c = Config::from_str(&text, ORIGIN).unwrap();
    let e = &c.server.edge;
    assert_eq!(e.header_read_timeout_ms, 250);
    assert_eq!(e.max_connections, 8);
    assert_eq!(e.rate_limit_per_s, 2.5);
    assert_eq!(
        e.metrics_token(),
        None,
        "empty variable name: admin keys only"
    );
    // the keys left out keep their defaults
    let d = crate::default_edge();
    assert_eq!(e.body_read_timeout_ms, d.body_read_timeout_ms);
    assert_eq!(e.rate_limit_burst, d.rate_limit_burst);
}

#[test]
fn bad_edge_limits_are_rejected() {
    for (line, key, message) in [
        (
            "header_read_timeout_ms = 0",
            "server.header_read_timeout_ms",
            "must be > 0",
        ),
        (
            "body_read_timeout_ms = 0",
            "server.body_read_timeout_ms",
            "must be > 0",
        ),
        (
            "max_connections = 0",
            "server.max_connections",
            "must be > 0",
        ),
        (
            "max_connections_per_ip = 0",
            "server.max_connections_per_ip",
            "must be > 0",
        ),
        (
            "rate_limit_burst = 0",
            "server.rate_limit_burst",
            "must be > 0",
        ),
        (
            "rate_limit_per_s = 0.0",
            "server.rate_limit_per_s",
            "must be a number > 0",
        ),
        (
            "rate_limit_per_s = nan",
            "server.rate_limit_per_s",
            "must be a number > 0",
        ),
        (
            "metrics_token_env = \"A=B\"",
            "server.metrics_token_env",
            "not an environment variable name",
        ),
        (
            "metrics_token_env = \"1X\"",
            "server.metrics_token_env",
            "not an environment variable name",
        ),
    ] {
        let text = edit(
            "default_class = \"small\"",
            &format!("default_class = \"small\"\n{line}"),
        );
        expect_error(&text, 4, key, message);
    }
}

#[test]
fn distributed_section_parses_and_bad_urls_name_their_line() {
    let text = "[distributed]\nregistry = \"postgres://aviary:${PGPASS}@127.0.0.1:5432/aviary\"\ncoordination = \"redis://127.0.0.1:6379/0\"\n";
    let c = Config::from_str(text, "t.toml").unwrap();
    assert!(c.distributed.is_distributed());
    assert_eq!(
        c.distributed.registry.as_ref().unwrap().to_string(),
        "postgres://aviary:***@127.0.0.1:5432/aviary",
        "the placeholder is kept, shown without the password part"
    );
    assert!(!Config::default().distributed.is_distributed());

    let text = "[distributed]\nregistry = \"mysql://h/db\"\ncoordination = \"redis://h\"\n";
    expect_error(
        text,
        line_of(text, "registry ="),
        "distributed.registry",
        "must start with postgres://",
    );
    let text = "[distributed]\ncoordination = \"redis://h\"\n";
    expect_error(
        text,
        line_of(text, "coordination ="),
        "distributed",
        "needs a PostgreSQL registry too",
    );
    let text = "[distributed]\nregistry = \"postgres://h/db\"\ncoordination = \"redis://h\"\nreplicas = 3\n";
    let e = Config::from_str(text, "t.toml").unwrap_err();
    assert!(e.to_string().contains("replicas"), "{e}");
}

#[test]
fn distributed_schema_and_prefix() {
    let base = "[distributed]\nregistry = \"postgres://h/db\"\ncoordination = \"redis://h\"\n";
    let c = Config::from_str(base, "t.toml").unwrap();
    assert_eq!(c.distributed.schema, None);
    assert_eq!(c.distributed.key_prefix, "aviary");
    let text = format!("{base}schema = \"team_a\"\nkey_prefix = \"aviary_a\"\n");
    let c = Config::from_str(&text, "t.toml").unwrap();
    assert_eq!(c.distributed.schema.as_deref(), Some("team_a"));
    assert_eq!(c.distributed.key_prefix, "aviary_a");
    let text = format!("{base}schema = \"1-bad\"\n");
    expect_error(
        &text,
        line_of(&text, "schema ="),
        "distributed.schema",
        "letters, digits or _",
    );
}

#[test]
fn reconciler_keys_default_one_by_one_and_are_bounded() {
    let c = Config::from_str("[reconciler]\ninterval_ms = 250\n", ORIGIN).unwrap();
    assert_eq!(c.reconciler.interval_ms, 250);
    let d = crate::default_reconciler();
    assert_eq!(c.reconciler.orphan_grace_s, d.orphan_grace_s);
    assert_eq!(
        c.reconciler.node_unhealthy_after_s,
        d.node_unhealthy_after_s
    );
    assert_eq!(Config::default().reconciler, d);
    for (text, key) in [
        ("[reconciler]\ninterval_ms = 10\n", "reconciler.interval_ms"),
        (
            "[reconciler]\norphan_grace_s = 0\n",
            "reconciler.orphan_grace_s",
        ),
        (
            "[reconciler]\nnode_unhealthy_after_s = 100000\n",
            "reconciler.node_unhealthy_after_s",
        ),
    ] {
        let err = Config::from_str(text, ORIGIN).unwrap_err();
        assert_eq!(err.key(), Some(key), "{text}: {err}");
        assert!(err.to_string().contains(":2:"), "names the line: {err}");
    }
    let e = Config::from_str("[reconciler]\nintervall_ms = 100\n", ORIGIN)
        .unwrap_err()
        .to_string();
    assert!(e.contains("intervall_ms"), "{e}");
}

#[test]
fn server_runtimes_default_to_the_runtime_and_must_include_it() {
    let c = Config::from_str("[server]\nruntime = \"runc\"\n", ORIGIN).unwrap();
    assert_eq!(c.server.runtimes, vec![crate::Runtime::Runc]);
    let c = Config::from_str("[server]\nruntimes = [\"crun\", \"runc\"]\n", ORIGIN).unwrap();
    assert_eq!(c.server.runtime, crate::Runtime::Crun);
    assert_eq!(
        c.server.runtimes,
        vec![crate::Runtime::Crun, crate::Runtime::Runc]
    );
    for text in [
        "[server]\nruntime = \"runc\"\nruntimes = [\"crun\"]\n",
        "[server]\nruntimes = []\n",
        "[server]\nruntimes = [\"crun\", \"crun\"]\n",
    ] {
        let err = Config::from_str(text, ORIGIN).unwrap_err();
        assert_eq!(err.key(), Some("server.runtimes"), "{text}: {err}");
    }
    let err = Config::from_str("[server]\nruntimes = [\"kata\"]\n", ORIGIN).unwrap_err();
    assert!(err.to_string().contains("kata"), "{err}");
}

#[test]
fn remote_e2b_is_read_checked_and_required_by_runtime_e2b() {
    let text = r#"
[server]
runtimes = ["crun", "e2b"]

[remote_e2b]
api_url = "https://api.e2b.app"
api_key_env = "E2B_API_KEY"
templates = { default = "base" }
"#;
    let c = Config::from_str(text, ORIGIN).unwrap();
    let r = c.remote_e2b.unwrap();
    assert_eq!(r.domain, "e2b.app");
    assert_eq!(r.timeout_s, 3600);
    assert!(!r.proxy_key);
    assert_eq!(r.templates["default"], "base");
    assert_eq!(r.api_key_env.as_deref(), Some("E2B_API_KEY"));
    // e2b listed without its table, or as the default runtime
    let err = Config::from_str("[server]\nruntimes = [\"crun\", \"e2b\"]\n", ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.runtimes"), "{err}");
    let err = Config::from_str("[server]\nruntime = \"e2b\"\n", ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.runtime"), "{err}");
    // classes left without runtimes run on this host's only
    let c = Config::from_str(text, ORIGIN).unwrap();
    assert!(c
        .classes
        .iter()
        .all(|k| !k.runtimes.iter().any(|r| r.is_remote())));
    for (bad, key) in [
        (
            "api_url = \"ftp://x\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\n",
            "remote_e2b.api_url",
        ),
        (
            "api_url = \"https://x/\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\n",
            "remote_e2b.api_url",
        ),
        (
            "api_url = \"https://x\"\ntemplates = { a = \"b\" }\n",
            "remote_e2b.api_key_env",
        ),
        (
            "api_url = \"https://x\"\napi_key_env = \"K\"\napi_key_file = \"/k\"\ntemplates = { a = \"b\" }\n",
            "remote_e2b.api_key_env",
        ),
        (
            "api_url = \"https://x\"\napi_key_file = \"rel\"\ntemplates = { a = \"b\" }\n",
            "remote_e2b.api_key_file",
        ),
        (
            "api_url = \"https://x\"\napi_key_env = \"K\"\ntemplates = {}\n",
            "remote_e2b.templates",
        ),
        (
            "api_url = \"https://x\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\ntimeout_s = 5\n",
            "remote_e2b.timeout_s",
        ),
        (
            "api_url = \"https://x\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\ndomain = \"*.x\"\n",
            "remote_e2b.domain",
        ),
    ] {
        let err = Config::from_str(&format!("[remote_e2b]\n{bad}"), ORIGIN).unwrap_err();
        assert_eq!(err.key(), Some(key), "{bad}: {err}");
    }
}

#[test]
fn remote_opensandbox_is_read_checked_and_required_by_runtime_opensandbox() {
    let text = r#"
pool = []

[server]
runtimes = ["crun", "opensandbox"]
default_class = "remote"

[remote_opensandbox]
url = "https://osb.example:8080"
api_key_file = "/etc/aviary/osb.key"
templates = { python = "python:3.11-slim" }

[[class]]
name = "remote"
cpu = 1
memory_mb = 2048
disk_mb = 10240
pids = 512
runtimes = ["opensandbox"]
"#;
    let c = Config::from_str(text, ORIGIN).unwrap();
    let r = c.remote_opensandbox.clone().unwrap();
    assert_eq!(r.url, "https://osb.example:8080");
    assert_eq!(r.timeout_s, 3600);
    assert_eq!(r.request_timeout_s, 60);
    assert_eq!(r.ready_timeout_s, 180);
    assert!(r.deny_egress && r.pausable, "{r:?}");
    assert_eq!(r.templates["python"], "python:3.11-slim");
    assert_eq!(
        r.api_key_file.as_deref(),
        Some(std::path::Path::new("/etc/aviary/osb.key"))
    );
    assert!(c.remote_e2b.is_none());
    let class = c.classes.iter().find(|k| k.name == "remote").unwrap();
    assert_eq!(class.runtimes, [Runtime::Opensandbox]);
    let c = Config::from_str(
        "[remote_opensandbox]\nurl = \"http://127.0.0.1:7400/opensandbox\"\napi_key_env = \"OPEN_SANDBOX_API_KEY\"\n\
         templates = { busybox = \"busybox\" }\ntimeout_s = 600\nrequest_timeout_s = 5\n\
         ready_timeout_s = 30\ndeny_egress = false\npausable = false\n",
        ORIGIN,
    )
    .unwrap();
    let r = c.remote_opensandbox.unwrap();
    assert_eq!(
        (r.timeout_s, r.request_timeout_s, r.ready_timeout_s),
        (600, 5, 30)
    );
    assert!(!r.deny_egress && !r.pausable);
    assert_eq!(r.api_key_env.as_deref(), Some("OPEN_SANDBOX_API_KEY"));

    // listed without its table (the e2b table is not it), or as the default
    let err =
        Config::from_str("[server]\nruntimes = [\"crun\", \"opensandbox\"]\n", ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.runtimes"), "{err}");
    assert!(err.to_string().contains("[remote_opensandbox]"), "{err}");
    let with_e2b_only = "[server]\nruntimes = [\"crun\", \"opensandbox\"]\n[remote_e2b]\n\
         api_url = \"https://x\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\n";
    let err = Config::from_str(with_e2b_only, ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.runtimes"), "{err}");
    let err = Config::from_str("[server]\nruntime = \"opensandbox\"\n", ORIGIN).unwrap_err();
    assert_eq!(err.key(), Some("server.runtime"), "{err}");

    let ok = "url = \"https://x\"\napi_key_env = \"K\"\ntemplates = { a = \"b\" }\n";
    for (bad, key) in [
        (ok.replace("https://x", "ftp://x"), "remote_opensandbox.url"),
        (
            ok.replace("https://x", "https://x/"),
            "remote_opensandbox.url",
        ),
        (ok.replace("https://x", "x:8080"), "remote_opensandbox.url"),
        (
            ok.replace("api_key_env = \"K\"\n", ""),
            "remote_opensandbox.api_key_env",
        ),
        (
            format!("{ok}api_key_file = \"/k\"\n"),
            "remote_opensandbox.api_key_env",
        ),
        (
            ok.replace("api_key_env = \"K\"", "api_key_env = \"1-K\""),
            "remote_opensandbox.api_key_env",
        ),
        (
            ok.replace("api_key_env = \"K\"", "api_key_file = \"rel\""),
            "remote_opensandbox.api_key_file",
        ),
        (
            ok.replace("{ a = \"b\" }", "{}"),
            "remote_opensandbox.templates",
        ),
        (
            ok.replace("{ a = \"b\" }", "{ a = \"two words\" }"),
            "remote_opensandbox.templates",
        ),
        (
            format!("{ok}timeout_s = 5\n"),
            "remote_opensandbox.timeout_s",
        ),
        (
            format!("{ok}request_timeout_s = 0\n"),
            "remote_opensandbox.request_timeout_s",
        ),
        (
            format!("{ok}ready_timeout_s = 7200\n"),
            "remote_opensandbox.ready_timeout_s",
        ),
    ] {
        let err = Config::from_str(&format!("[remote_opensandbox]\n{bad}"), ORIGIN).unwrap_err();
        assert_eq!(err.key(), Some(key), "{bad}: {err}");
    }
    let err = Config::from_str(
        &format!("[remote_opensandbox]\n{ok}domain = \"x\"\n"),
        ORIGIN,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("domain"),
        "unknown fields are refused: {err}"
    );
    let err = Config::from_str(
        &format!("[remote_opensandbox]\n{ok}timeout_s = 5\n"),
        ORIGIN,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("remote_opensandbox: timeout_s must be between 60 and 2592000"),
        "{err}"
    );
}

const KUBE: &str = r#"[server]
runtimes = ["crun", "kubernetes"]

[kubernetes]
kubeconfig = "/etc/aviary/kubeconfig"
namespace = "aviary-sandboxes"
deployment = "prod"
runtime_class = "gvisor"
envd_from = ["10.0.0.0/8", "192.168.7.0/24"]

[kubernetes.images]
python = "registry.example/aviary/python@sha256:00"
"#;

#[test]
fn a_kubernetes_table_configures_the_kubernetes_runtime() {
    let c = Config::from_str(KUBE, ORIGIN).unwrap();
    let k = c.kubernetes.unwrap();
    assert_eq!(k.kubeconfig, Some(PathBuf::from("/etc/aviary/kubeconfig")));
    assert_eq!(k.namespace, "aviary-sandboxes");
    assert_eq!(k.deployment, "prod");
    assert_eq!(k.runtime_class.as_deref(), Some("gvisor"));
    assert_eq!(
        k.images["python"],
        "registry.example/aviary/python@sha256:00"
    );
    assert_eq!(
        (k.run_as_user, k.ready_timeout_s, k.delete_timeout_s),
        (1000, 120, 60)
    );
    assert_eq!(k.envd_from, ["10.0.0.0/8", "192.168.7.0/24"]);
    assert_eq!((k.envd_port, k.relay_dir), (49_877, None));
    let c = Config::from_str(
        &KUBE.replace(
            "runtime_class",
            "envd_port = 40000\nrelay_dir = \"/run/aviary/relays\"\nruntime_class",
        ),
        ORIGIN,
    )
    .unwrap();
    let k = c.kubernetes.unwrap();
    assert_eq!(k.envd_port, 40_000);
    assert_eq!(k.relay_dir, Some(PathBuf::from("/run/aviary/relays")));
    let c = Config::from_str(
        &KUBE.replace(
            "kubeconfig = \"/etc/aviary/kubeconfig\"",
            "in_cluster = true",
        ),
        ORIGIN,
    )
    .unwrap();
    assert_eq!(c.kubernetes.unwrap().kubeconfig, None);
    assert_eq!(Config::default().kubernetes, None);
}

#[test]
fn kubernetes_settings_are_checked() {
    for (text, key) in [
        (
            KUBE.replace("aviary-sandboxes", "Aviary_Sandboxes"),
            "kubernetes.namespace",
        ),
        (
            KUBE.replace("/etc/aviary/kubeconfig", "kubeconfig"),
            "kubernetes.kubeconfig",
        ),
        (
            KUBE.replace("\"gvisor\"", "\"g visor\""),
            "kubernetes.runtime_class",
        ),
        (
            KUBE.replace("\"prod\"", "\"-prod\""),
            "kubernetes.deployment",
        ),
        (
            KUBE.replace("\"registry.example/aviary/python@sha256:00\"", "\"a b\""),
            "kubernetes.images.python",
        ),
        (
            KUBE.replace("runtime_class", "run_as_user = -1\nruntime_class"),
            "kubernetes.run_as_user",
        ),
        (
            KUBE.replace("runtime_class", "ready_timeout_s = 0\nruntime_class"),
            "kubernetes.ready_timeout_s",
        ),
        (
            KUBE.replace("kubeconfig = \"/etc/aviary/kubeconfig\"", ""),
            "kubernetes",
        ),
        (
            KUBE.replace("runtime_class", "in_cluster = true\nruntime_class"),
            "kubernetes.kubeconfig",
        ),
        (
            KUBE.replace("envd_from = [\"10.0.0.0/8\", \"192.168.7.0/24\"]\n", ""),
            "kubernetes.envd_from",
        ),
        (
            KUBE.replace("\"192.168.7.0/24\"", "\"192.168.7.1/24\""),
            "kubernetes.envd_from",
        ),
        (
            KUBE.replace("\"192.168.7.0/24\"", "\"the-control-plane\""),
            "kubernetes.envd_from",
        ),
        (
            KUBE.replace("[\"10.0.0.0/8\", \"192.168.7.0/24\"]", "[]"),
            "kubernetes.envd_from",
        ),
        (
            KUBE.replace("runtime_class", "envd_port = 80\nruntime_class"),
            "kubernetes.envd_port",
        ),
        (
            KUBE.replace("runtime_class", "relay_dir = \"relays\"\nruntime_class"),
            "kubernetes.relay_dir",
        ),
        // the table without the runtime listed, and the runtime without the table
        (KUBE.replace(", \"kubernetes\"", ""), "kubernetes"),
        (
            "[server]\nruntimes = [\"crun\", \"kubernetes\"]\n".to_owned(),
            "kubernetes",
        ),
        (
            KUBE.replace("[server]\n", "[server]\nruntime = \"kubernetes\"\n"),
            "server.runtime",
        ),
    ] {
        let err = Config::from_str(&text, ORIGIN).unwrap_err();
        assert_eq!(err.key(), Some(key), "{text}: {err}");
    }
    let e = Config::from_str(&KUBE.replace("deployment", "deploymnet"), ORIGIN).unwrap_err();
    assert!(e.to_string().contains("deploymnet"), "{e}");
}

#[test]
fn disk_fs_defaults_to_ext4_and_parses_xfs() {
    let cfg = Config::from_str(BASE, ORIGIN).unwrap();
    assert_eq!(cfg.server.disk_fs, DiskFs::Ext4);
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"small\"\ndisk_fs = \"xfs\"",
    );
    let cfg = Config::from_str(&text, ORIGIN).unwrap();
    assert_eq!(cfg.server.disk_fs, DiskFs::Xfs);
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"small\"\ndisk_fs = \"ext4\"",
    );
    let cfg = Config::from_str(&text, ORIGIN).unwrap();
    assert_eq!(cfg.server.disk_fs, DiskFs::Ext4);
}

#[test]
fn unknown_disk_fs_is_rejected_at_its_line() {
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"small\"\ndisk_fs = \"btrfs\"",
    );
    expect_error(
        &text,
        line_of(&text, "disk_fs"),
        "server.disk_fs",
        "disk_fs must be \"ext4\" or \"xfs\", got \"btrfs\"",
    );
}

#[test]
fn xfs_refuses_a_class_disk_below_its_minimum() {
    let text = edit(
        "default_class = \"small\"",
        "default_class = \"small\"\ndisk_fs = \"xfs\"",
    )
    .replacen("disk_mb = 2048", "disk_mb = 256", 1);
    expect_error(
        &text,
        line_of(&text, "disk_fs"),
        "server.disk_fs",
        "needs every class's disk_mb >= 300 (mkfs.xfs refuses smaller file systems), \
         but class \"small\" has 256",
    );
    // the same class is fine on ext4
    let ext4 = text.replacen("disk_fs = \"xfs\"", "disk_fs = \"ext4\"", 1);
    Config::from_str(&ext4, ORIGIN).unwrap();
}
