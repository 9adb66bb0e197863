use super::*;
use proptest::prelude::*;

/// Classes of different sizes, one with a GPU; tenants with different rights.
const POLICY_TOML: &str = r#"
pool = []

[server]
runtime = "runc"
default_class = "small"
default_template = "base"

[[network_profile]]
name = "none"
kind = "none"

[[network_profile]]
name = "pypi"
kind = "allowlist"
allow = ["pypi.org"]

[[network_profile]]
name = "open"
kind = "open"

[[class]]
name = "small"
cpu = 1.0
memory_mb = 2048
disk_mb = 10240
pids = 256
network_profiles = ["none", "pypi"]

[[class]]
name = "medium"
cpu = 2.0
memory_mb = 4096
disk_mb = 20480
pids = 512
network_profiles = ["none", "pypi", "open"]

[[class]]
name = "large"
cpu = 8.0
memory_mb = 16384
disk_mb = 51200
pids = 2048
network_profiles = ["none", "pypi", "open"]

[[class]]
name = "gpu-xl"
cpu = 8.0
memory_mb = 32768
disk_mb = 51200
pids = 2048
gpu = true
runtimes = ["crun"]
network_profiles = ["none"]

[[tenant]]
name = "default"
max_sandboxes = 100
max_cpu = 1000.0
max_memory_mb = 10000000
allowed_classes = "*"
allowed_network_profiles = "*"
allowed_runtimes = "*"

[[tenant]]
name = "team"
max_sandboxes = 2
max_cpu = 3.0
max_memory_mb = 6144
allowed_classes = ["small", "medium"]
allowed_network_profiles = ["none", "pypi"]
allowed_runtimes = ["crun"]

[[tenant]]
name = "frozen"
max_sandboxes = 5
max_cpu = 10.0
max_memory_mb = 100000
allowed_classes = []
allowed_network_profiles = "*"
allowed_runtimes = "*"

[[tenant]]
name = "runc-only"
max_sandboxes = 5
max_cpu = 100.0
max_memory_mb = 1000000
allowed_classes = ["gpu-xl", "small"]
allowed_network_profiles = "*"
allowed_runtimes = ["runc"]
"#;

fn config() -> Config {
    Config::from_str(POLICY_TOML, "policy-test.toml").unwrap()
}

fn guard() -> PolicyGuard {
    PolicyGuard::new(&config())
}

fn req(class: &str) -> IntentRequest {
    IntentRequest {
        class: class.into(),
        ..IntentRequest::default()
    }
}

enum Expect {
    Approve {
        class: &'static str,
        clamped: bool,
        reason: &'static str,
    },
    Deny {
        code: DenialCode,
        message: &'static str,
    },
}

struct Case {
    name: &'static str,
    tenant: &'static str,
    req: IntentRequest,
    usage: TenantUsage,
    expect: Expect,
}

