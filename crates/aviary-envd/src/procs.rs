//! Processes of the sandbox: listing (`/proc` in envd's own PID namespace),
//! signalling one, and background commands whose output outlives the
//! connection that started them.
//!
//! Invariants:
//! - Everything read from `/proc` and `/etc/passwd` is the sandbox's to
//!   write: reads are bounded ([`MAX_PROC_FILE`]), arguments are cut to
//!   [`MAX_LISTED_ARG`] bytes and [`MAX_LISTED_ARGS`] of them, at most
//!   [`MAX_LISTED_PROCESSES`] processes are listed, and nothing of it is
//!   interpreted beyond numbers.
//! - `signal` and `spawn` are fenced (checked under the fence gate at the
//!   effect); envd itself and pid 1 are never signalled, and only a fixed
//!   set of signals is sent.
//! - A background command keeps the newest [`BACKGROUND_RING_BYTES`] of
//!   each stream and its exit; at most [`MAX_BACKGROUND`] handles are kept
//!   (the oldest finished one makes room, none finished is `busy`). A fence
//!   move forgets every handle (the sweep ends their processes), so a new
//!   lease holder never reads the previous holder's output.
//!
//! Concurrency: a background command has two reader threads (one per pipe)
//! and one waiter thread; they and the readers of `output` meet at the
//! job's mutex and condition variable, held only to copy bytes.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use aviary_envd_proto::{
    encode_json, write_frame, BackgroundInfo, ErrorBody, ErrorCode, ExitWire, FrameKind,
    ProcessInfo, Response, BACKGROUND_RING_BYTES, CHUNK_SIZE, MAX_BACKGROUND, MAX_JSON_FRAME,
    MAX_LISTED_ARG, MAX_LISTED_ARGS, MAX_LISTED_PROCESSES,
};

use crate::server::Envd;
use crate::sys;

/// Largest `/proc` file (cmdline, stat, status) or `/etc/passwd` read.
const MAX_PROC_FILE: u64 = 64 * 1024;
/// After the exit, output is still collected this long while a process the
/// command left behind holds its pipes open.
const EXIT_GRACE: Duration = Duration::from_millis(100);
/// How often a follower checks that its client is still there.
const FOLLOW_TICK: Duration = Duration::from_millis(500);

fn fail(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code,
        message: message.into(),
    }
}

// ---- listing ------------------------------------------------------------

fn read_bounded(path: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    File::open(path)
        .ok()?
        .take(MAX_PROC_FILE)
        .read_to_end(&mut out)
        .ok()?;
    Some(out)
}

/// uid → name from the sandbox's `/etc/passwd` (bounded).
fn user_names() -> BTreeMap<u32, String> {
    let db = read_bounded("/etc/passwd").unwrap_or_default();
    String::from_utf8_lossy(&db)
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let uid = f.nth(1)?.parse().ok()?;
            (!name.is_empty() && name.len() <= 64).then(|| (uid, name.to_owned()))
        })
        .collect()
}

fn process(pid: i32, names: &BTreeMap<u32, String>) -> Option<ProcessInfo> {
    let stat = read_bounded(&format!("/proc/{pid}/stat"))?;
    let stat = String::from_utf8_lossy(&stat);
    // "pid (comm) state ppid ...": comm may hold anything, so parse after its last ')'
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state: String = fields.next()?.chars().take(1).collect();
    let ppid = fields.next()?.parse().ok()?;
    let status = read_bounded(&format!("/proc/{pid}/status")).unwrap_or_default();
    let uid = String::from_utf8_lossy(&status)
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(u32::MAX);
    let cmdline = read_bounded(&format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let mut truncated = cmdline.len() as u64 >= MAX_PROC_FILE;
    let mut argv = Vec::new();
    for arg in cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()) {
        if argv.len() == MAX_LISTED_ARGS {
            truncated = true;
            break;
        }
        let cut = &arg[..arg.len().min(MAX_LISTED_ARG)];
        truncated |= cut.len() < arg.len();
        argv.push(String::from_utf8_lossy(cut).into_owned());
    }
    Some(ProcessInfo {
        pid,
        ppid,
        uid,
        user: names.get(&uid).cloned(),
        state,
        argv,
        truncated,
    })
}

