# The in-sandbox half of the security suite (`tests/security.rs`): each mode
# attempts one family of escapes from inside a sandbox and prints one JSON
# line {"checks": [{"name", "contained", "detail"}], "skipped": reason|null}.
# A check is "contained" when the attempt failed the way an isolated sandbox
# must make it fail. Every attempt is chosen so that, should it succeed, it
# changes nothing on the host (an open for writing is closed unwritten, a
# syscall gets arguments that are invalid past the permission check, state it
# would create belongs to this process and dies with it).
#
# Run as `python3 probe.py MODE [JSON-ARG]`. Only the standard library.

import ctypes
import errno
import json
import mmap
import os
import platform
import resource
import signal
import socket
import stat
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CHECKS = []
SKIPPED = None

DENIED = (errno.EPERM, errno.EACCES, errno.ENOSYS)
NOT_THERE = (errno.ENOENT, errno.EPERM, errno.EACCES, errno.ENXIO, errno.ENODEV, errno.EROFS)
UNREACHABLE = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL,
               errno.ETIMEDOUT, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EAFNOSUPPORT)


def check(name, contained, detail=""):
    CHECKS.append({"name": name, "contained": bool(contained), "detail": str(detail)})


def ename(e):
    return errno.errorcode.get(e, str(e))


def arg(a):
    if isinstance(a, int):
        return ctypes.c_long(a)
    return a


def syscall(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[arg(a) for a in args])
    return r, ctypes.get_errno()


