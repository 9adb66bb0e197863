//! The seccomp filter of every sandbox: allow by default, deny a list of
//! syscalls that reach kernel attack surface a package-installing agent never
//! needs, or that would undo the other isolation layers.
//!
//! A deny-list (rather than Docker-style allow-list) keeps arbitrary toolchains
//! working; the list below is what the hardening review found open elsewhere.
//! Denied calls fail with `EPERM` (except `clone3`, which fails with `ENOSYS`
//! so libc falls back to `clone`, whose flags *can* be inspected).

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder,
    LinuxSeccompOperator, LinuxSyscall, LinuxSyscallBuilder,
};
use oci_spec::OciSpecError;

/// Syscalls denied outright with `EPERM`.
pub const DENIED_SYSCALLS: &[&str] = &[
    // io_uring bypasses seccomp for the operations it queues and has had a
    // long run of kernel bugs.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    // Kernel keyrings are not namespaced.
    "keyctl",
    "add_key",
    "request_key",
    // eBPF and perf: large kernel attack surface, host-wide observability.
    "bpf",
    "perf_event_open",
    // userfaultfd makes kernel races easy to win.
    "userfaultfd",
    // Kernel replacement and modules.
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "get_kernel_syms",
    "query_module",
    // Mount and namespace manipulation (harmless-ish inside our namespaces
    // without CAP_SYS_ADMIN, blocked anyway as defence in depth).
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    // Reading or writing other processes' memory.
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    // File-handle access bypasses the mount namespace (the "shocker" escape).
    "open_by_handle_at",
    "name_to_handle_at",
    // Host-wide state.
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "clock_settime",
    "clock_adjtime",
    "settimeofday",
    "stime",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    "nfsservctl",
    "uselib",
    "_sysctl",
    "iopl",
    "ioperm",
    "vm86",
    "vm86old",
    "fanotify_init",
];

/// `personality(2)` values that stay allowed: the Linux default, the query
/// value, and the two flags build tools use (`setarch -R`, `UNAME26`-free).
pub const ALLOWED_PERSONALITIES: &[u64] = &[0x0, 0x0008, 0x20000, 0x20008, 0xffff_ffff];

const AF_VSOCK: u64 = 40;
const CLONE_NEWUSER: u64 = 0x1000_0000;

/// Architectures the filter is compiled for. Syscalls made through any other
/// ABI are killed by the runtime's default bad-arch action, so the deny rules
/// cannot be bypassed through e.g. the 32-bit `int 0x80` entry.
fn architectures() -> Vec<Arch> {
    if cfg!(target_arch = "x86_64") {
        vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32]
    } else if cfg!(target_arch = "aarch64") {
        vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm]
    } else {
        vec![Arch::ScmpArchNative]
    }
}

fn eperm(names: &[&str]) -> Result<LinuxSyscall, OciSpecError> {
    LinuxSyscallBuilder::default()
        .names(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .action(LinuxSeccompAction::ScmpActErrno)
        .errno_ret(libc::EPERM as u32)
        .build()
}

/// The sandbox's seccomp profile.
pub fn profile() -> Result<LinuxSeccomp, OciSpecError> {
    let mut syscalls = vec![eperm(DENIED_SYSCALLS)?];
    // socket(AF_VSOCK, ...): vsock ignores network namespaces and this host is
    // a VM with a vsock device.
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["socket".to_string()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::EPERM as u32)
            .args(vec![LinuxSeccompArgBuilder::default()
                .index(0usize)
                .value(AF_VSOCK)
                .op(LinuxSeccompOperator::ScmpCmpEq)
                .build()?])
            .build()?,
    );
    // clone(CLONE_NEWUSER): a user namespace would hand back a full capability
    // set over the new namespace's resources.
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["clone".to_string()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::EPERM as u32)
            .args(vec![LinuxSeccompArgBuilder::default()
                .index(0usize)
                .value(CLONE_NEWUSER)
                .value_two(CLONE_NEWUSER)
                .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                .build()?])
            .build()?,
    );
    // clone3 passes its flags in memory that seccomp cannot read: ENOSYS makes
    // libc fall back to clone, which the rule above inspects.
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_string()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::ENOSYS as u32)
            .build()?,
    );
    // personality(x) for any x not allowed: one rule whose conditions
    // (all "arg0 != allowed") are ANDed.
    let not_allowed = ALLOWED_PERSONALITIES
        .iter()
        .map(|v| {
            LinuxSeccompArgBuilder::default()
                .index(0usize)
                .value(*v)
                .op(LinuxSeccompOperator::ScmpCmpNe)
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["personality".to_string()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::EPERM as u32)
            .args(not_allowed)
            .build()?,
    );
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActAllow)
        .architectures(architectures())
        .syscalls(syscalls)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_denies_the_required_calls() {
        let json = serde_json::to_value(profile().unwrap()).unwrap();
        assert_eq!(json["defaultAction"], "SCMP_ACT_ALLOW");
        let denied: Vec<String> = json["syscalls"][0]["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        for must in [
            "io_uring_setup",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "kexec_load",
            "init_module",
            "finit_module",
            "delete_module",
            "mount",
            "umount2",
            "pivot_root",
            "unshare",
            "setns",
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "open_by_handle_at",
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "clock_settime",
            "settimeofday",
        ] {
            assert!(denied.iter().any(|d| d == must), "{must} not denied");
        }
        assert_eq!(json["syscalls"][0]["errnoRet"], libc::EPERM);
        assert_eq!(json["syscalls"][1]["names"][0], "socket");
        assert_eq!(json["syscalls"][1]["args"][0]["value"], 40);
    }
}