fn cases() -> Vec<Case> {
    use DenialCode::*;
    use Expect::*;
    let none = TenantUsage::default();
    let with = |f: fn(&mut IntentRequest), class: &str| {
        let mut r = req(class);
        f(&mut r);
        r
    };
    vec![
        Case {
            name: "allowed class as asked",
            tenant: "default",
            req: with(|r| r.cpu = 1.0, "small"),
            usage: none,
            expect: Approve {
                class: "small",
                clamped: false,
                reason: "class \"small\" approved",
            },
        },
        Case {
            name: "request below the class is not clamped",
            tenant: "team",
            req: with(
                |r| {
                    r.cpu = 0.5;
                    r.memory_mb = 100;
                },
                "medium",
            ),
            usage: none,
            expect: Approve {
                class: "medium",
                clamped: false,
                reason: "approved",
            },
        },
        Case {
            name: "numbers above the class are clamped to it",
            tenant: "default",
            req: with(
                |r| {
                    r.cpu = 64.0;
                    r.memory_mb = 1 << 20;
                },
                "large",
            ),
            usage: none,
            expect: Approve {
                class: "large",
                clamped: true,
                reason: "clamped: requested 64 cpu, class large has 8",
            },
        },
        Case {
            name: "class not allowed: largest allowed class no bigger than it",
            tenant: "team",
            req: req("large"),
            usage: none,
            expect: Approve {
                class: "medium",
                clamped: true,
                reason: "tenant \"team\" may not use class \"large\"",
            },
        },
        Case {
            name: "unknown class with huge numbers: biggest non-GPU class",
            tenant: "default",
            req: with(
                |r| {
                    r.cpu = 64.0;
                    r.memory_mb = 1 << 30;
                    r.disk_mb = 1 << 30;
                },
                "mega",
            ),
            usage: none,
            expect: Approve {
                class: "large",
                clamped: true,
                reason: "clamped: requested 64 cpu, class large has 8",
            },
        },
        Case {
            name: "unknown class with tiny numbers: smallest allowed class",
            tenant: "team",
            req: with(
                |r| {
                    r.cpu = 0.1;
                    r.memory_mb = 64;
                },
                "nano",
            ),
            usage: none,
            expect: Approve {
                class: "small",
                clamped: true,
                reason: "the smallest allowed class",
            },
        },
        Case {
            name: "empty class, numbers decide",
            tenant: "default",
            req: with(
                |r| {
                    r.cpu = 2.0;
                    r.memory_mb = 4096;
                    r.disk_mb = 20480;
                },
                "",
            ),
            usage: none,
            expect: Approve {
                class: "medium",
                clamped: true,
                reason: "no class requested",
            },
        },
        Case {
            name: "NaN cpu counts as none",
            tenant: "default",
            req: with(|r| r.cpu = f64::NAN, "nope"),
            usage: none,
            expect: Approve {
                class: "small",
                clamped: true,
                reason: "ignored invalid cpu request",
            },
        },
        Case {
            name: "class lacking the network profile: closest class that has it",
            tenant: "default",
            req: with(|r| r.network_profile = Some("open".into()), "small"),
            usage: none,
            expect: Approve {
                class: "medium",
                clamped: true,
                reason: "does not offer network profile \"open\"",
            },
        },
        Case {
            name: "GPU needed: the GPU class",
            tenant: "default",
            req: with(|r| r.needs_gpu = true, "small"),
            usage: none,
            expect: Approve {
                class: "gpu-xl",
                clamped: true,
                reason: "class \"small\" has no GPU",
            },
        },
        Case {
            name: "GPU class asked for by name without needing a GPU",
            tenant: "default",
            req: req("gpu-xl"),
            usage: none,
            expect: Approve {
                class: "gpu-xl",
                clamped: false,
                reason: "approved",
            },
        },
        Case {
            name: "GPU class lacking the profile: non-GPU substitute",
            tenant: "default",
            req: with(|r| r.network_profile = Some("pypi".into()), "gpu-xl"),
            usage: none,
            expect: Approve {
                class: "large",
                clamped: true,
                reason: "the largest allowed class no bigger",
            },
        },
        Case {
            name: "GPU needed, tenant has no GPU class",
            tenant: "team",
            req: with(|r| r.needs_gpu = true, "small"),
            usage: none,
            expect: Deny {
                code: GpuNotAvailable,
                message: "may not use a GPU class (gpu-xl)",
            },
        },
        Case {
            name: "network profile not allowed for the tenant",
            tenant: "team",
            req: with(|r| r.network_profile = Some("open".into()), "small"),
            usage: none,
            expect: Deny {
                code: NetworkProfileNotAllowed,
                message: "may not use network profile \"open\"",
            },
        },
        Case {
            name: "network profile not configured",
            tenant: "default",
            req: with(|r| r.network_profile = Some("wifi".into()), "small"),
            usage: none,
            expect: Deny {
                code: NetworkProfileNotAllowed,
                message: "\"wifi\" is not configured",
            },
        },
        Case {
            name: "GPU class offers no such profile",
            tenant: "default",
            req: with(
                |r| {
                    r.needs_gpu = true;
                    r.network_profile = Some("open".into());
                },
                "gpu-xl",
            ),
            usage: none,
            expect: Deny {
                code: NetworkProfileNotAllowed,
                message: "no class with a GPU",
            },
        },
        Case {
            name: "runtime not allowed for the tenant",
            tenant: "team",
            req: with(|r| r.runtime = Some("runc".into()), "small"),
            usage: none,
            expect: Deny {
                code: RuntimeNotAllowed,
                message: "may not use runtime runc",
            },
        },
        Case {
            name: "unknown runtime",
            tenant: "default",
            req: with(|r| r.runtime = Some("microvm".into()), "small"),
            usage: none,
            expect: Deny {
                code: RuntimeNotAllowed,
                message: "unknown runtime \"microvm\"",
            },
        },
        Case {
            name: "GPU class does not run on the tenant's only runtime",
            tenant: "runc-only",
            req: with(|r| r.needs_gpu = true, "gpu-xl"),
            usage: none,
            expect: Deny {
                code: RuntimeNotAllowed,
                message: "runs on a runtime it may use",
            },
        },
        Case {
            name: "tenant with no classes",
            tenant: "frozen",
            req: req("small"),
            usage: none,
            expect: Deny {
                code: ClassNotAllowed,
                message: "may not use any resource class",
            },
        },
        Case {
            name: "unknown tenant",
            tenant: "mallory",
            req: req("small"),
            usage: none,
            expect: Deny {
                code: UnknownTenant,
                message: "tenant \"mallory\" has no policy",
            },
        },
        Case {
            name: "sandbox count quota",
            tenant: "team",
            req: req("small"),
            usage: TenantUsage {
                sandboxes: 2,
                cpu: 0.0,
                memory_mb: 0,
            },
            expect: Deny {
                code: OverQuota,
                message: "has 2 of 2 sandboxes",
            },
        },
        Case {
            name: "cpu quota counts the new class",
            tenant: "team",
            req: req("medium"),
            usage: TenantUsage {
                sandboxes: 1,
                cpu: 1.5,
                memory_mb: 0,
            },
            expect: Deny {
                code: OverQuota,
                message: "cpu quota is 3: 1.5 in use + 2 for class medium",
            },
        },
        Case {
            name: "cpu quota exactly reached is fine",
            tenant: "team",
            req: req("medium"),
            usage: TenantUsage {
                sandboxes: 1,
                cpu: 1.0,
                memory_mb: 2048,
            },
            expect: Approve {
                class: "medium",
                clamped: false,
                reason: "approved",
            },
        },
        Case {
            name: "memory quota counts the new class",
            tenant: "team",
            req: req("medium"),
            usage: TenantUsage {
                sandboxes: 1,
                cpu: 0.0,
                memory_mb: 4096,
            },
            expect: Deny {
                code: OverQuota,
                message: "memory quota is 6144 MiB",
            },
        },
    ]
}