def in_child(fn):
    """Runs fn() -> (ret, errno) in a forked child (a call that succeeds must
    not change this process: a new namespace, a chroot, a trace); returns
    what it returned, or (None, 'signal N') when it died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            ret, e = fn()
            if ret == 0 and e == "child-of-clone":
                os._exit(0)
            os.write(w, json.dumps([ret, e]).encode())
        except BaseException as ex:  # noqa: BLE001 - report anything
            os.write(w, json.dumps([None, "exception " + repr(ex)]).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return None, "signal %d" % os.WTERMSIG(status)
    if not data:
        return None, "no answer"
    ret, e = json.loads(data)
    return ret, e


def denied_call(name, fn, ok=DENIED):
    """`fn` makes one call and returns (ret, errno); contained when it failed
    with one of `ok`."""
    ret, e = in_child(fn)
    if ret is None:
        check(name, False, e)
    elif ret >= 0:
        check(name, False, "succeeded (%d)" % ret)
    else:
        check(name, e in ok, "refused: " + ename(e))


def sc(nr, *args):
    return lambda: syscall(nr, *args)


# x86_64 system call numbers (the suite runs on x86_64 hosts).
NR = dict(
    socket=41, clone=56, ptrace=101, syslog=103, mknod=133, pivot_root=155, chroot=161,
    acct=163, settimeofday=164, mount=165, umount2=166, swapon=167, swapoff=168, reboot=169,
    iopl=172, ioperm=173, init_module=175, delete_module=176, kexec_load=246, add_key=248,
    request_key=249, keyctl=250, unshare=272, perf_event_open=298, fanotify_init=300,
    open_by_handle_at=304, setns=308, process_vm_readv=310, kcmp=312, finit_module=313,
    kexec_file_load=320, bpf=321, userfaultfd=323, io_uring_setup=425, open_tree=428,
    fsopen=430, pidfd_open=434, clone3=435, pidfd_getfd=438,
)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MNT_DETACH = 2


def cstr(s):
    return ctypes.c_char_p(s.encode())


def buf(n):
    return ctypes.create_string_buffer(n)


# ---------------------------------------------------------------- modes


def mode_caps(a):
    """Root's capabilities: never more than the documented set, nothing
    inheritable or ambient, no new privileges, a seccomp filter."""
    allowed = int(a["allowed_mask"])
    for who in ("self", "1"):
        fields = {}
        with open("/proc/%s/status" % who) as f:
            for line in f:
                k, _, v = line.partition(":")
                fields[k] = v.strip()
        for k in ("CapEff", "CapPrm", "CapBnd"):
            v = int(fields[k], 16)
            extra = v & ~allowed
            check("%s %s within the allowed set" % (who, k), extra == 0,
                  "%s (extra bits %#x)" % (fields[k], extra))
        for k in ("CapInh", "CapAmb"):
            if k == "CapAmb" and k not in fields:
                continue  # gVisor's /proc/PID/status has no CapAmb line
            check("%s %s empty" % (who, k), int(fields[k], 16) == 0, fields[k])
        check("%s NoNewPrivs" % who, fields.get("NoNewPrivs") == "1", fields.get("NoNewPrivs"))
        if a.get("seccomp", True):
            check("%s seccomp filter" % who, fields.get("Seccomp") == "2", fields.get("Seccomp"))


def mode_mounts(a):
    """mount, remount, umount (unmasking), new mount API: all refused, and
    the mount table is unchanged afterwards."""
    before = open("/proc/self/mountinfo").read()
    os.makedirs("/tmp/aviary-mnt", exist_ok=True)
    tries = [
        ("mount tmpfs", sc(NR["mount"], cstr("none"), cstr("/tmp/aviary-mnt"), cstr("tmpfs"), 0, None)),
        ("mount proc", sc(NR["mount"], cstr("proc"), cstr("/tmp/aviary-mnt"), cstr("proc"), 0, None)),
        ("mount sysfs", sc(NR["mount"], cstr("sysfs"), cstr("/tmp/aviary-mnt"), cstr("sysfs"), 0, None)),
        ("mount cgroup", sc(NR["mount"], cstr("cgroup"), cstr("/tmp/aviary-mnt"), cstr("cgroup"), 0, cstr("memory"))),
        ("bind / elsewhere", sc(NR["mount"], cstr("/"), cstr("/tmp/aviary-mnt"), None, MS_BIND | MS_REC, None)),
        ("remount /proc rw", sc(NR["mount"], None, cstr("/proc"), None, MS_REMOUNT | MS_BIND, None)),
        ("remount /proc/sys rw", sc(NR["mount"], None, cstr("/proc/sys"), None, MS_REMOUNT | MS_BIND, None)),
        ("remount /sys rw", sc(NR["mount"], None, cstr("/sys"), None, MS_REMOUNT, None)),
        ("move /proc", sc(NR["mount"], cstr("/proc"), cstr("/tmp/aviary-mnt"), None, MS_MOVE, None)),
        ("umount /proc/kcore (unmask)", sc(NR["umount2"], cstr("/proc/kcore"), MNT_DETACH)),
        ("umount /proc/sys (unmask)", sc(NR["umount2"], cstr("/proc/sys"), MNT_DETACH)),
        ("umount /proc", sc(NR["umount2"], cstr("/proc"), MNT_DETACH)),
        ("umount /sys/fs/cgroup", sc(NR["umount2"], cstr("/sys/fs/cgroup"), MNT_DETACH)),
        ("pivot_root", sc(NR["pivot_root"], cstr("/tmp"), cstr("/tmp/aviary-mnt"))),
        ("fsopen proc", sc(NR["fsopen"], cstr("proc"), 0)),
        ("open_tree clone /", sc(NR["open_tree"], -100, cstr("/"), 1)),
    ]
    for name, fn in tries:
        denied_call(name, fn)
    # the mount(8) binary too, when the image has it
    if os.path.exists("/bin/mount"):
        rc = os.system("/bin/mount -t proc proc /tmp/aviary-mnt >/dev/null 2>&1")
        check("mount(8) proc", rc != 0, "exit %d" % rc)
    after = open("/proc/self/mountinfo").read()
    check("mount table unchanged", before == after,
          "" if before == after else "changed:\n" + after)
    try:
        size = len(open("/proc/kcore", "rb").read(64))
        check("/proc/kcore still masked", size == 0, "read %d bytes" % size)
    except OSError as e:
        check("/proc/kcore still masked", e.errno in NOT_THERE, ename(e.errno))


def try_open_write(name, path):
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        check(name, e.errno in NOT_THERE + (errno.EINVAL, errno.EISDIR), "refused: " + ename(e.errno))
        return
    os.close(fd)  # never written: the open alone is the finding
    check(name, False, "opened %s for writing" % path)


def mode_proc_sys(a):
    """/proc/sys, /proc/sysrq-trigger and the other kernel knobs of /proc
    cannot be opened for writing; masked files read empty."""
    for p in ["/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname",
              "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches",
              "/proc/sys/fs/file-max", "/proc/sys/net/ipv4/ip_forward",
              "/proc/sysrq-trigger", "/proc/sys/kernel/sysrq",
              "/proc/irq/default_smp_affinity", "/proc/bus/pci/devices",
              "/proc/sys/fs/binfmt_misc/register",
              "/proc/self/oom_score_adj"]:
        if p == "/proc/self/oom_score_adj":
            # lowering it (making the sandbox the host's last OOM victim)
            # needs CAP_SYS_RESOURCE
            try:
                with open(p, "w") as f:
                    f.write("-1000")
                check("lower oom_score_adj", False, "wrote -1000")
            except OSError as e:
                check("lower oom_score_adj", e.errno in DENIED, "refused: " + ename(e.errno))
            continue
        try_open_write("open %s for writing" % p, p)
    # the user namespace's id maps are written once, by the runtime: a
    # rewrite (to map host root) must fail
    for p, data in [("/proc/self/uid_map", "0 0 4294967295\n"), ("/proc/self/gid_map", "0 0 4294967295\n"),
                    ("/proc/1/uid_map", "0 0 1\n"), ("/proc/self/setgroups", "allow\n")]:
        try:
            with open(p, "w") as f:
                f.write(data)
            check("rewrite %s" % p, False, "wrote %r" % data)
        except OSError as e:
            check("rewrite %s" % p, True, "refused: " + ename(e.errno))
    for p in ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug"]:
        try:
            n = len(open(p, "rb").read(256))
            check("%s masked" % p, n == 0, "read %d bytes" % n)
        except OSError as e:
            check("%s masked" % p, e.errno in NOT_THERE, ename(e.errno))


def mode_sys(a):
    """/sys and the cgroup file system are read-only and show only the
    sandbox's own cgroup: no release_agent, no raising its own limits."""
    for p in ["/sys/kernel/uevent_helper", "/sys/kernel/mm/transparent_hugepage/enabled",
              "/sys/power/state", "/sys/module/kernel/parameters/panic",
              "/sys/fs/cgroup/memory/release_agent", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
              "/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/memory/cgroup.procs",
              "/sys/fs/cgroup/devices/devices.allow", "/sys/fs/cgroup/unified/cgroup.procs",
              "/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/pids.max"]:
        if os.path.exists(p) or p.startswith("/sys/kernel/uevent") or p.endswith("release_agent"):
            try_open_write("open %s for writing" % p, p)
    for d in ["/sys/fs/cgroup/memory/aviary-escape", "/sys/fs/cgroup/aviary-escape",
              "/sys/kernel/aviary-escape"]:
        try:
            os.mkdir(d)
            fs = [l.split(" - ")[1].split()[0] for l in open("/proc/self/mountinfo")
                  if l.split()[4] == os.path.dirname(d)]
            os.rmdir(d)
            check("mkdir %s" % d, False, "created on %s" % fs)
        except OSError as e:
            check("mkdir %s" % d, e.errno in NOT_THERE + (errno.EEXIST,), "refused: " + ename(e.errno))
    # the cgroup namespace: the sandbox's own cgroup is the root it sees
    with open("/proc/self/cgroup") as f:
        paths = [l.strip().split(":", 2)[2] for l in f if l.strip()]
    bad = [p for p in paths if "aviary" in p or "sbx" in p]
    check("own cgroup is the root it sees", not bad, "/proc/self/cgroup: %s" % paths)
    siblings = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        siblings += [os.path.join(root, d) for d in dirs if "sbx" in d or d == "aviary"]
    check("no other sandbox's cgroup visible", not siblings, siblings[:5])