/// Every process envd can see, by pid.
pub fn list() -> Result<Vec<ProcessInfo>, ErrorBody> {
    let names = user_names();
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .map_err(|e| fail(ErrorCode::Internal, format!("read /proc: {e}")))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.truncate(MAX_LISTED_PROCESSES);
    // a process may exit between the directory read and its files
    Ok(pids
        .into_iter()
        .filter_map(|p| process(p, &names))
        .collect())
}

/// Sends the listing as `Data` frames of JSON arrays, then `Listed`.
pub fn send_list(conn: &mut UnixStream, procs: &[ProcessInfo]) {
    let budget = (MAX_JSON_FRAME as usize) / 2;
    let mut chunk: Vec<&ProcessInfo> = Vec::new();
    let mut size = 0;
    for p in procs {
        // arguments dominate; JSON escaping at most sextuples a byte
        let est = p.argv.iter().map(|a| a.len() * 6 + 4).sum::<usize>() + 256;
        if size + est > budget && !chunk.is_empty() {
            if send_chunk(conn, &chunk).is_err() {
                return;
            }
            chunk.clear();
            size = 0;
        }
        chunk.push(p);
        size += est;
    }
    if !chunk.is_empty() && send_chunk(conn, &chunk).is_err() {
        return;
    }
    let listed = Response::Listed {
        count: procs.len() as u64,
    };
    if let Ok(payload) = encode_json(&listed) {
        let _ = write_frame(conn, FrameKind::Response, &payload);
    }
}

fn send_chunk(conn: &mut UnixStream, chunk: &[&ProcessInfo]) -> Result<(), ()> {
    let payload = serde_json::to_vec(chunk).map_err(|_| ())?;
    write_frame(conn, FrameKind::Data, &payload).map_err(|_| ())
}

// ---- signals ------------------------------------------------------------

/// The signals envd sends on request.
const ALLOWED_SIGNALS: [i32; 9] = [
    libc::SIGTERM,
    libc::SIGKILL,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGSTOP,
    libc::SIGCONT,
];

/// Sends `signal` to `pid` (fenced).
pub fn signal(envd: &Envd, pid: i32, signal: i32, token: Option<u64>) -> Result<(), ErrorBody> {
    if pid <= 1 || pid == sys::getpid() {
        return Err(fail(
            ErrorCode::PermissionDenied,
            "envd (pid 1) is never signalled",
        ));
    }
    if !ALLOWED_SIGNALS.contains(&signal) {
        return Err(fail(
            ErrorCode::BadRequest,
            format!("signal {signal} is not one envd sends"),
        ));
    }
    envd.fenced(token, || {
        if std::fs::metadata(format!("/proc/{pid}")).is_err() {
            return Err(fail(ErrorCode::NotFound, format!("process {pid}")));
        }
        sys::kill_pid(pid, signal);
        Ok(())
    })
}

// ---- background commands --------------------------------------------------

/// What envd keeps of one output stream: its newest bytes.
#[derive(Default)]
struct Ring {
    data: VecDeque<u8>,
    /// Bytes that fell out before `data`.
    dropped: u64,
}

impl Ring {
    fn push(&mut self, bytes: &[u8]) {
        self.data.extend(bytes);
        let over = self.data.len().saturating_sub(BACKGROUND_RING_BYTES);
        if over > 0 {
            self.data.drain(..over);
            self.dropped += over as u64;
        }
    }

    fn end(&self) -> u64 {
        self.dropped + self.data.len() as u64
    }