#[test]
fn table_of_policy_decisions() {
    let g = guard();
    for case in cases() {
        let got = g.approve(case.tenant, &case.req, &case.usage);
        match (case.expect, got) {
            (
                Expect::Approve {
                    class,
                    clamped,
                    reason,
                },
                Ok(a),
            ) => {
                assert_eq!(a.class, class, "{}: {a:?}", case.name);
                assert_eq!(a.clamped, clamped, "{}: {a:?}", case.name);
                assert!(
                    a.reasons.iter().any(|r| r.contains(reason)),
                    "{}: no reason containing {reason:?} in {:?}",
                    case.name,
                    a.reasons
                );
                let c = config();
                assert_eq!(a.limits, c.class(class).unwrap().limits(), "{}", case.name);
            }
            (Expect::Deny { code, message }, Err(d)) => {
                assert_eq!(d.code, code, "{}: {d:?}", case.name);
                assert!(
                    d.message.contains(message),
                    "{}: {message:?} not in {:?}",
                    case.name,
                    d.message
                );
                assert_eq!(d.tenant, case.tenant);
                assert_eq!(d.requested_class, case.req.class);
            }
            (Expect::Approve { .. }, Err(d)) => panic!("{}: denied: {d:?}", case.name),
            (Expect::Deny { .. }, Ok(a)) => panic!("{}: approved: {a:?}", case.name),
        }
    }
}

