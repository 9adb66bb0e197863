//! Which addresses egress may never reach, and what a host string means.
//!
//! [`forbidden`] names the range of an address that is always denied:
//! private (RFC 1918), shared (CGNAT), loopback, link-local (the metadata
//! address 169.254.169.254 among them), multicast, unspecified, reserved,
//! documentation, and their IPv6 counterparts (ULA, link-local, site-local);
//! IPv6 forms that embed an IPv4 address (mapped, compatible, NAT64, 6to4)
//! are judged by the address they embed.
//!
//! [`parse_host`] reads a host the way the C resolver would (`inet_aton`):
//! `2130706433`, `0x7f000001`, `0177.0.0.1` and `127.1` are all 127.0.0.1,
//! so no encoding of a literal can pass for a domain name.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A host as the sandbox named it, after normalisation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    /// A lower-case domain name without a trailing dot.
    Name(String),
    Ip(IpAddr),
}

/// Parses a request's host (no port; IPv6 in brackets or bare). `Err` names
/// why it is not a host at all.
pub fn parse_host(raw: &str) -> Result<Host, &'static str> {
    if raw.is_empty() || raw.len() > 253 + 2 {
        return Err("empty or overlong host");
    }
    if let Some(inner) = raw.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        // a zone id (`%eth0`) has no business in egress
        return inner
            .parse::<Ipv6Addr>()
            .map(|a| Host::Ip(IpAddr::V6(a)))
            .map_err(|_| "malformed IPv6 literal");
    }
    if let Ok(a) = raw.parse::<Ipv6Addr>() {
        return Ok(Host::Ip(IpAddr::V6(a)));
    }
    let name = raw.strip_suffix('.').unwrap_or(raw).to_ascii_lowercase();
    if name.is_empty() {
        return Err("empty host");
    }
    // Anything the resolver could read as IPv4 is IPv4; a last label that is
    // all digits (or 0x-hex) is a numeric host either way.
    if let Some(v4) = inet_aton(&name) {
        return Ok(Host::Ip(IpAddr::V4(v4)));
    }
    let last = name.rsplit('.').next().unwrap_or("");
    if last.bytes().all(|b| b.is_ascii_digit()) || last.starts_with("0x") {
        return Err("malformed numeric host");
    }
    if !name.split('.').all(valid_label) {
        return Err("not a domain name");
    }
    Ok(Host::Name(name))
}

fn valid_label(l: &str) -> bool {
    !l.is_empty()
        && l.len() <= 63
        && l.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && !l.starts_with('-')
        && !l.ends_with('-')
}

/// `inet_aton`: 1 to 4 parts, each decimal, `0x` hex or `0` octal; the last
/// part fills the remaining bytes.
fn inet_aton(s: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut nums = Vec::with_capacity(parts.len());
    for p in &parts {
        nums.push(parse_part(p)?);
    }
    let (last, head) = nums.split_last()?;
    let mut value: u64 = 0;
    for (i, n) in head.iter().enumerate() {
        if *n > 0xff {
            return None;
        }
        value |= n << (24 - 8 * i);
    }
    let room = 32 - 8 * head.len() as u32;
    if *last >= (1u64 << room) {
        return None;
    }
    value |= last;
    u32::try_from(value).ok().map(Ipv4Addr::from)
}

