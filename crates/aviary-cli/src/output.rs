//! Human and `--json` output.

use aviary_core::api::{Event, Sandbox, Template};

pub fn json<T: serde::Serialize>(v: &T) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("aviary: cannot encode output: {e}"),
    }
}

fn ts(t: time::OffsetDateTime) -> String {
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

pub fn sandbox_table(list: &[Sandbox]) {
    println!(
        "{:<26} {:<16} {:<14} {:<10} {:<8} {:<20}",
        "ID", "STATE", "CLASS", "TEMPLATE", "LEASED", "CREATED"
    );
    for s in list {
        println!(
            "{:<26} {:<16} {:<14} {:<10} {:<8} {:<20}",
            s.id.as_str(),
            shown_state(s),
            s.resource_class,
            s.template,
            if s.lease_owner.is_some() { "yes" } else { "no" },
            ts(s.created_at)
        );
    }
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
    println!(
        "{:<16} {:<20} {:>10} {:<18} CREATED",
        "NAME", "DIGEST", "SIZE", "SOURCE"
    );
    for t in list {
        let short = t.digest.get(..19).unwrap_or(&t.digest);
        println!(
            "{:<16} {:<20} {:>9}M {:<18} {}",
            t.name,
            short,
            t.size_bytes / (1 << 20),
            t.source,
            ts(t.created_at)
        );
    }
}

pub fn key_table(keys: &[aviary_client::ApiKeyInfo]) {
    println!(
        "{:<28} {:<20} {:<6} {:<28} {:<28}",
        "ID", "TENANT", "ADMIN", "CREATED", "REVOKED"
    );
    for k in keys {
        println!(
            "{:<28} {:<20} {:<6} {:<28} {:<28}",
            k.id,
            k.tenant,
            if k.admin { "yes" } else { "no" },
            k.created_at,
            k.revoked_at.as_deref().unwrap_or("-")
        );
    }
}