    /// Up to `max` bytes from absolute offset `*pos` (moved past a gap).
    fn take_from(&self, pos: &mut u64, max: usize) -> Vec<u8> {
        *pos = (*pos).max(self.dropped);
        let start = usize::try_from(*pos - self.dropped).unwrap_or(usize::MAX);
        let out: Vec<u8> = self.data.iter().skip(start).take(max).copied().collect();
        *pos += out.len() as u64;
        out
    }
}

#[derive(Default)]
struct JobState {
    stdout: Ring,
    stderr: Ring,
    open_pipes: u8,
    exit: Option<(ExitWire, Instant)>,
}

impl JobState {
    /// Exited, and its output is complete (pipes closed, or the grace passed).
    fn finished(&self) -> bool {
        self.exit
            .is_some_and(|(_, at)| self.open_pipes == 0 || at.elapsed() >= EXIT_GRACE)
    }
}

struct Job {
    pid: i32,
    state: Mutex<JobState>,
    changed: Condvar,
}

impl Job {
    fn state(&self) -> MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// envd's background commands, by handle.
#[derive(Default)]
pub struct Background {
    next: AtomicU64,
    jobs: Mutex<BTreeMap<u64, Arc<Job>>>,
}

impl Background {
    fn jobs(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets every handle (on a fence move).
    pub fn clear(&self) {
        self.jobs().clear();
    }
}

/// A validated `spawn`.
pub struct SpawnRequest {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    pub token: Option<u64>,
    pub user: Option<String>,
}

/// Starts a background command; answers its handle and pid.
pub fn spawn(envd: &Envd, req: SpawnRequest) -> Result<(u64, i32), ErrorBody> {
    let (mut cmd, _) = crate::exec::command(
        envd,
        &req.argv,
        &req.env,
        req.cwd.as_deref(),
        req.user.as_deref(),
        &[],
    )?;
    let argv0 = &req.argv[0];
    cmd
        // a pipe whose write end is closed at once: EOF, without /dev/null
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    sys::spawn_in_new_session(&mut cmd);

    let job_id;
    let (mut child, exit_rx) = {
        let mut jobs = envd.background.jobs();
        if jobs.len() >= MAX_BACKGROUND {
            let oldest_finished = jobs
                .iter()
                .find(|(_, j)| j.state().finished())
                .map(|(h, _)| *h);
            match oldest_finished {
                Some(h) => {
                    jobs.remove(&h);
                }
                None => {
                    return Err(fail(
                        ErrorCode::Busy,
                        format!("envd keeps at most {MAX_BACKGROUND} running background commands"),
                    ))
                }
            }
        }
        let _gate = envd.enter_fence(req.token)?;
        let spawned = envd.reaper.spawn(&mut cmd).map_err(|e| {
            let code = match e.kind() {
                ErrorKind::NotFound => ErrorCode::NotFound,
                ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
                _ => ErrorCode::Internal,
            };
            fail(code, format!("start {argv0}: {e}"))
        })?;
        job_id = envd.background.next.fetch_add(1, Ordering::Relaxed) + 1;
        let pid = spawned.0.id() as i32;
        jobs.insert(
            job_id,
            Arc::new(Job {
                pid,
                state: Mutex::new(JobState {
                    open_pipes: 2,
                    ..Default::default()
                }),
                changed: Condvar::new(),
            }),
        );
        spawned
    };
    let job = envd
        .background
        .jobs()
        .get(&job_id)
        .cloned()
        .ok_or_else(|| fail(ErrorCode::Internal, "background job vanished"))?;
    drop(child.stdin.take());
    let started = Instant::now();
    let pid = job.pid;
    let readers = [
        child
            .stdout
            .take()
            .map(|p| (File::from(std::os::fd::OwnedFd::from(p)), true)),
        child
            .stderr
            .take()
            .map(|p| (File::from(std::os::fd::OwnedFd::from(p)), false)),
    ];
    for (file, is_stdout) in readers.into_iter().flatten() {
        let job = Arc::clone(&job);
        let started = std::thread::Builder::new()
            .name("envd-bg-out".into())
            .stack_size(64 * 1024)
            .spawn(move || read_pipe(file, is_stdout, &job));
        if started.is_err() {
            sys::kill_group(pid, libc::SIGKILL);
        }
    }
    let waiter_job = Arc::clone(&job);
    let waiter = std::thread::Builder::new()
        .name("envd-bg-wait".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            let status = exit_rx.recv().unwrap_or(libc::SIGKILL);
            let (exit_code, signal) = sys::decode_wait_status(status);
            let exit = ExitWire {
                exit_code,
                signal,
                timed_out: false,
                duration_us: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            };
            waiter_job.state().exit = Some((exit, Instant::now()));
            waiter_job.changed.notify_all();
        });
    if let Err(e) = waiter {
        sys::kill_group(pid, libc::SIGKILL);
        return Err(fail(ErrorCode::Busy, format!("start waiter thread: {e}")));
    }
    Ok((job_id, pid))
}

fn read_pipe(mut file: File, is_stdout: bool, job: &Job) {
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let mut s = job.state();
                if is_stdout {
                    s.stdout.push(&buf[..n]);
                } else {
                    s.stderr.push(&buf[..n]);
                }
                drop(s);
                job.changed.notify_all();
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    job.state().open_pipes -= 1;
    job.changed.notify_all();
}

/// Whether the client of `conn` hung up.
fn client_gone(conn: &UnixStream) -> bool {
    let mut fds = [libc::pollfd {
        fd: conn.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    matches!(sys::poll(&mut fds, 0), Ok(n) if n > 0)
        && fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Serves `output`: the kept output, then (with `follow`) new output until
/// the exit.
pub fn output(
    envd: &Envd,
    conn: &mut UnixStream,
    handle: u64,
    follow: bool,
) -> Result<(), ErrorBody> {
    let job = envd
        .background
        .jobs()
        .get(&handle)
        .cloned()
        .ok_or_else(|| fail(ErrorCode::NotFound, format!("background command {handle}")))?;
    let (mut out_pos, mut err_pos, out_dropped, err_dropped) = {
        let s = job.state();
        (
            s.stdout.dropped,
            s.stderr.dropped,
            s.stdout.dropped,
            s.stderr.dropped,
        )
    };
    loop {
        let (out, err, finished, exit) = {
            let mut s = job.state();
            loop {
                let pending = s.stdout.end() > out_pos || s.stderr.end() > err_pos;
                if pending || !follow || s.finished() {
                    break;
                }
                let wait = match s.exit {
                    // output after the exit: only until the grace ends
                    Some((_, at)) => EXIT_GRACE
                        .saturating_sub(at.elapsed())
                        .max(Duration::from_millis(1)),
                    None => FOLLOW_TICK,
                };
                s = job
                    .changed
                    .wait_timeout(s, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if client_gone(conn) {
                    return Ok(());
                }
            }
            (
                s.stdout.take_from(&mut out_pos, CHUNK_SIZE),
                s.stderr.take_from(&mut err_pos, CHUNK_SIZE),
                s.finished(),
                s.exit.map(|(e, _)| e),
            )
        };
        for (kind, bytes) in [(FrameKind::Stdout, &out), (FrameKind::Stderr, &err)] {
            if !bytes.is_empty() && write_frame(conn, kind, bytes).is_err() {
                return Ok(()); // client gone
            }
        }
        if !out.is_empty() || !err.is_empty() {
            continue;
        }
        let last = if follow {
            match (finished, exit) {
                (true, Some(exit)) => Response::Exit(exit),
                _ => continue,
            }
        } else {
            Response::Background(BackgroundInfo {
                handle,
                pid: job.pid,
                exit,
                stdout_dropped: out_dropped,
                stderr_dropped: err_dropped,
            })
        };
        if let Ok(payload) = encode_json(&last) {
            let _ = write_frame(conn, FrameKind::Response, &payload);
        }
        return Ok(());
    }
}
