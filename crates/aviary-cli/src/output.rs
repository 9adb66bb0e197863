//! Human and `--json` output.

use aviary_core::api::{Event, Sandbox, Template};

pub fn json<T: serde::Serialize>(v: &T) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("aviary: cannot encode output: {e}"),
    }
}

pub fn ts(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A sandbox's state as people read it: `Idle (paused)` while frozen.
fn shown_state(s: &Sandbox) -> String {
    if s.paused {
        format!("{} (paused)", s.state.as_str())
    } else {
        s.state.as_str().to_owned()
    }
}

/// Prints a table: a header row and columns as wide as their widest cell
/// (no borders; numbers as the caller formats them).
pub fn table<const N: usize>(header: [&str; N], rows: impl IntoIterator<Item = [String; N]>) {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(header);
    for r in rows {
        t.add_row(r);
    }
    // the preset pads every cell by one space on each side
    for line in t.to_string().lines() {
        println!("{}", line.strip_prefix(' ').unwrap_or(line).trim_end());
    }
}

pub fn sandbox_table(list: &[Sandbox]) {
    table(
        [
            "ID", "STATE", "CLASS", "TEMPLATE", "RUNTIME", "NODE", "LEASED", "CREATED",
        ],
        list.iter().map(|s| {
            [
                s.id.to_string(),
                shown_state(s),
                s.resource_class.clone(),
                s.template.clone(),
                s.runtime.clone(),
                s.node.clone(),
                if s.lease_owner.is_some() { "yes" } else { "no" }.to_owned(),
                ts(s.created_at),
            ]
        }),
    );
}

pub fn sandbox_detail(s: &Sandbox) {
    println!("id:              {}", s.id);
    println!("state:           {}", shown_state(s));
    println!("tenant:          {}", s.tenant);
    println!("scope:           {}", s.scope);
    if let Some(u) = &s.user_id {
        println!("user:            {u}");
    }
    if let Some(se) = &s.session_id {
        println!("session:         {se}");
    }
    if let Some(a) = &s.agent {
        println!("agent:           {a}");
    }
    println!(
        "class:           {} ({} cpu, {} MiB, {} pids)",
        s.resource_class, s.resources.cpu, s.resources.memory_mb, s.resources.pids
    );
    println!("template:        {} ({})", s.template, s.template_digest);
    println!("runtime:         {} on {}", s.runtime, s.node);
    println!("network:         {}", s.network_profile.as_str());
    println!("created:         {}", ts(s.created_at));
    if let Some(e) = s.expires_at {
        println!("expires:         {}", ts(e));
    }
    if let Some(o) = &s.lease_owner {
        println!("leased by:       {o}");
    }
    println!("tainted:         {}", s.tainted);
    for (k, v) in &s.metadata {
        println!("metadata:        {k}={v}");
    }
}

pub fn event_line(e: &Event) {
    let states = match (e.old_state, e.new_state) {
        (Some(a), Some(b)) if a != b => format!("{a} -> {b}"),
        (_, Some(b)) => b.to_string(),
        _ => String::new(),
    };
    println!(
        "{:>6} {} {:<26} {:<18} {:<28} {}",
        e.id,
        ts(e.timestamp),
        e.sandbox_id.as_ref().map(|s| s.as_str()).unwrap_or("-"),
        e.event_type,
        states,
        if e.metadata.is_null() || e.metadata == serde_json::json!({}) {
            String::new()
        } else {
            e.metadata.to_string()
        }
    );
}

pub fn template_table(list: &[Template]) {
    table(
        ["NAME", "DIGEST", "SIZE", "SOURCE", "CREATED"],
        list.iter().map(|t| {
            [
                t.name.clone(),
                t.digest.get(..19).unwrap_or(&t.digest).to_owned(),
                format!("{}M", t.size_bytes / (1 << 20)),
                t.source.clone(),
                ts(t.created_at),
            ]
        }),
    );
}

pub fn key_table(keys: &[aviary_client::ApiKeyInfo]) {
    table(
        ["ID", "TENANT", "ADMIN", "CREATED", "REVOKED"],
        keys.iter().map(|k| {
            [
                k.id.clone(),
                k.tenant.clone(),
                if k.admin { "yes" } else { "no" }.to_owned(),
                k.created_at.clone(),
                k.revoked_at.clone().unwrap_or_else(|| "-".into()),
            ]
        }),
    );
}

/// `sandbox ps`: one row per process (argv is the sandbox's text: shown, cut).
pub fn process_table(list: &[aviary_core::api::ProcessEntry]) {
    table(
        ["PID", "PPID", "USER", "STAT", "COMMAND"],
        list.iter().map(|p| {
            let mut cmd: String = p
                .argv
                .join(" ")
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .take(120)
                .collect();
            if p.truncated {
                cmd.push_str(" …");
            }
            [
                p.pid.to_string(),
                p.ppid.to_string(),
                p.user
                    .as_deref()
                    .map(|u| u.chars().filter(|c| !c.is_control()).take(32).collect())
                    .unwrap_or_else(|| p.uid.to_string()),
                p.state.clone(),
                cmd,
            ]
        }),
    );
}

/// Bytes as people read them (binary units, one decimal).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// `used` as a percentage of `limit` (`-` without a limit).
fn percent(used: f64, limit: f64) -> String {
    if limit > 0.0 {
        format!("{:.1}%", used * 100.0 / limit)
    } else {
        "-".into()
    }
}

/// `sandbox usage`: one row per resource, what is in use beside the limit.
pub fn usage_table(u: &aviary_core::api::SandboxUsage) {
    println!(
        "{} {}{} sampled {}",
        u.sandbox_id,
        u.state.as_str(),
        if u.paused { " (paused)" } else { "" },
        ts(u.sampled_at)
    );
    let dash = || "-".to_owned();
    let disk = match u.disk_used_bytes {
        Some(used) => [
            "disk".to_owned(),
            human_bytes(used),
            human_bytes(u.disk_limit_bytes),
            percent(used as f64, u.disk_limit_bytes as f64),
        ],
        None => [
            "disk".to_owned(),
            "not known to its runtime".to_owned(),
            human_bytes(u.disk_limit_bytes),
            dash(),
        ],
    };
    table(
        ["RESOURCE", "IN USE", "LIMIT", "USE"],
        [
            [
                "memory".to_owned(),
                human_bytes(u.memory_bytes),
                human_bytes(u.memory_limit_bytes),
                percent(u.memory_bytes as f64, u.memory_limit_bytes as f64),
            ],
            [
                "memory peak".to_owned(),
                human_bytes(u.memory_peak_bytes),
                human_bytes(u.memory_limit_bytes),
                percent(u.memory_peak_bytes as f64, u.memory_limit_bytes as f64),
            ],
            [
                "cpu time".to_owned(),
                format!("{:.2} s", u.cpu_seconds),
                format!(
                    "{} core{}",
                    u.cpu_limit,
                    if u.cpu_limit == 1.0 { "" } else { "s" }
                ),
                dash(),
            ],
            [
                "processes".to_owned(),
                u.pids.to_string(),
                u.pids_limit.to_string(),
                percent(u.pids as f64, u.pids_limit as f64),
            ],
            disk,
            [
                "oom kills".to_owned(),
                u.oom_kills.to_string(),
                dash(),
                dash(),
            ],
        ],
    );
}