fn parse_part(p: &str) -> Option<u64> {
    if p.is_empty() || p.len() > 12 {
        return None;
    }
    let (digits, radix) = if let Some(h) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
        (h, 16)
    } else if p.len() > 1 && p.starts_with('0') {
        (&p[1..], 8)
    } else {
        (p, 10)
    };
    if digits.is_empty() {
        // "0x" alone is 0 to inet_aton; refuse it rather than guess
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// The always-denied range `ip` falls in, or `None` for a public address.
pub fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    let n = u32::from(ip);
    let within = |base: [u8; 4], bits: u32| {
        let mask = if bits == 0 {
            0
        } else {
            u32::MAX << (32 - bits)
        };
        n & mask == u32::from(Ipv4Addr::from(base)) & mask
    };
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        return Some("metadata address");
    }
    Some(match () {
        _ if within([0, 0, 0, 0], 8) => "unspecified (0.0.0.0/8)",
        _ if within([10, 0, 0, 0], 8) => "private (10.0.0.0/8)",
        _ if within([100, 64, 0, 0], 10) => "shared/CGNAT (100.64.0.0/10)",
        _ if within([127, 0, 0, 0], 8) => "loopback (127.0.0.0/8)",
        _ if within([169, 254, 0, 0], 16) => "link-local (169.254.0.0/16)",
        _ if within([172, 16, 0, 0], 12) => "private (172.16.0.0/12)",
        _ if within([192, 0, 0, 0], 24) => "IETF protocol assignments (192.0.0.0/24)",
        _ if within([192, 0, 2, 0], 24)
            || within([198, 51, 100, 0], 24)
            || within([203, 0, 113, 0], 24) =>
        {
            "documentation range"
        }
        _ if within([192, 168, 0, 0], 16) => "private (192.168.0.0/16)",
        _ if within([198, 18, 0, 0], 15) => "benchmarking (198.18.0.0/15)",
        _ if o[0] >= 224 && o[0] < 240 => "multicast (224.0.0.0/4)",
        _ if o[0] >= 240 => "reserved (240.0.0.0/4)",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    if ip.is_unspecified() {
        return Some("unspecified (::)");
    }
    if ip.is_loopback() {
        return Some("loopback (::1)");
    }
    let embedded =
        |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    // IPv4-compatible (::a.b.c.d, deprecated): never a real route
    if s[..6].iter().all(|&x| x == 0) {
        return Some("IPv4-compatible IPv6 (::/96)");
    }
    // NAT64 well-known prefix and 6to4 embed an IPv4 destination
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return forbidden_v4(embedded(s[6], s[7]));
    }
    if s[0] == 0x2002 {
        return forbidden_v4(embedded(s[1], s[2]));
    }
    Some(match s[0] {
        x if x & 0xfe00 == 0xfc00 => "unique local (fc00::/7)",
        x if x & 0xffc0 == 0xfe80 => "link-local (fe80::/10)",
        x if x & 0xffc0 == 0xfec0 => "site-local (fec0::/10)",
        x if x & 0xff00 == 0xff00 => "multicast (ff00::/8)",
        0x2001 if s[1] == 0xdb8 => "documentation (2001:db8::/32)",
        0x0100 if s[1..4] == [0, 0, 0] => "discard-only (100::/64)",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        match parse_host(s).unwrap() {
            Host::Ip(a) => a,
            Host::Name(n) => panic!("{s} parsed as the name {n}"),
        }
    }

    #[test]
    fn every_encoding_of_loopback_is_loopback() {
        for s in [
            "127.0.0.1",
            "2130706433",
            "0x7f000001",
            "0X7F000001",
            "0177.0.0.1",
            "0x7f.0.0.1",
            "127.1",
            "127.0.1",
            "[::ffff:127.0.0.1]",
            "::ffff:7f00:1",
            "[::1]",
            "127.0.0.1.",
        ] {
            let a = ip(s);
            assert!(forbidden(a).is_some(), "{s} -> {a} passed");
            assert!(
                forbidden(a).unwrap().contains("loopback"),
                "{s}: {:?}",
                forbidden(a)
            );
        }
    }

    #[test]
    fn metadata_and_private_ranges_in_any_encoding() {
        for (s, want) in [
            ("169.254.169.254", "metadata"),
            ("2852039166", "metadata"),
            ("0xa9fea9fe", "metadata"),
            ("0251.0376.0251.0376", "metadata"),
            ("[::ffff:169.254.169.254]", "metadata"),
            ("[64:ff9b::a9fe:a9fe]", "metadata"),
            ("[2002:a9fe:a9fe::1]", "metadata"),
            ("10.0.0.1", "private"),
            ("167772161", "private"),
            ("10.1", "private"),
            ("172.16.5.4", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("100.64.0.1", "CGNAT"),
            ("100.127.255.254", "CGNAT"),
            ("169.254.1.1", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("0", "unspecified"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "reserved"),
            ("[fd00::1]", "unique local"),
            ("[fc00::1]", "unique local"),
            ("[fe80::1]", "link-local"),
            ("[ff02::1]", "multicast"),
            ("[::]", "unspecified"),
            ("[::10.0.0.1]", "IPv4-compatible"),
        ] {
            let a = ip(s);
            let r = forbidden(a).unwrap_or_else(|| panic!("{s} -> {a} passed"));
            assert!(r.contains(want), "{s} -> {a}: {r}, wanted {want}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for s in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "172.15.255.255",
            "100.128.0.1",
            "100.63.255.255",
            "192.169.0.1",
            "151.101.0.223",
            "[2a04:4e42::223]",
            "[::ffff:8.8.8.8]",
            "[64:ff9b::808:808]",
        ] {
            let a = ip(s);
            assert_eq!(forbidden(a), None, "{s} -> {a}");
        }
    }

    #[test]
    fn names_and_malformed_hosts() {
        assert_eq!(
            parse_host("PyPI.org.").unwrap(),
            Host::Name("pypi.org".into())
        );
        assert_eq!(
            parse_host("files.pythonhosted.org").unwrap(),
            Host::Name("files.pythonhosted.org".into())
        );
        // numeric-looking hosts that are not addresses are refused, never
        // handed to a resolver that might read them differently
        for bad in [
            "",
            "256.0.0.1",
            "1.2.3.4.5",
            "0x",
            "99999999999",
            "a..b",
            "-a.org",
            "a b",
            "ex%41mple.org",
            "[::1%eth0]",
            "[1.2.3.4]",
            "1.2.3.0x1g",
        ] {
            assert!(
                parse_host(bad).is_err(),
                "{bad:?} accepted: {:?}",
                parse_host(bad)
            );
        }
    }
}