def mode_devices(a):
    """Only the standard character devices exist; no node can be made, and
    the host's devices cannot be opened."""
    allowed = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2)}
    found = []
    for root, dirs, files in os.walk("/dev"):
        dirs[:] = [d for d in dirs if d not in ("shm", "mqueue")]
        for n in files + dirs:
            p = os.path.join(root, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISBLK(st.st_mode):
                found.append("%s block %d:%d" % (p, os.major(st.st_rdev), os.minor(st.st_rdev)))
            elif stat.S_ISCHR(st.st_mode):
                mm = (os.major(st.st_rdev), os.minor(st.st_rdev))
                if mm not in allowed and mm[0] != 136:
                    found.append("%s char %d:%d" % (p, mm[0], mm[1]))
    check("/dev holds only the standard nodes", not found, found)
    for p in ["/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/kvm", "/dev/vsock",
              "/dev/vhost-vsock", "/dev/vhost-net", "/dev/vda", "/dev/sda", "/dev/nvme0n1",
              "/dev/loop0", "/dev/loop-control", "/dev/mapper/control", "/dev/fuse",
              "/dev/net/tun", "/dev/dri/card0", "/dev/watchdog", "/dev/cpu/0/msr"]:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
            check("open %s" % p, False, "opened")
        except OSError as e:
            check("open %s" % p, e.errno in NOT_THERE, "refused: " + ename(e.errno))
    for name, mode, dev in [("mknod /dev/mem (1:1)", stat.S_IFCHR, os.makedev(1, 1)),
                            ("mknod /dev/kmsg (1:11)", stat.S_IFCHR, os.makedev(1, 11)),
                            ("mknod /dev/kvm (10:232)", stat.S_IFCHR, os.makedev(10, 232)),
                            ("mknod loop0 (block 7:0)", stat.S_IFBLK, os.makedev(7, 0)),
                            ("mknod vda (block 253:0)", stat.S_IFBLK, os.makedev(253, 0))]:
        for d in ("/tmp", "/workspace", "/"):
            p = os.path.join(d, "aviary-node")
            try:
                os.mknod(p, mode | 0o600, dev)
                os.unlink(p)
                check("%s in %s" % (name, d), False, "made")
            except OSError as e:
                check("%s in %s" % (name, d), e.errno in DENIED, "refused: " + ename(e.errno))


def bpf_attr():
    b = buf(128)
    struct.pack_into("IIII", b, 0, 2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    return b


def perf_attr():
    b = buf(128)
    struct.pack_into("IIQ", b, 0, 1, 128, 0)  # PERF_TYPE_SOFTWARE, size, CPU_CLOCK
    return b


def handle():
    # struct file_handle { u32 handle_bytes; int handle_type; u8 f_handle[8] }:
    # inode 2 (a file system's root), generation 0: the "shocker" escape
    b = buf(16)
    struct.pack_into("IiII", b, 0, 8, 1, 2, 0)
    return b


def clone_child(flags):
    def run():
        r, e = syscall(NR["clone"], flags | signal.SIGCHLD, 0, 0, 0, 0)
        if r == 0:
            os._exit(0)  # the clone's child: nothing to do
        if r > 0:
            os.waitpid(r, 0)
        return r, e
    return run


def setns_own(kind, nstype):
    def run():
        fd = os.open("/proc/self/ns/" + kind, os.O_RDONLY)
        return syscall(NR["setns"], fd, nstype)
    return run


def pidfd_getfd_pid1():
    r, e = syscall(NR["pidfd_open"], 1, 0)
    if r < 0:
        return r, e
    return syscall(NR["pidfd_getfd"], r, 0, 0)


def open_by_handle():
    fd = os.open("/workspace", os.O_RDONLY)
    return syscall(NR["open_by_handle_at"], fd, handle(), os.O_RDONLY)


def process_vm_readv_pid1():
    local = buf(64)
    iov = struct.pack("QQ", ctypes.addressof(local), 64)
    liov = buf(16)
    ctypes.memmove(liov, iov, 16)
    riov = buf(16)
    struct.pack_into("QQ", riov, 0, 0x400000, 64)
    return syscall(NR["process_vm_readv"], 1, liov, 1, riov, 1, 0)


def settimeofday_same():
    tv = buf(16)
    tz = buf(8)
    libc.gettimeofday(tv, tz)
    return syscall(NR["settimeofday"], None, tz)  # the same time zone: harmless if allowed


def socket_call(family, typ, proto):
    return sc(NR["socket"], family, typ, proto)


def mode_syscalls(a):
    """Kernel interfaces a sandbox must not reach, each attempted for real
    (with arguments that would be harmless past the permission check)."""
    if platform.machine() != "x86_64":
        global SKIPPED
        SKIPPED = "system call numbers are x86_64's; this is " + platform.machine()
        return
    S = DENIED
    SOCK = DENIED + (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.ESOCKTNOSUPPORT)
    tries = [
        ("keyctl (session keyring)", sc(NR["keyctl"], 0, -3, 1), S),
        ("add_key", sc(NR["add_key"], cstr("user"), cstr("aviary-probe"), cstr("x"), 1, -2), S),
        ("request_key", sc(NR["request_key"], cstr("user"), cstr("aviary-probe"), None, 0), S),
        ("bpf map create", lambda: syscall(NR["bpf"], 0, bpf_attr(), 72), S),
        ("perf_event_open", lambda: syscall(NR["perf_event_open"], perf_attr(), 0, -1, -1, 0), S),
        ("userfaultfd", sc(NR["userfaultfd"], 0o2000000), S),
        ("io_uring_setup", lambda: syscall(NR["io_uring_setup"], 1, buf(120)), S),
        ("kexec_load", sc(NR["kexec_load"], 0, 0, None, 0xFFFFFFFF), S),
        ("kexec_file_load", sc(NR["kexec_file_load"], -1, -1, 0, None, 0), S),
        ("init_module", sc(NR["init_module"], None, 0, cstr("")), S),
        ("finit_module", sc(NR["finit_module"], -1, cstr(""), 0), S),
        ("delete_module", sc(NR["delete_module"], cstr("aviary_absent"), 0), S),
        ("ptrace attach envd (pid 1)", sc(NR["ptrace"], 16, 1, 0, 0), S),
        ("process_vm_readv envd", process_vm_readv_pid1, S),
        ("pidfd_getfd from envd", pidfd_getfd_pid1, S),
        ("kcmp with envd", lambda: syscall(NR["kcmp"], os.getpid(), 1, 0, 0, 0), S),
        ("open_by_handle_at (shocker)", open_by_handle, S),
        ("unshare user ns", sc(NR["unshare"], CLONE_NEWUSER), S),
        ("unshare mount ns", sc(NR["unshare"], CLONE_NEWNS), S),
        ("unshare net ns", sc(NR["unshare"], CLONE_NEWNET), S),
        ("unshare pid ns", sc(NR["unshare"], CLONE_NEWPID), S),
        ("unshare cgroup ns", sc(NR["unshare"], CLONE_NEWCGROUP), S),
        ("unshare uts+ipc", sc(NR["unshare"], CLONE_NEWUTS | CLONE_NEWIPC), S),
        ("setns (own net ns)", setns_own("net", CLONE_NEWNET), S),
        ("setns (own mount ns)", setns_own("mnt", CLONE_NEWNS), S),
        ("clone(CLONE_NEWUSER)", clone_child(CLONE_NEWUSER), S),
        ("clone(CLONE_NEWNS)", clone_child(CLONE_NEWNS), S),
        ("clone3", lambda: syscall(NR["clone3"], buf(88), 88), S),
        ("reboot (invalid command)", sc(NR["reboot"], 0xfee1dead, 672274793, 0x0BADC0DE, None), S),
        ("swapon", sc(NR["swapon"], cstr("/aviary-absent"), 0), S),
        ("swapoff", sc(NR["swapoff"], cstr("/aviary-absent")), S),
        ("acct", sc(NR["acct"], cstr("/aviary-absent/acct")), S),
        ("syslog read (kernel log)", lambda: syscall(NR["syslog"], 3, buf(1024), 1024), S),
        ("settimeofday (same zone)", settimeofday_same, S),
        ("iopl", sc(NR["iopl"], 3), S),
        ("ioperm", sc(NR["ioperm"], 0x80, 1, 1), S),
        ("fanotify_init", sc(NR["fanotify_init"], 0, 0), S),
        ("socket AF_VSOCK", socket_call(40, socket.SOCK_STREAM, 0), SOCK),
        ("socket AF_PACKET", socket_call(17, socket.SOCK_RAW, 0x0300), SOCK),
        ("socket AF_INET raw", socket_call(2, socket.SOCK_RAW, 1), SOCK),
        ("socket AF_INET6 raw", socket_call(10, socket.SOCK_RAW, 58), SOCK),
    ]
    for name, fn, ok in tries:
        denied_call(name, fn, ok)


def int80(nr, a1):
    """A 32-bit system call through `int 0x80` from this 64-bit process:
    seccomp filters must cover that ABI too."""
    code = bytes([0x53, 0xb8]) + struct.pack("<I", nr) + bytes([0xbb]) + struct.pack("<I", a1) + \
        bytes([0xcd, 0x80, 0x5b, 0xc3])  # push rbx; mov eax; mov ebx; int 0x80; pop rbx; ret
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    f = ctypes.CFUNCTYPE(ctypes.c_int)(addr)
    r = f()
    return (r, -r) if r < 0 else (r, 0)


def mode_abi(a):
    """The same refusals through the other system call ABIs of an x86_64
    kernel: i386 (`int 0x80`) and x32 (bit 30 set)."""
    if platform.machine() != "x86_64":
        global SKIPPED
        SKIPPED = "x86 ABIs only"
        return
    # i386: unshare = 310, ptrace = 26, mount = 21 (a1 only: flags/request)
    for name, nr, a1 in [("i386 unshare(CLONE_NEWUSER)", 310, CLONE_NEWUSER),
                         ("i386 unshare(CLONE_NEWNS)", 310, CLONE_NEWNS),
                         ("i386 keyctl", 288, 0)]:
        ret, e = in_child(lambda: int80(nr, a1))
        if ret is None and e.startswith("signal"):
            check(name, True, "the i386 ABI is not available (%s)" % e)
        elif ret is None:
            check(name, False, e)
        else:
            check(name, ret < 0 and e in DENIED, "ret %d %s" % (ret, ename(e) if e else ""))
    for name, nr, args in [("x32 unshare(CLONE_NEWUSER)", 0x40000000 + 272, [CLONE_NEWUSER]),
                           ("x32 keyctl", 0x40000000 + 250, [0, -3, 1])]:
        denied_call(name, sc(nr, *args))


def mode_envd(a):
    """envd, PID 1, is closed to the sandbox: its memory, environment, file
    descriptors and root cannot be read, and SIGKILL does not reach it."""
    for p in ["/proc/1/mem", "/proc/1/environ", "/proc/1/maps", "/proc/1/auxv", "/proc/1/stack"]:
        try:
            with open(p, "rb") as f:
                data = f.read(64)
            check("read %s" % p, False, "read %d bytes" % len(data))
        except OSError as e:
            check("read %s" % p, e.errno in DENIED + (errno.EIO, errno.ENOENT), "refused: " + ename(e.errno))
    for p in ["/proc/1/root", "/proc/1/cwd", "/proc/1/exe"]:
        try:
            t = os.readlink(p)
            check("readlink %s" % p, False, t)
        except OSError as e:
            check("readlink %s" % p, e.errno in DENIED, "refused: " + ename(e.errno))
    try:
        fds = os.listdir("/proc/1/fd")
    except OSError:
        fds = []  # not even listable: stricter still
    followed = []
    for n in fds:
        for op in (os.readlink, lambda p: os.close(os.open(p, os.O_RDONLY))):
            try:
                op("/proc/1/fd/" + n)
                followed.append(n)
            except OSError as e:
                if e.errno not in DENIED + (errno.ENOENT,):
                    followed.append("%s (%s)" % (n, ename(e.errno)))
    check("follow or open envd's fds", not followed, "%d fds, followed %s" % (len(fds), followed[:5]))
    with open("/proc/1/cmdline", "rb") as f:
        cmd = f.read().split(b"\0")[0].decode(errors="replace")
    check("PID 1 is envd", cmd == a["envd"], cmd)
    for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
        try:
            os.kill(1, sig)
        except OSError:
            pass
    time.sleep(0.2)
    with open("/proc/1/status") as f:
        st = [l for l in f if l.startswith("State:")][0].strip()
    check("envd survives SIGKILL/SIGSTOP/SIGTERM", "T (stopped)" not in st and "Z" not in st.split()[1], st)


def mode_chroot(a):
    """The classic chroot escape lands in the sandbox's own root: the root a
    sandbox sees is its mount namespace's root, not a chroot."""
    def run():
        os.makedirs("/tmp/aviary-jail", exist_ok=True)
        fd = os.open("/", os.O_RDONLY)
        os.chroot("/tmp/aviary-jail")
        os.fchdir(fd)
        for _ in range(64):
            os.chdir("..")
        os.chroot(".")
        names = sorted(os.listdir("/"))
        ok = ".aviary" in names and not os.path.exists(a["data_dir"])
        return (0 if ok else 1), ",".join(names)
    ret, e = in_child(run)
    check("chroot escape stays in the sandbox", ret == 0, e)


def readlink(p):
    try:
        return os.readlink(p)
    except OSError as e:
        return "error " + ename(e.errno)


def mode_namespaces(a):
    """Own PID, mount, network, UTS, IPC, cgroup and user namespaces; PID 1 is
    envd; no host process, no host hostname, only loopback."""
    for kind, host in sorted(a["host_ns"].items()):
        mine = readlink("/proc/self/ns/" + kind)
        check("own %s namespace" % kind, mine != host and not mine.startswith("error"),
              "inside %s, host %s" % (mine, host))
    own_pid_ns = readlink("/proc/self/ns/pid")
    foreign = []
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for p in pids:
        ns = readlink("/proc/%s/ns/pid" % p)
        if not ns.startswith("error") and ns != own_pid_ns:
            foreign.append((p, ns))
        try:
            comm = open("/proc/%s/comm" % p).read().strip()
        except OSError:
            continue
        if comm in a["host_comms"]:
            foreign.append((p, comm))
    check("no host process visible", not foreign, "%d pids, foreign: %s" % (len(pids), foreign[:5]))
    hp = str(a["host_pid"])
    if os.path.exists("/proc/" + hp):
        comm = open("/proc/%s/comm" % hp).read().strip()
        check("the test's own host pid is not visible", comm != a["host_comm"], comm)
    else:
        check("the test's own host pid is not visible", True, "no /proc/" + hp)
    name = socket.gethostname()
    check("own hostname", name != a["host_hostname"], name)
    try:
        libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        ctypes.set_errno(0)
        r = libc.sethostname(name.encode(), len(name))
        e = ctypes.get_errno()
        check("sethostname refused", r != 0 and e in DENIED, "ret %d %s" % (r, ename(e)))
    except AttributeError:
        pass
    with open("/proc/net/dev") as f:
        ifaces = sorted(l.split(":")[0].strip() for l in f.readlines()[2:])
    check("only loopback", ifaces == ["lo"], ifaces)


def connect_tcp(host, port, timeout=3):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return None
    except socket.timeout:
        return errno.ETIMEDOUT
    except OSError as e:
        return e.errno
    finally:
        s.close()


def connect_unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return None
    except OSError as e:
        return e.errno
    finally:
        s.close()


def must_fail(name, err):
    if err is None:
        check(name, False, "connected")
    else:
        check(name, err in UNREACHABLE, "refused: " + ename(err))


def absent(name, path):
    try:
        os.lstat(path)
        check(name, False, "%s exists" % path)
    except OSError as e:
        check(name, e.errno in NOT_THERE + (errno.ENOTDIR,), ename(e.errno))


def mode_host(a):
    """The host's services: its loopback and its addresses, its unix sockets
    (by path and abstract), the server's data dir: none reachable."""
    for host, port in a["tcp"]:
        must_fail("tcp %s:%d" % (host, port), connect_tcp(host, port))
    for p in a["unix"]:
        must_fail("unix %s" % p, connect_unix(p))
        absent("path %s not visible" % p, p)
    for n in a["abstract"]:
        must_fail("abstract unix @%s" % n, connect_unix("\0" + n))
    for p in a["absent"]:
        absent("host path %s not visible" % p, p)
    mi = open("/proc/self/mountinfo").read()
    leaks = [p for p in a["absent"] if p in mi]
    check("no host path in mountinfo", not leaks, leaks)


def mode_peer(a):
    """Another sandbox (another tenant's): its files, processes, IPC,
    loopback, abstract sockets and host-side paths are out of reach."""
    secret = a["secret"]
    leaks = []
    mine = {str(os.getpid()), str(os.getppid())}
    for p in os.listdir("/proc"):
        if p.isdigit() and p not in mine:
            try:
                if secret.encode() in open("/proc/%s/cmdline" % p, "rb").read():
                    leaks.append(p)
            except OSError:
                pass
    check("the peer's processes are not visible", not leaks, leaks)
    for p in ["/workspace/secret", "/tmp/secret", "/dev/shm/secret"]:
        try:
            found = secret in open(p).read()
        except OSError:
            found = False
        check("the peer's %s is not here" % p, not found, "")
    must_fail("the peer's loopback port", connect_tcp("127.0.0.1", a["port"]))
    must_fail("the peer's abstract socket", connect_unix("\0" + a["abstract"]))
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    ctypes.set_errno(0)
    r = libc.shmget(a["shm_key"], 0, 0)
    e = ctypes.get_errno()
    check("the peer's SysV shared memory", r < 0 and e == errno.ENOENT, "ret %d %s" % (r, ename(e)))
    for p in a["host_paths"]:
        absent("the peer's host path %s" % p, p)
        if p.endswith(".sock"):
            must_fail("the peer's envd socket", connect_unix(p))


def mode_victim(a):
    """(Setup, not a probe) the peer: plants a secret in files, its argv, a
    loopback listener, an abstract socket and SysV shared memory, then
    stays alive in its own session."""
    secret = a["secret"]
    for p in ["/workspace/secret", "/tmp/secret", "/dev/shm/secret"]:
        with open(p, "w") as f:
            f.write(secret)
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    if libc.shmget(a["shm_key"], 4096, 0o1666) < 0:
        print(json.dumps({"error": "shmget " + ename(ctypes.get_errno())}))
        return
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        t = socket.socket()
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind(("127.0.0.1", a["port"]))
        t.listen(8)
        u = socket.socket(socket.AF_UNIX)
        u.bind("\0" + a["abstract"])
        u.listen(8)
        os.write(w, b"ready")
        os.close(w)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.set_inheritable(t.fileno(), True)
        os.set_inheritable(u.fileno(), True)
        # the same sockets, held by a process whose argv carries the secret
        os.execv(sys.executable, [sys.executable, "-c",
                                  "import socket, time\n"
                                  "held = [socket.socket(fileno=%d), socket.socket(fileno=%d)]\n"
                                  "while True:\n    time.sleep(60)\n" % (t.fileno(), u.fileno()),
                                  secret])
    os.close(w)
    ok = os.read(r, 16)
    print(json.dumps({"ready": ok == b"ready"}))


def mode_self_reach(a):
    """(Positive control) the peer reaches its own listener and abstract
    socket, so the peer probe's refusals mean isolation, not absence."""
    for _ in range(50):
        if connect_tcp("127.0.0.1", a["port"]) is None:
            break
        time.sleep(0.1)
    check("own loopback port reachable", connect_tcp("127.0.0.1", a["port"]) is None)
    check("own abstract socket reachable", connect_unix("\0" + a["abstract"]) is None)


def mode_network_none(a):
    """Profile `none`: no route out, no DNS."""
    for host, port in [("1.1.1.1", 80), ("8.8.8.8", 53), ("169.254.169.254", 80),
                       ("2606:4700:4700::1111", 80)]:
        must_fail("tcp %s:%d" % (host, port), connect_tcp(host, port))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01",
                 ("8.8.8.8", 53))
        check("udp to a resolver", False, "sent")
    except OSError as e:
        check("udp to a resolver", e.errno in UNREACHABLE, "refused: " + ename(e.errno))
    finally:
        s.close()
    try:
        r = socket.getaddrinfo("example.com", 80)
        check("DNS resolution", False, r[:1])
    except socket.gaierror as e:
        check("DNS resolution", True, str(e))
    with open("/proc/net/route") as f:
        routes = f.readlines()[1:]
    check("no IPv4 route", not routes, routes)


def via_proxy(raw):
    """One raw request to the egress proxy envd serves on the sandbox's
    loopback; the status code and the body."""
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    try:
        s.sendall(raw.encode())
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if raw.startswith("CONNECT") and b"\r\n\r\n" in out:
                break
    except OSError as e:
        return 0, "error " + ename(e.errno)
    finally:
        s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return code, body.decode(errors="replace")


def mode_allowlist(a):
    """Profile `allowlist`: the allowed host is reached through the proxy
    (the control); loopback, metadata, private and unlisted targets are
    refused by it in any spelling; nothing goes around it."""
    host = a["allowed"]
    code, body = via_proxy("GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (host, host))
    check("the allowed host through the proxy (control)", code == 200 and "allowed origin" in body,
          "%d %s" % (code, body[:80]))
    for url in a["denied_requests"]:
        h = url.split("/")[2]
        code, body = via_proxy("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (url, h))
        check("GET %s through the proxy" % url, code >= 400 or code == 0, "%d %s" % (code, body[:80]))
    for target in a["denied_connects"]:
        code, body = via_proxy("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target))
        check("CONNECT %s through the proxy" % target, code >= 400 or code == 0, "%d" % code)
    for h, port in a["direct"]:
        must_fail("direct tcp %s:%d" % (h, port), connect_tcp(h, port))
    must_fail("direct tcp 1.1.1.1:443", connect_tcp("1.1.1.1", 443))
    try:
        r = socket.getaddrinfo("example.com", 80)
        check("DNS resolution in the sandbox", False, r[:1])
    except socket.gaierror as e:
        check("DNS resolution in the sandbox", True, str(e))


def mode_forkbomb(a):
    """Forks until the kernel says no; the count stays under the pids limit."""
    children = []
    err = None
    try:
        while len(children) < 100000:
            pid = os.fork()
            if pid == 0:
                signal.pause()
                os._exit(0)
            children.append(pid)
    except OSError as e:
        err = e.errno
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    check("fork refused at the pids limit", err == errno.EAGAIN and len(children) < a["pids"],
          "%d children, then %s" % (len(children), ename(err) if err else "no error"))


def mode_membomb(a):
    """Allocates (and touches) four times the memory limit; it must be
    killed or refused long before."""
    chunks = []
    try:
        for _ in range(a["memory_mb"] * 4 // 16):
            chunks.append(bytearray(b"\x01") * (16 << 20))
    except MemoryError:
        print(json.dumps({"checks": [{"name": "memory bomb", "contained": True,
                                      "detail": "MemoryError after %d MiB" % (16 * len(chunks))}],
                          "skipped": None}))
        sys.exit(0)
    check("memory bomb", False, "allocated %d MiB" % (16 * len(chunks)))


def fill(path, budget_mb):
    written = 0
    err = None
    chunk = b"\xa5" * (1 << 20)
    try:
        with open(path, "wb") as f:
            while written < 4 * budget_mb << 20:
                f.write(chunk)
                written += len(chunk)
                if written % (16 << 20) == 0:
                    f.flush()
                    os.fsync(f.fileno())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        err = e.errno
    try:
        os.unlink(path)
    except OSError:
        pass
    return written, err


def mode_diskfill(a):
    """Fills the workspace, then the root file system, until the disk
    budget says no; the bytes that fit stay within the budget."""
    for path in ["/workspace/aviary-fill", "/var/tmp/aviary-fill"]:
        written, err = fill(path, a["disk_mb"])
        check("fill %s" % path,
              err in (errno.ENOSPC, errno.EDQUOT) and written <= a["disk_mb"] << 20,
              "%d MiB written, then %s" % (written >> 20, ename(err) if err else "no error"))


def mode_fdbomb(a):
    """Opens files until refused: at the per-process limit (which root in
    the sandbox cannot raise past its bound), never the host's table."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard + 1 if hard != resource.RLIM_INFINITY else hard))
        check("raise the fd hard limit", False, "raised past %d" % hard)
    except (ValueError, OSError):
        check("raise the fd hard limit", True, "hard %d" % hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fds = []
    err = None
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        err = e.errno
    n = len(fds)
    for fd in fds:
        os.close(fd)
    file_max = int(open("/proc/sys/fs/file-max").read())
    check("fd exhaustion stops at the process limit", err == errno.EMFILE and hard <= a["max_nofile"],
          "%d opened, then %s (hard limit %d, bound %d; the sandbox's whole budget, pids x hard, "
          "is %d against the host's fs.file-max %d)"
          % (n, ename(err) if err else "-", hard, a["max_nofile"], a["pids"] * hard, file_max))


MODES = {k[5:]: v for k, v in globals().items() if k.startswith("mode_")}

if __name__ == "__main__":
    mode = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    MODES[mode](args)
    if mode != "victim":
        print(json.dumps({"checks": CHECKS, "skipped": SKIPPED}))