#[test]
fn runtime_and_template_defaults() {
    let g = guard();
    let none = TenantUsage::default();
    // The server's runtime (runc) when class and tenant allow it.
    let a = g.approve("default", &req("small"), &none).unwrap();
    assert_eq!(a.runtime, Runtime::Runc);
    assert_eq!(a.template, "base");
    assert_eq!(a.network_profile, "none");
    assert_eq!(a.network_kind, NetworkProfile::None);
    // The team may only use crun: the guard picks it and says why.
    let a = g.approve("team", &req("small"), &none).unwrap();
    assert_eq!(a.runtime, Runtime::Crun);
    assert!(
        a.reasons.iter().any(|r| r.contains("runtime crun")),
        "{:?}",
        a.reasons
    );
    // gpu-xl only runs on crun.
    let a = g.approve("default", &req("gpu-xl"), &none).unwrap();
    assert_eq!(a.runtime, Runtime::Crun);
    // Explicit choices pass through.
    let mut r = req("medium");
    r.runtime = Some("crun".into());
    r.template = Some("py311".into());
    r.network_profile = Some("pypi".into());
    let a = g.approve("default", &r, &none).unwrap();
    assert_eq!((a.runtime, a.template.as_str()), (Runtime::Crun, "py311"));
    assert_eq!(a.network_kind, NetworkProfile::Allowlist);
}

#[test]
fn default_configuration_denies_gpu_and_clamps_64_cpus() {
    let g = PolicyGuard::new(&Config::default());
    let none = TenantUsage::default();
    let mut r = req("python-small");
    r.needs_gpu = true;
    let d = g.approve("default", &r, &none).unwrap_err();
    assert_eq!(d.code, DenialCode::GpuNotAvailable);
    assert_eq!(d.message, "a GPU is needed and no configured class has one");

    let mut r = req("compute-large");
    r.cpu = 64.0;
    let a = g.approve("default", &r, &none).unwrap();
    assert_eq!(a.class, "compute-large");
    assert_eq!(a.limits.cpu, 8.0);
    assert!(a.clamped);
    assert!(a
        .reasons
        .contains(&"clamped: requested 64 cpu, class compute-large has 8".to_owned()));
}

#[test]
fn denial_is_an_event_and_maps_to_forbidden() {
    let d = guard()
        .approve(
            "team",
            &req("small"),
            &TenantUsage {
                sandboxes: 9,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(d.error_code(), ErrorCode::Forbidden);
    assert_eq!(Denial::EVENT_TYPE, "policy.denied");
    let meta = d.to_event_metadata();
    assert_eq!(meta["code"], "over_quota");
    assert_eq!(meta["tenant"], "team");
    assert_eq!(meta["requested_class"], "small");
    assert_eq!(meta["message"], d.message.as_str());
    assert_eq!(d.to_string(), d.message);
    // The code's JSON spelling is its as_str.
    assert_eq!(serde_json::to_value(d.code).unwrap(), "over_quota");
}

#[test]
fn approval_event_metadata_carries_the_decision() {
    let mut r = req("large");
    r.cpu = 64.0;
    let a = guard()
        .approve("default", &r, &TenantUsage::default())
        .unwrap();
    let meta = a.to_event_metadata();
    assert_eq!(meta["class"], "large");
    assert_eq!(meta["limits"]["cpu"], 8.0);
    assert_eq!(meta["clamped"], true);
    assert_eq!(meta["runtime"], "runc");
    assert!(meta["reasons"].as_array().unwrap().len() >= 2);
}

fn arb_request() -> impl Strategy<Value = IntentRequest> {
    let class = prop::sample::select(vec![
        "small",
        "medium",
        "large",
        "gpu-xl",
        "python-small",
        "",
        "ghost",
    ]);
    let cpu = prop_oneof![
        0.0..16.0f64,
        Just(64.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(-1.0),
        any::<f64>(),
    ];
    let mem = prop_oneof![0u64..40_000, any::<u64>()];
    let disk = prop_oneof![0u64..60_000, any::<u64>()];
    let profile = prop::option::of(prop::sample::select(vec![
        "none", "pypi", "open", "wifi", "",
    ]));
    let runtime = prop::option::of(prop::sample::select(vec!["crun", "runc", "kata", ""]));
    (class, cpu, mem, disk, any::<bool>(), profile, runtime).prop_map(
        |(class, cpu, memory_mb, disk_mb, needs_gpu, profile, runtime)| IntentRequest {
            class: class.into(),
            cpu,
            memory_mb,
            disk_mb,
            needs_gpu,
            network_profile: profile.map(Into::into),
            runtime: runtime.map(Into::into),
            template: None,
        },
    )
}

fn arb_usage() -> impl Strategy<Value = TenantUsage> {
    (0u32..4, 0.0..4.0f64, 0u64..8192).prop_map(|(sandboxes, cpu, memory_mb)| TenantUsage {
        sandboxes,
        cpu,
        memory_mb,
    })
}

proptest! {
    /// Whatever the request, an approval's limits are exactly one configured
    /// class's limits, and that class (with the profile and runtime) is
    /// allowed for the tenant, offered by the class, and within quota.
    #[test]
    fn approvals_are_always_an_allowed_configured_class(
        tenant in prop::sample::select(vec!["default", "team", "frozen", "runc-only", "nobody"]),
        r in arb_request(),
        usage in arb_usage(),
    ) {
        let cfg = config();
        let g = PolicyGuard::new(&cfg);
        match g.approve(tenant, &r, &usage) {
            Ok(a) => {
                let class = cfg.class(&a.class).unwrap();
                prop_assert_eq!(a.limits, class.limits());
                let t = cfg.tenant(tenant).unwrap();
                prop_assert!(t.allowed_classes.allows_name(&a.class));
                prop_assert!(t.allowed_network_profiles.allows_name(&a.network_profile));
                prop_assert!(t.allowed_runtimes.allows(&a.runtime));
                prop_assert!(class.supports_network_profile(&a.network_profile));
                prop_assert!(class.supports_runtime(a.runtime));
                prop_assert!(!r.needs_gpu || class.gpu);
                prop_assert!(usage.sandboxes < t.max_sandboxes);
                prop_assert!(usage.cpu + class.cpu <= t.max_cpu + 1e-9);
                prop_assert!(usage.memory_mb + class.memory_mb <= t.max_memory_mb);
                if !a.clamped {
                    prop_assert_eq!(&a.class, &r.class);
                }
                prop_assert!(!a.reasons.is_empty());
            }
            Err(d) => {
                prop_assert_eq!(d.code == DenialCode::UnknownTenant, cfg.tenant(tenant).is_none());
                prop_assert!(!d.message.is_empty());
            }
        }
    }

    /// A substitute for a known class never has more cpu or memory than that
    /// class when an allowed class that small exists.
    #[test]
    fn substitutes_never_exceed_the_requested_class_when_avoidable(
        r in arb_request(),
    ) {
        let cfg = config();
        let g = PolicyGuard::new(&cfg);
        let Ok(a) = g.approve("team", &r, &TenantUsage::default()) else { return Ok(()); };
        if let Some(asked) = cfg.class(&r.class) {
            let small = cfg.class("small").unwrap();
            let small_fits = small.cpu <= asked.cpu && small.memory_mb <= asked.memory_mb
                && small.disk_mb <= asked.disk_mb && small.supports_network_profile(&a.network_profile);
            if a.class != r.class && small_fits {
                let got = cfg.class(&a.class).unwrap();
                prop_assert!(got.cpu <= asked.cpu && got.memory_mb <= asked.memory_mb, "{:?} for {:?}", a, r);
            }
        }
    }
}
