//! Command-line definitions and their implementations.

mod tty;

use crate::output;
use crate::progress::Progress;
use aviary_client::{Client, ClientError, StreamItem};
use aviary_core::api::*;
use aviary_core::{ErrorCode, LeaseToken, Scope};
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

const AFTER_HELP: &str = "\
Environment:
  AVIARY_URL        server address for client commands (default http://127.0.0.1:7400)
  AVIARY_API_KEY    API key (default: the admin key in <data dir>/admin.key)
  AVIARY_DATA_DIR   data directory (default /var/lib/aviary)

Exit codes: `run` and `sandbox exec` exit with the command's exit code (124 when it
timed out). Otherwise: 0 ok, 2 usage, 64 invalid request, 66 not found, 69 server
unavailable, 70 internal error, 74 local file i/o error, 75 lease/state conflict or
retry later, 77 unauthorized/forbidden, 78 invalid configuration file.";

#[derive(Parser, Debug)]
#[command(name = "aviary", version, about = "Aviary: a sandbox control plane for AI agents", after_help = AFTER_HELP)]
pub struct Cli {
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the control plane (embedded default: SQLite registry, local crun runtime).
    Serve(ServeArgs),
    /// Create a sandbox, run one command in it, destroy it; exits with the command's code.
    Run(RunArgs),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Acquire, renew and release leases (fencing tokens).
    #[command(subcommand)]
    Lease(LeaseCmd),
    /// Show the event log (state changes, decisions, lease grants).
    Events(EventsArgs),
    /// Ask the resource planner what a task needs (and what policy would approve).
    Plan {
        /// Task context JSON (DESIGN §7): {"task": "...", "dependencies": [...], ...}; `-` reads stdin.
        #[arg(long)]
        intent: PathBuf,
    },
    /// List and import templates.
    #[command(subcommand)]
    Template(TemplateCmd),
    /// Run a node agent: this host's runtime, offered to a control plane over the network.
    Node(NodeArgs),
    /// Nodes known to the control plane; register agents (admin).
    #[command(subcommand)]
    Nodes(NodesCmd),
    /// Warm pools: sizes, hits and misses; change their bounds (admin).
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Manage API keys (admin).
    #[command(subcommand)]
    Key(KeyCmd),
    /// List and delete snapshots (checkpoints).
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Print a shell completion script: `aviary completions bash > /etc/bash_completion.d/aviary`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), or write one page per command into --dir.
    Man {
        /// Write aviary.1 and aviary-<command>.1 pages here instead of printing aviary.1.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// What the E2B (and OpenSandbox) SDKs need to use this server.
    #[command(subcommand)]
    Compat(CompatCmd),
    /// Serve the Model Context Protocol (tools to plan, create, run, read and
    /// write files, snapshot, fork, release and destroy sandboxes) on stdio,
    /// or on streamable HTTP at http://ADDR/mcp with --http.
    Mcp(McpArgs),
}

#[derive(Subcommand, Debug)]
enum CompatCmd {
    /// Print the shell exports that point the SDKs at the running server
    /// (`eval "$(aviary compat env)"`); the key stays your Aviary key.
    Env,
}

#[derive(Args, Debug)]
struct McpArgs {
    /// Serve streamable HTTP on this address (e.g. 127.0.0.1:7401) instead of stdio.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Lifetime of the leases the session holds on its sandboxes, seconds
    /// (renewed every third of it while the session lasts).
    #[arg(long, value_name = "SECS", default_value_t = aviary_mcp::DEFAULT_LEASE_TTL_S,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    lease_ttl: u64,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Configuration file (classes, network profiles, tenants, pools, planner);
    /// see aviary.example.toml. Flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data directory (registry, templates, sandboxes, admin.key) [default: /var/lib/aviary].
    #[arg(long, env = "AVIARY_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7400].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Default OCI runtime: crun (default) or runc. Serve both side by side
    /// with `runtimes = ["crun", "runc"]` in [server].
    #[arg(long)]
    runtime: Option<String>,
    /// Static envd binary (default: aviary-envd next to this binary).
    #[arg(long, env = "AVIARY_ENVD")]
    envd: Option<PathBuf>,
    /// Template store directory (default <data dir>/templates).
    #[arg(long, env = "AVIARY_TEMPLATES_DIR")]
    templates_dir: Option<PathBuf>,
    /// How to build the default template when missing: debootstrap (Debian + python3) or busybox.
    #[arg(long, default_value = "debootstrap")]
    default_template_source: String,
    /// Distributed mode: the PostgreSQL registry every replica shares
    /// (postgres://USER:${PASSWORD_VAR}@HOST:PORT/DB; `${NAME}` is read from the
    /// environment). Needs --coordination. Overrides [distributed] registry.
    #[arg(long, env = "AVIARY_REGISTRY", value_name = "URL")]
    registry: Option<String>,
    /// Distributed mode: the Redis coordination store (leases, locks,
    /// heartbeats, routes): redis://HOST:PORT/DB. Needs --registry.
    #[arg(long, env = "AVIARY_COORDINATION", value_name = "URL")]
    coordination: Option<String>,
    /// Snapshot store: `local` or s3://BUCKET/PREFIX?endpoint=URL (keys in
    /// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). Overrides [snapshots].
    #[arg(long, env = "AVIARY_SNAPSHOTS", value_name = "URL")]
    snapshots: Option<String>,
    /// Distributed mode: run sandboxes on this replica too, as node NAME
    /// (unique per replica, stable across restarts). Without it the replica
    /// is stateless and places sandboxes only on `aviary node` agents.
    #[arg(long, env = "AVIARY_NODE_NAME")]
    node_name: Option<String>,
}

#[derive(Args, Debug, Clone, Default)]
struct CreateArgs {
    /// Template name (default: "default").
    #[arg(long)]
    template: Option<String>,
    /// Resource class (python-small, python-ds, build-medium, browser-medium, compute-large).
    #[arg(long)]
    class: Option<String>,
    /// The end user the sandbox works for (scope `user` reuses it across sessions).
    #[arg(long)]
    user: Option<String>,
    /// The session it belongs to (scope `session`, the default, reuses it within one).
    #[arg(long)]
    session: Option<String>,
    /// The agent that asks (scope `agent` reuses it across that agent's calls).
    #[arg(long)]
    agent: Option<String>,
    /// Isolation scope: session, user, agent or global.
    #[arg(long)]
    scope: Option<Scope>,
    /// Network profile by name (the local node grants "none": loopback only).
    #[arg(long)]
    network: Option<String>,
    /// Lifetime in seconds.
    #[arg(long)]
    ttl: Option<u64>,
    /// Task context JSON file for the resource planner (`-` reads stdin); ignored with --class.
    #[arg(long)]
    intent: Option<PathBuf>,
    /// Start from a saved sandbox state (a snapshot id of yours).
    #[arg(long)]
    from_snapshot: Option<String>,
    /// You manage this sandbox's life: the platform only stops (hibernates) it, never destroys it.
    #[arg(long)]
    user_managed: bool,
    /// Runtime to run on (crun, runc, runsc): one the class offers and the server serves
    /// (`aviary nodes ls` lists them); default: the server's default runtime.
    #[arg(long)]
    runtime: Option<String>,
    /// Label KEY=VALUE kept with the sandbox (repeatable; `sandbox ls --metadata` filters on it).
    #[arg(long = "metadata", value_name = "KEY=VALUE", value_parser = parse_kv)]
    metadata: Vec<(String, String)>,
    /// Default working directory of every exec in the sandbox (absolute; an
    /// exec's --cwd wins; default: the template image's WorkingDir).
    #[arg(long, value_name = "DIR")]
    workdir: Option<String>,
}

impl CreateArgs {
    fn request(&self) -> Result<CreateSandboxRequest, Failure> {
        let intent = match &self.intent {
            Some(p) => Some(read_json(p)?),
            None => None,
        };
        Ok(CreateSandboxRequest {
            intent,
            template: self.template.clone(),
            class: self.class.clone(),
            user_id: self.user.clone(),
            session_id: self.session.clone(),
            agent: self.agent.clone(),
            scope: self.scope,
            network: self.network.clone(),
            ttl_s: self.ttl,
            lease: None,
            from_snapshot: self.from_snapshot.clone(),
            user_managed: self.user_managed,
            runtime: self.runtime.clone(),
            metadata: self.metadata.iter().cloned().collect(),
            env: Default::default(),
            workdir: self.workdir.clone(),
        })
    }
}

#[derive(Args, Debug)]
struct ExecOpts {
    /// Stream this process's stdin to the command, bytes as they come, until
    /// EOF (`cat data.bin | aviary sandbox exec -i ID -- sha256sum`). Without
    /// it the command's stdin is empty. With -t: type into the command's
    /// terminal (`-it ID -- bash`: an interactive shell; Ctrl-C and every
    /// other key go to the sandbox).
    #[arg(short = 'i', long)]
    interactive: bool,
    /// Run the command on a terminal (a pseudo-terminal in the sandbox, sized
    /// like this one and resized with it); needs a terminal on stdin. Alone,
    /// the keyboard is not read and Ctrl-C is sent on as SIGINT; with -i it
    /// is interactive. Stdout and stderr arrive merged, as on any terminal.
    #[arg(short = 't', long)]
    tty: bool,
    /// Kill the command's whole process group after this many seconds
    /// (not with -t).
    #[arg(long, conflicts_with = "tty")]
    timeout: Option<f64>,
    /// Working directory inside the sandbox (absolute), like docker's -w.
    #[arg(short = 'w', long, value_name = "DIR")]
    cwd: Option<String>,
    /// Environment variable KEY=VALUE (repeatable), like docker's -e.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_kv)]
    env: Vec<(String, String)>,
}

impl ExecOpts {
    /// The command for `-t`: argv as `exec` would run it.
    fn tty_command(&self, cmd: Vec<String>, token: Option<LeaseToken>) -> tty::TtyCommand {
        let argv = if cmd.len() == 1 && cmd[0].contains(' ') {
            vec!["/bin/sh".into(), "-c".into(), cmd[0].clone()]
        } else {
            cmd
        };
        tty::TtyCommand {
            argv,
            env: self.env.clone(),
            cwd: self.cwd.clone(),
            stdin: self.interactive,
            token,
        }
    }

    /// Refuses `-t` where it cannot work (no terminal, --json), before
    /// anything is created.
    fn check_tty(&self, json: bool) -> Result<(), Failure> {
        if !self.tty {
            return Ok(());
        }
        if json {
            return Err(Failure::new(
                ErrorCode::InvalidRequest,
                "-t shows a terminal; it cannot be combined with --json".into(),
            ));
        }
        tty::check_terminal()
    }
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    create: CreateArgs,
    #[command(flatten)]
    exec: ExecOpts,
    /// Command and arguments (after `--`). A single argument containing spaces is run with /bin/sh -c.
    #[arg(required = true, last = true)]
    cmd: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum SandboxCmd {
    /// Create a sandbox (prints its id; --json for the whole answer).
    Create {
        #[command(flatten)]
        create: CreateArgs,
        /// Take a lease at create for this owner: the id, then the token, each on its own line.
        #[arg(long)]
        lease_owner: Option<String>,
        /// Lease ttl in seconds (with --lease-owner).
        #[arg(long)]
        lease_ttl: Option<u64>,
        /// Default environment KEY=VALUE of every exec in the sandbox (repeatable; an exec's --env wins).
        #[arg(long = "env", value_name = "KEY=VALUE", value_parser = parse_kv)]
        env: Vec<(String, String)>,
    },
    /// List your sandboxes.
    Ls {
        /// Include terminated sandboxes.
        #[arg(long, short)]
        all: bool,
        /// Only sandboxes labelled KEY=VALUE (repeatable: all must match).
        #[arg(long = "metadata", value_name = "KEY=VALUE", value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Only sandboxes in this state (Idle, Leased, Running, Hibernating, Terminated, ...).
        #[arg(long)]
        state: Option<String>,
        /// Only sandboxes working for this end user.
        #[arg(long)]
        user: Option<String>,
        /// Only sandboxes of this session.
        #[arg(long)]
        session: Option<String>,
    },
    /// Set when a sandbox expires: SECS seconds from now (may shorten its life).
    Ttl {
        /// The sandbox id (sbx-…).
        id: String,
        /// Seconds from now.
        secs: u64,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Show one sandbox.
    Get { id: String },
    /// Destroy a sandbox (needs --token while it is leased).
    Rm {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Run a command in a sandbox; output streams live; exits with its code.
    Exec {
        /// The sandbox id (sbx-…).
        id: String,
        /// Lease token (required while the sandbox is leased).
        #[arg(long)]
        token: Option<LeaseToken>,
        /// Run in the background: print its handle at once (read it with `sandbox logs`).
        #[arg(short = 'd', long, conflicts_with_all = ["interactive", "timeout"])]
        detach: bool,
        #[command(flatten)]
        exec: ExecOpts,
        /// The command and its arguments, after `--`.
        #[arg(required = true, last = true)]
        cmd: Vec<String>,
    },
    /// List the processes of a sandbox (pid 1 is its envd).
    Ps {
        /// The sandbox id (sbx-…).
        id: String,
    },
    /// Show a sandbox's live resource usage (memory, CPU time, processes,
    /// disk) beside its class's limits, read from its runtime now.
    ///
    /// CPU is the time used since the sandbox started (its percentage is
    /// the change between two samples over the time between them). A
    /// sandbox that holds no compute (hibernated, ended) is refused.
    Usage {
        /// The sandbox id (sbx-…).
        id: String,
        /// Find the sandbox in any tenant (admin keys only).
        #[arg(long)]
        all_tenants: bool,
    },
    /// Send a signal to one process of a sandbox.
    Kill {
        /// The sandbox id (sbx-…).
        id: String,
        /// The process id inside the sandbox (as `sandbox ps` shows it).
        pid: i32,
        /// TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP or CONT.
        #[arg(long, short, default_value = "TERM")]
        signal: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// The output of a background command (`sandbox exec -d`); exits with its
    /// exit code once it ended.
    Logs {
        /// The sandbox id (sbx-…).
        id: String,
        /// The handle `sandbox exec -d` printed.
        handle: u64,
        /// Follow new output until the command exits.
        #[arg(long, short)]
        follow: bool,
    },
    /// The URL of a port inside a sandbox, proxied by the server (no network needed).
    Port {
        /// The sandbox id (sbx-…).
        id: String,
        /// The port a server listens on inside the sandbox (127.0.0.1 there).
        port: u16,
    },
    /// Freeze every process of a sandbox (cgroup freezer).
    Pause {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Thaw a paused sandbox.
    Resume {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Recycle: level 1 (default) kills leftover processes, clears /tmp, revokes the lease, keeps
    /// /workspace; level 2 restores the clean checkpoint; level 3 destroys.
    Reset {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
        /// 1 soft reset (default), 2 back to the clean checkpoint, 3 destroy.
        #[arg(long, default_value_t = 1)]
        level: u8,
    },
    /// Mark the sandbox tainted: never reused nor returned to a pool (a level-2 reset clears it).
    Taint {
        /// The sandbox id (sbx-…).
        id: String,
        /// Why; recorded in the sandbox's `tainted` event.
        #[arg(long)]
        reason: String,
    },
    /// End a call: release the lease, refresh the manifest, back to Idle for its scope.
    Release {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Checkpoint the workspace and writable layer (content-defined chunks).
    Snapshot {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
        /// `clean` marks the checkpoint `reset --level 2` returns to.
        #[arg(long, default_value = "checkpoint")]
        label: String,
    },
    /// A new sandbox from a checkpoint of this one (a fresh checkpoint when none is named).
    Fork {
        /// The sandbox id (sbx-…).
        id: String,
        /// The checkpoint to fork from (default: a fresh one).
        #[arg(long)]
        snapshot: Option<String>,
        /// Fork the running sandbox with its processes (runsc only).
        #[arg(long, conflicts_with = "snapshot")]
        live: bool,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// Snapshot and stop compute; `wake` restores it.
    Hibernate {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
    /// New compute for a hibernating sandbox, restored from its snapshot.
    Wake { id: String },
    /// List checkpoints (of one sandbox, or all of yours).
    Snapshots {
        /// Only this sandbox's.
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Show the environment manifest (runtimes, packages, dirty paths).
    Manifest {
        /// The sandbox id (sbx-…).
        id: String,
        /// Probe the sandbox now.
        #[arg(long)]
        refresh: bool,
    },
    /// Copy a file or a directory tree in or out: one side is ID:/path; `-` is stdin (in) or stdout (out).
    Cp {
        src: String,
        dst: String,
        /// The lease token FENCE.SECRET, needed while the sandbox is leased.
        #[arg(long)]
        token: Option<LeaseToken>,
    },
}

#[derive(Subcommand, Debug)]
enum LeaseCmd {
    /// Acquire the sandbox's lease; prints the fencing token.
    Acquire {
        /// The sandbox id (sbx-…).
        id: String,
        /// Who holds the lease (shown in `sandbox get` and the events).
        #[arg(long)]
        owner: String,
        /// Seconds until the lease expires unless renewed (default 60).
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Renew (heartbeat) a lease.
    Renew {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET from `lease acquire`.
        #[arg(long)]
        token: LeaseToken,
        /// Seconds the lease lives without a renewal (default 60).
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Release a lease.
    Release {
        /// The sandbox id (sbx-…).
        id: String,
        /// The lease token FENCE.SECRET from `lease acquire`.
        #[arg(long)]
        token: LeaseToken,
    },
}

#[derive(Args, Debug)]
struct EventsArgs {
    /// Only this sandbox's events.
    #[arg(long)]
    sandbox: Option<String>,
    /// Then keep printing new events as the server pushes them (Ctrl-C ends).
    #[arg(long, short)]
    follow: bool,
    /// How many events: the newest ones, printed oldest first (default 100, at most 1000).
    #[arg(long)]
    limit: Option<u32>,
    /// Instead of the newest: the first events with an id above this one.
    #[arg(long)]
    after: Option<i64>,
}

#[derive(Subcommand, Debug)]
enum TemplateCmd {
    /// List templates.
    Ls,
    /// Import a `docker save` or OCI image-layout tarball as template NAME (admin).
    Import {
        /// The template's name (1-64 of A-Z a-z 0-9 . _ -).
        name: String,
        /// The tarball (`docker save`, or an OCI image layout).
        archive: PathBuf,
        /// Replace a template of that name (without it, an existing name is refused).
        #[arg(long)]
        force: bool,
    },
    /// Remove template NAME (admin); refused while a sandbox, snapshot, pool or the default needs it.
    Rm {
        /// The template's name.
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum SnapshotCmd {
    /// List your checkpoints (of one sandbox, or all of yours), oldest first.
    Ls {
        /// Only this sandbox's.
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Delete a checkpoint (its chunks go with the next GC); refused for the one a hibernated sandbox wakes from.
    Rm {
        /// The snapshot id (snap-…).
        id: String,
    },
}

#[derive(Args, Debug)]
struct NodeArgs {
    /// Node id (recorded as each sandbox's `node`).
    #[arg(long, default_value = "node-1")]
    id: String,
    /// Address the agent listens on.
    #[arg(long, default_value = "127.0.0.1:7401")]
    listen: SocketAddr,
    /// Data directory of the agent (sandboxes, templates, node.token).
    #[arg(long, default_value = "/var/lib/aviary-node")]
    data_dir: PathBuf,
    /// Bearer token the control plane must present (default: <data dir>/node.token, created if missing).
    #[arg(long, env = "AVIARY_NODE_TOKEN")]
    token: Option<String>,
    /// Template store directory (default <data dir>/templates).
    #[arg(long)]
    templates_dir: Option<PathBuf>,
    /// Static envd binary (default: aviary-envd next to this binary).
    #[arg(long, env = "AVIARY_ENVD")]
    envd: Option<PathBuf>,
    /// OCI runtime: crun (default) or runc.
    #[arg(long, default_value = "crun")]
    runtime: String,
    /// File system of each sandbox's disk: ext4 (default) or xfs (reflinks:
    /// snapshots re-read only changed extents; disks of at least 300 MiB).
    #[arg(long, default_value = "ext4")]
    disk_fs: String,
}

#[derive(Subcommand, Debug)]
enum NodesCmd {
    /// List nodes with capacity, committed limits and health.
    Ls,
    /// Register a node agent.
    Add {
        /// The sandbox id (sbx-…).
        id: String,
        /// host:port of the agent
        address: String,
        /// The bearer token the agent was started with.
        #[arg(long)]
        token: String,
    },
}

#[derive(Subcommand, Debug)]
enum PoolCmd {
    /// List warm pools.
    Ls,
    /// Set pool_min/pool_max for the pools of a class (kept across restarts).
    Set {
        class: String,
        /// The floor: warm plus handed-out sandboxes.
        #[arg(long)]
        min: u32,
        /// The cap: warm plus handed-out sandboxes.
        #[arg(long)]
        max: u32,
    },
}

#[derive(Subcommand, Debug)]
enum KeyCmd {
    /// Create an API key for a tenant (admin); the key is printed once (its id on stderr).
    Create {
        /// The tenant the key acts for.
        #[arg(long)]
        tenant: String,
        /// An admin key (may manage keys, pools and nodes, and see every tenant).
        #[arg(long)]
        admin: bool,
    },
    /// List every key: id, tenant, admin flag, created, revoked (never a secret).
    Ls,
    /// Revoke a key by id (from `aviary key ls`); it fails from the next request on.
    Revoke {
        /// Key id, e.g. key-abcd...
        id: String,
    },
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

fn data_dir() -> PathBuf {
    std::env::var_os("AVIARY_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/aviary"))
}

/// `AVIARY_URL` as a base URL: `host:port` alone means `http://host:port`;
/// any scheme but http and https is refused with a clear message.
fn server_url(raw: &str) -> Result<String, Failure> {
    let raw = raw.trim();
    let url = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("http://{raw}")
    };
    let bad = |why: &str| {
        Failure::new(
            ErrorCode::InvalidRequest,
            format!("AVIARY_URL {raw:?} {why} (e.g. http://127.0.0.1:7400)"),
        )
    };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(bad("must be an http:// or https:// address"));
    }
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or_default();
    if rest.is_empty() || rest.starts_with('/') || rest.starts_with(':') {
        return Err(bad("names no host"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

fn client() -> Result<Client, Failure> {
    let (url, key) = client_settings()?;
    Ok(Client::new(&url, &key))
}

/// The server address and API key of the client commands (`AVIARY_URL`,
/// `AVIARY_API_KEY`, else the admin key file).
fn client_settings() -> Result<(String, String), Failure> {
    let url = server_url(
        &std::env::var("AVIARY_URL").unwrap_or_else(|_| "http://127.0.0.1:7400".into()),
    )?;
    let key = match std::env::var("AVIARY_API_KEY") {
        Ok(k) if !k.is_empty() => k,
        _ => {
            let p = data_dir().join("admin.key");
            std::fs::read_to_string(&p)
                .map(|s| s.trim().to_owned())
                .map_err(|e| {
                    Failure::new(
                        ErrorCode::Unauthorized,
                        format!(
                            "no API key: set AVIARY_API_KEY or make {} readable ({e})",
                            p.display()
                        ),
                    )
                })?
        }
    };
    Ok((url, key))
}

/// A failed command: message for stderr and the exit code.
#[derive(Debug)]
struct Failure {
    code: i32,
    message: String,
    /// The stable error code (`--json` prints it); `None` for the exits
    /// outside the table (local I/O, configuration).
    stable: Option<&'static str>,
}

/// Exit codes the error table has no code for (sysexits.h): a local file
/// could not be read or written, and an invalid configuration file.
const EXIT_IO_ERROR: i32 = 74;
const EXIT_CONFIG: i32 = 78;

impl Failure {
    /// A failure with the exit code of `code` in the one error table
    /// (`ErrorCode::cli_exit_code`), the same as the server's answer would get.
    fn new(code: ErrorCode, message: String) -> Self {
        Failure {
            code: code.cli_exit_code(),
            message,
            stable: Some(code.as_str()),
        }
    }

    /// A failure outside the table ([`EXIT_IO_ERROR`], [`EXIT_CONFIG`]).
    fn exit(code: i32, message: String) -> Self {
        let stable = match code {
            EXIT_IO_ERROR => Some("local_io"),
            EXIT_CONFIG => Some("invalid_config"),
            _ => None,
        };
        Failure {
            code,
            message,
            stable,
        }
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        let (code, stable) = match &e {
            ClientError::Api { code, .. } => (code.cli_exit_code(), Some(code.as_str())),
            ClientError::Connect { .. } => (
                ErrorCode::Unavailable.cli_exit_code(),
                Some(ErrorCode::Unavailable.as_str()),
            ),
            ClientError::Io(_) => (EXIT_IO_ERROR, Some("local_io")),
            _ => (
                ErrorCode::Internal.cli_exit_code(),
                Some(ErrorCode::Internal.as_str()),
            ),
        };
        let message = match &e {
            ClientError::Connect { .. } => format!(
                "{} (is `aviary serve` running there? AVIARY_URL selects another)",
                error_chain(&e)
            ),
            ClientError::Api { code, message, .. } => format!("{message} [{}]", code.as_str()),
            other => error_chain(other),
        };
        Failure {
            code,
            message,
            stable,
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

pub async fn run(cli: Cli) -> i32 {
    let json = cli.json;
    let res = match cli.cmd {
        Command::Serve(a) => serve(a).await,
        Command::Run(a) => run_cmd(a, json).await,
        Command::Sandbox(c) => sandbox(c, json).await,
        Command::Lease(c) => lease(c, json).await,
        Command::Events(a) => events(a, json).await,
        Command::Plan { intent } => plan(intent, json).await,
        Command::Template(c) => template(c, json).await,
        Command::Key(c) => key(c, json).await,
        Command::Snapshot(c) => snapshot_cmd(c, json).await,
        Command::Pool(c) => pool(c, json).await,
        Command::Node(a) => node(a).await,
        Command::Nodes(c) => nodes(c, json).await,
        Command::Compat(CompatCmd::Env) => compat_env(json).await,
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "aviary", &mut script);
            print_bytes(&script)
        }
        Command::Man { dir } => man_pages(dir),
        Command::Mcp(a) => mcp(a).await,
    };
    match res {
        Ok(code) => code,
        Err(f) => {
            if json {
                // under --json, stdout is one JSON document, errors included
                output::json(&serde_json::json!({"error": {
                    "code": f.stable.unwrap_or("internal"),
                    "message": f.message,
                    "exit_code": f.code,
                }}));
            }
            eprintln!("aviary: {}", f.message);
            f.code
        }
    }
}

/// Writes generated text to stdout; a reader that went away (`| head`)
/// is not an error.
fn print_bytes(b: &[u8]) -> Result<i32, Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(b).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(Failure::exit(
            EXIT_IO_ERROR,
            format!("writing to stdout: {e}"),
        )),
    }
}

/// The man page of `aviary` on stdout, or every command's page in `dir`
/// (`aviary.1`, `aviary-sandbox.1`, `aviary-sandbox-create.1`, ...).
fn man_pages(dir: Option<PathBuf>) -> Result<i32, Failure> {
    let cmd = <Cli as clap::CommandFactory>::command();
    let io = |e: std::io::Error| Failure::exit(EXIT_IO_ERROR, format!("writing the man page: {e}"));
    match dir {
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut page).map_err(io)?;
            return print_bytes(&page);
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir).map_err(io)?;
            clap_mangen::generate_to(cmd, &dir).map_err(io)?;
            eprintln!("man pages written to {}", dir.display());
        }
    }
    Ok(0)
}

/// The lines `aviary compat env` prints for the server at `base`: one
/// `export NAME=value` (or `# comment`) a line. Each compatible surface adds
/// its lines here.
fn compat_env_lines(base: &str) -> Vec<String> {
    // OpenSandbox takes the address without its scheme, and the scheme apart
    let (scheme, host) = base.split_once("://").unwrap_or(("http", base));
    vec![
        "# E2B SDK (Python and JS): the API and envd of this server; E2B_API_KEY is your Aviary API key:".into(),
        "#   export E2B_API_KEY=\"$AVIARY_API_KEY\"".into(),
        format!("export E2B_API_URL={base}/e2b"),
        format!("export E2B_SANDBOX_URL={base}/e2b/envd"),
        "# OpenSandbox SDK (and AgentScope's OpenSandboxWorkspace): OPEN_SANDBOX_API_KEY is your Aviary API key:".into(),
        "#   export OPEN_SANDBOX_API_KEY=\"$AVIARY_API_KEY\"".into(),
        format!("export OPEN_SANDBOX_DOMAIN={host}/opensandbox"),
        format!("export OPEN_SANDBOX_PROTOCOL={scheme}"),
    ]
}

/// Prints the SDK exports for the running server (checked to answer first).
async fn compat_env(json: bool) -> Result<i32, Failure> {
    let c = client()?;
    c.healthz().await?;
    let lines = compat_env_lines(c.base_url());
    if json {
        let exports: serde_json::Map<String, serde_json::Value> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_owned(), serde_json::Value::String(v.to_owned())))
            .collect();
        output::json(&serde_json::json!({ "exports": exports }));
    } else {
        for l in lines {
            println!("{l}");
        }
    }
    Ok(0)
}

/// `aviary mcp`: stdout is the protocol's (on stdio), so logs go to stderr.
async fn mcp(a: McpArgs) -> Result<i32, Failure> {
    let (url, api_key) = client_settings()?;
    let cfg = aviary_mcp::McpConfig {
        url,
        api_key,
        lease_ttl_s: a.lease_ttl,
    };
    let res = match a.http {
        None => aviary_mcp::serve_stdio(cfg).await,
        Some(addr) => {
            aviary_mcp::serve_http(cfg, addr, |bound| {
                eprintln!("aviary mcp: streamable HTTP on http://{bound}/mcp");
            })
            .await
        }
    };
    res.map(|()| 0)
        .map_err(|e| Failure::new(ErrorCode::Unavailable, format!("mcp server: {e:#}")))
}

fn find_envd(explicit: Option<PathBuf>) -> PathBuf {
    if let Some(p) = explicit {
        return p;
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            for cand in [
                dir.join("aviary-envd"),
                dir.join("../libexec/aviary/aviary-envd"),
            ] {
                if cand.exists() {
                    return cand;
                }
            }
        }
    }
    PathBuf::from("/usr/local/bin/aviary-envd")
}

async fn serve(a: ServeArgs) -> Result<i32, Failure> {
    crate::telemetry::init();
    let mut settings = match &a.config {
        Some(p) => aviary_config::Config::load(p)
            .map_err(|e| Failure::exit(EXIT_CONFIG, format!("{e}")))?,
        None => aviary_config::Config::default(),
    };
    apply_backend_flags(&mut settings, &a)
        .map_err(|e| Failure::exit(EXIT_CONFIG, format!("aviary serve: {e}")))?;
    let mut cfg = aviary_server::config::ServerConfig::from_settings(settings, find_envd(a.envd));
    if let Some(d) = a.data_dir {
        cfg.data_dir = d;
    }
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    if let Some(r) = &a.runtime {
        cfg.runtime = r
            .parse()
            .map_err(|e| Failure::new(ErrorCode::InvalidRequest, e))?;
        // the default among the configured runtimes, or the only one
        let served = &mut cfg.control.settings.server.runtimes;
        if !served.contains(&cfg.runtime) {
            *served = vec![cfg.runtime];
        }
    }
    let data_dir = cfg.data_dir.clone();
    cfg.templates_dir = a.templates_dir;
    cfg.control.default_template_source = match a.default_template_source.as_str() {
        "debootstrap" => aviary_server::config::DefaultTemplateSource::Debootstrap,
        "busybox" => aviary_server::config::DefaultTemplateSource::Busybox,
        other => {
            return Err(Failure::new(
                ErrorCode::InvalidRequest,
                format!("unknown template source {other:?} (debootstrap|busybox)"),
            ))
        }
    };
    let server = aviary_server::start(cfg, |line| eprintln!("aviary: {line}"))
        .await
        .map_err(|e| Failure::new(ErrorCode::Internal, format!("{e:#}")))?;
    eprintln!(
        "aviary: listening on http://{} (data dir {}, admin key in {})",
        server.addr,
        data_dir.display(),
        data_dir.join("admin.key").display()
    );
    let cp = server.control_plane.clone();
    tokio::spawn(async move {
        match cp.wait_ready().await {
            aviary_server::ops::Readiness::Ready => eprintln!("aviary: ready"),
            aviary_server::ops::Readiness::Failed(w) => eprintln!("aviary: NOT ready: {w}"),
            aviary_server::ops::Readiness::Preparing(_) => {}
        }
    });
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!(
        "aviary: shutting down (sandboxes keep running and are re-attached on the next start)"
    );
    let stopped = server
        .stop()
        .await
        .map_err(|e| Failure::new(ErrorCode::Internal, format!("{e:#}")));
    // the exporter's flush blocks: off the async workers
    let _ = tokio::task::spawn_blocking(crate::telemetry::shutdown).await;
    stopped?;
    Ok(0)
}

/// `--registry`, `--coordination`, `--snapshots` over the file's sections.
fn apply_backend_flags(settings: &mut aviary_config::Config, a: &ServeArgs) -> Result<(), String> {
    use aviary_config::{ServiceKind, ServiceUrl};
    if let Some(u) = &a.registry {
        settings.distributed.registry = Some(ServiceUrl::parse(ServiceKind::Registry, u)?);
    }
    if let Some(u) = &a.coordination {
        settings.distributed.coordination = Some(ServiceUrl::parse(ServiceKind::Coordination, u)?);
    }
    settings.distributed.check_complete()?;
    if let Some(n) = &a.node_name {
        if !settings.distributed.is_distributed() {
            return Err(
                "--node-name is for distributed mode (with --registry and --coordination)".into(),
            );
        }
        settings.distributed.node_name = Some(n.clone());
    }
    if let Some(u) = &a.snapshots {
        settings.snapshots.store = aviary_config::distributed::snapshot_store_from_url(u)?;
    }
    Ok(())
}

fn exec_request(cmd: Vec<String>, opts: &ExecOpts, token: Option<LeaseToken>) -> ExecRequest {
    let (cmd, shell) = if cmd.len() == 1 && cmd[0].contains(' ') {
        (None, Some(cmd[0].clone()))
    } else {
        (Some(cmd), None)
    };
    ExecRequest {
        cmd,
        shell,
        cwd: opts.cwd.clone(),
        env: opts.env.iter().cloned().collect(),
        stdin: None,
        timeout_s: opts.timeout,
        token,
    }
}

/// Prints a background command's output (or follows it to its exit); the
/// exit code is the command's once it ended, 0 while it runs.
async fn background_logs(
    c: &Client,
    id: &str,
    handle: u64,
    follow: bool,
    json: bool,
) -> Result<i32, Failure> {
    if !follow {
        let o = c.background_output(id, handle).await?;
        if json {
            output::json(&o);
        } else {
            let _ = std::io::stdout().write_all(o.stdout.as_bytes());
            let _ = std::io::stderr().write_all(o.stderr.as_bytes());
            if o.stdout_dropped + o.stderr_dropped > 0 {
                eprintln!(
                    "aviary: {} earlier bytes of output were not kept",
                    o.stdout_dropped + o.stderr_dropped
                );
            }
        }
        return Ok(o.exit_code.unwrap_or(0));
    }
    let mut s = c.follow_background(id, handle).await?;
    let Some(r) = play_stream(&mut s, json).await? else {
        return Err(Failure::new(
            ErrorCode::Internal,
            "the output stream ended without an exit status".into(),
        ));
    };
    if json {
        output::json(&r);
    }
    Ok(r.exit_code)
}

/// Plays an exec stream: its output written live to stdout and stderr, or,
/// under `--json`, collected into the exit result's `stdout` and `stderr`.
/// `None` when the stream ended without an exit.
async fn play_stream(
    s: &mut aviary_client::ExecStream,
    json: bool,
) -> Result<Option<ExecResult>, Failure> {
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let (mut got_out, mut got_err) = (Vec::new(), Vec::new());
    while let Some(item) = s.next().await? {
        match item {
            StreamItem::Stdout(d) if json => got_out.extend_from_slice(&d),
            StreamItem::Stderr(d) if json => got_err.extend_from_slice(&d),
            StreamItem::Stdout(d) => {
                let _ = out.write_all(&d);
                let _ = out.flush();
            }
            StreamItem::Stderr(d) => {
                let _ = err.write_all(&d);
                let _ = err.flush();
            }
            StreamItem::Exit(mut r) => {
                if json {
                    r.stdout = String::from_utf8_lossy(&got_out).into_owned();
                    r.stderr = String::from_utf8_lossy(&got_err).into_owned();
                }
                return Ok(Some(r));
            }
        }
    }
    Ok(None)
}

/// Streams a command's output live; returns its exit status as an exit code.
/// Under `--json` the output is collected instead and printed once, in the
/// one JSON document (the exit result with `stdout`/`stderr`, and `sandbox`).
async fn stream_exec(
    c: &Client,
    id: &str,
    req: &ExecRequest,
    stdin: bool,
    json: bool,
) -> Result<i32, Failure> {
    let mut s = if stdin {
        let input = tokio_util::io::ReaderStream::new(tokio::io::stdin());
        c.exec_stream_piped(id, req, input).await?
    } else {
        c.exec_stream(id, req).await?
    };
    let Some(r) = play_stream(&mut s, json).await? else {
        return Err(Failure::new(
            ErrorCode::Internal,
            "exec stream ended without an exit status".into(),
        ));
    };
    if json {
        let mut doc = serde_json::to_value(&r).unwrap_or_default();
        doc["sandbox"] = serde_json::Value::String(id.to_owned());
        output::json(&doc);
    }
    if r.timed_out {
        eprintln!("aviary: command timed out; its process group was killed");
        return Ok(124);
    }
    if r.oom_killed {
        eprintln!("aviary: command was killed: sandbox out of memory");
    }
    Ok(r.exit_code)
}

async fn run_cmd(a: RunArgs, json: bool) -> Result<i32, Failure> {
    a.exec.check_tty(json)?;
    let (url, key) = client_settings()?;
    let c = Client::new(&url, &key);
    let mut req = a.create.request()?;
    req.lease = Some(AcquireLeaseRequest {
        owner: format!("aviary-run-{}", std::process::id()),
        ttl_s: Some(3600),
    });
    let created = c.create_sandbox(&req).await?;
    let id = created.sandbox.id.to_string();
    let token = created.lease.as_ref().map(|l| l.token);
    let res = if a.exec.tty {
        // Ctrl-C belongs to the terminal session (sent on, or typed in raw mode)
        let cmd = a.exec.tty_command(a.cmd, token);
        tty::run(&url, &key, &id, cmd).await
    } else {
        let ereq = exec_request(a.cmd, &a.exec, token);
        tokio::select! {
            r = stream_exec(&c, &id, &ereq, a.exec.interactive, json) => r,
            _ = tokio::signal::ctrl_c() => Ok(130),
        }
    };
    if let Err(e) = c.delete_sandbox(&id, token).await {
        eprintln!(
            "aviary: could not destroy sandbox {id}: {}",
            Failure::from(e).message
        );
    }
    res
}

/// `sandbox cp SRC ID:/path`: a file, `-` (stdin), or a directory tree
/// (each directory made, each file uploaded; symlinks are not followed and
/// not copied, with a warning). Into an existing directory, SRC goes inside
/// it under its own name, as `cp -r` does. Returns the bytes copied.
async fn copy_in(
    c: &Client,
    id: &str,
    src: &str,
    dst: &str,
    token: Option<LeaseToken>,
    json: bool,
) -> Result<u64, Failure> {
    if src == "-" {
        let p = Progress::bytes(format!("stdin -> {dst}"), None, json);
        return Ok(c
            .upload_reader(id, p.wrap_read(tokio::io::stdin()), dst, token)
            .await?);
    }
    let local = Path::new(src);
    let meta = std::fs::symlink_metadata(local)
        .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{src}: {e}")))?;
    let target = match c.stat(id, dst).await {
        Ok(st) if st.kind == "dir" => format!(
            "{}/{}",
            dst.trim_end_matches('/'),
            local.file_name().and_then(|n| n.to_str()).unwrap_or("copy")
        ),
        _ => dst.to_owned(),
    };
    if meta.is_file() {
        return upload_file(c, id, local, &target, token, json).await;
    }
    if !meta.is_dir() {
        return Err(Failure::exit(
            EXIT_IO_ERROR,
            format!("{src} is not a regular file or a directory"),
        ));
    }
    let mut bytes = 0;
    let progress = Progress::spinner(format!("{src} -> {target}"), json);
    let mut dirs = vec![(local.to_path_buf(), target)];
    while let Some((dir, remote)) = dirs.pop() {
        match c.mkdir(id, &remote, token).await {
            Ok(()) => {}
            // merging into a directory that is there already
            Err(e) if e.code() == Some(ErrorCode::Conflict) => {}
            Err(e) => return Err(e.into()),
        }
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", dir.display())))?
            .flatten()
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                eprintln!(
                    "aviary: skipping {} (name is not UTF-8)",
                    e.path().display()
                );
                continue;
            };
            let child = format!("{}/{name}", remote.trim_end_matches('/'));
            let kind = e.file_type().map_err(|err| {
                Failure::exit(EXIT_IO_ERROR, format!("{}: {err}", e.path().display()))
            })?;
            if kind.is_dir() {
                dirs.push((e.path(), child));
            } else if kind.is_file() {
                progress.set_message(format!("{child} ({bytes} bytes so far)"));
                bytes += upload_file(c, id, &e.path(), &child, token, json).await?;
            } else {
                eprintln!(
                    "aviary: skipping {} (not a regular file or directory)",
                    e.path().display()
                );
            }
        }
    }
    Ok(bytes)
}

/// Uploads one local file, with a byte bar on a terminal.
async fn upload_file(
    c: &Client,
    id: &str,
    local: &Path,
    remote: &str,
    token: Option<LeaseToken>,
    json: bool,
) -> Result<u64, Failure> {
    let file = tokio::fs::File::open(local)
        .await
        .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", local.display())))?;
    let len = file
        .metadata()
        .await
        .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", local.display())))?
        .len();
    let p = Progress::bytes(remote.to_owned(), Some(len), json);
    Ok(
        c.upload_sized(id, p.wrap_read(file), Some(len), remote, token)
            .await?,
    )
}

/// Downloads one sandbox file to `local` (created or truncated), with a
/// byte bar on a terminal.
async fn download_file(
    c: &Client,
    id: &str,
    remote: &str,
    size: u64,
    local: &Path,
    json: bool,
) -> Result<u64, Failure> {
    let file = tokio::fs::File::create(local)
        .await
        .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", local.display())))?;
    let p = Progress::bytes(remote.to_owned(), Some(size), json);
    let mut out = p.wrap_write(file);
    let n = c.download_to(id, remote, &mut out).await?;
    tokio::io::AsyncWriteExt::flush(&mut out)
        .await
        .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", local.display())))?;
    Ok(n)
}

/// `sandbox cp ID:/path DST`: a file, or a directory tree (made locally,
/// symlinks skipped), into DST (inside it when it is a directory), or `-`
/// (stdout). Returns the bytes copied.
async fn copy_out(c: &Client, id: &str, src: &str, dst: &str, json: bool) -> Result<u64, Failure> {
    if dst == "-" {
        let mut out = tokio::io::stdout();
        return Ok(c.download_to(id, src, &mut out).await?);
    }
    let name = Path::new(src)
        .file_name()
        .map(|n| n.to_owned())
        .unwrap_or_default();
    let local = if Path::new(dst).is_dir() {
        Path::new(dst).join(&name)
    } else {
        PathBuf::from(dst)
    };
    let st = c.stat(id, src).await?;
    if st.kind != "dir" {
        return download_file(c, id, src, st.size, &local, json).await;
    }
    let mut bytes = 0;
    let progress = Progress::spinner(format!("{src} -> {}", local.display()), json);
    let mut dirs = vec![(src.trim_end_matches('/').to_owned(), local)];
    while let Some((remote, dir)) = dirs.pop() {
        std::fs::create_dir_all(&dir)
            .map_err(|e| Failure::exit(EXIT_IO_ERROR, format!("{}: {e}", dir.display())))?;
        for e in c.list_files(id, &remote).await?.entries {
            // names come from inside the sandbox: one that is not a plain
            // file name could write outside DST, and is refused
            if !plain_file_name(&e.name) {
                return Err(Failure::new(
                    ErrorCode::InvalidPath,
                    format!(
                        "the sandbox listed an entry {:?} in {remote}: not a plain file name",
                        e.name
                    ),
                ));
            }
            let child_remote = format!("{remote}/{}", e.name);
            let child_local = dir.join(&e.name);
            match e.kind.as_str() {
                "dir" => dirs.push((child_remote, child_local)),
                "file" => {
                    progress.set_message(format!("{child_remote} ({bytes} bytes so far)"));
                    bytes += download_file(c, id, &child_remote, e.size, &child_local, json).await?
                }
                _ => eprintln!("aviary: skipping {child_remote} ({})", e.kind),
            }
        }
    }
    Ok(bytes)
}

/// A single path component that stays where it is joined: not empty, not
/// `.` or `..`, no `/` and no NUL.
fn plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

fn parse_remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    if id.starts_with("sbx-") && path.starts_with('/') {
        Some((id, path))
    } else {
        None
    }
}

async fn sandbox(cmd: SandboxCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    match cmd {
        SandboxCmd::Create {
            create,
            lease_owner,
            lease_ttl,
            env,
        } => {
            let mut req = create.request()?;
            req.env = env.into_iter().collect();
            req.lease = lease_owner.map(|owner| AcquireLeaseRequest {
                owner,
                ttl_s: lease_ttl,
            });
            let r = c.create_sandbox(&req).await?;
            if json {
                output::json(&r);
            } else {
                println!("{}", r.sandbox.id);
                if let Some(l) = &r.lease {
                    println!("{}", l.token);
                    eprintln!("lease of {} expires {}", l.owner, output::ts(l.expires_at));
                }
            }
        }
        SandboxCmd::Ls {
            all,
            metadata,
            state,
            user,
            session,
        } => {
            let l = c
                .list_sandboxes_with(&aviary_client::SandboxFilter {
                    all,
                    metadata: metadata.into_iter().collect(),
                    state,
                    user_id: user,
                    session_id: session,
                })
                .await?;
            if json {
                output::json(&l);
            } else {
                output::sandbox_table(&l.sandboxes);
            }
        }
        SandboxCmd::Ttl { id, secs, token } => {
            let s = c.set_ttl(&id, secs, token).await?;
            if json {
                output::json(&s);
            } else {
                let at = s.expires_at.map(output::ts).unwrap_or_default();
                println!("{} expires {at}", s.id);
            }
        }
        SandboxCmd::Get { id } => {
            let s = c.get_sandbox(&id).await?;
            if json {
                output::json(&s);
            } else {
                output::sandbox_detail(&s);
            }
        }
        SandboxCmd::Rm { id, token } => {
            let s = c.delete_sandbox(&id, token).await?;
            if json {
                output::json(&s);
            } else {
                println!("{}", s.id);
            }
        }
        SandboxCmd::Exec {
            id,
            token,
            detach,
            exec,
            cmd,
        } => {
            if exec.tty {
                exec.check_tty(json)?;
                let (url, key) = client_settings()?;
                return tty::run(&url, &key, &id, exec.tty_command(cmd, token)).await;
            }
            let req = exec_request(cmd, &exec, token);
            if detach {
                let started = c.start_background(&id, &req).await?;
                if json {
                    output::json(&started);
                } else {
                    println!("{}", started.handle);
                    eprintln!(
                        "pid {}; read its output with `aviary sandbox logs {id} {}`",
                        started.pid, started.handle
                    );
                }
                return Ok(0);
            }
            return stream_exec(&c, &id, &req, exec.interactive, json).await;
        }
        SandboxCmd::Ps { id } => {
            let list = c.list_processes(&id).await?;
            if json {
                output::json(&list);
            } else {
                output::process_table(&list.processes);
            }
        }
        SandboxCmd::Usage { id, all_tenants } => {
            let u = if all_tenants {
                c.sandbox_usage_any_tenant(&id).await?
            } else {
                c.sandbox_usage(&id).await?
            };
            if json {
                output::json(&u);
            } else {
                output::usage_table(&u);
            }
        }
        SandboxCmd::Kill {
            id,
            pid,
            signal,
            token,
        } => {
            c.signal_process(&id, pid, Some(&signal), token).await?;
            if json {
                output::json(&serde_json::json!({"sandbox": id, "pid": pid, "signal": signal}));
            }
        }
        SandboxCmd::Logs { id, handle, follow } => {
            return background_logs(&c, &id, handle, follow, json).await;
        }
        SandboxCmd::Port { id, port } => {
            let ep = c.port_endpoint(&id, port).await?;
            if json {
                output::json(&ep);
            } else {
                println!("{}", ep.url);
                eprintln!(
                    "with the API key: curl -H \"Authorization: Bearer $AVIARY_API_KEY\" {}",
                    ep.url
                );
                eprintln!(
                    "without it:       curl -H \"{}: {}\" {}",
                    ep.header, ep.token, ep.url
                );
                eprintln!("in a browser:     {}", ep.browser_url);
            }
        }
        SandboxCmd::Pause { id, token } => action(&c, &id, "pause", token, json, None).await?,
        SandboxCmd::Resume { id, token } => action(&c, &id, "resume", token, json, None).await?,
        SandboxCmd::Reset { id, token, level } => {
            let s = c.reset(&id, level, token).await?;
            if json {
                output::json(&s);
            } else {
                println!("{} {}", s.id, s.state);
            }
        }
        SandboxCmd::Taint { id, reason } => {
            let s = c.taint(&id, &reason).await?;
            if json {
                output::json(&s);
            } else {
                println!("{} {} tainted", s.id, s.state);
            }
        }
        SandboxCmd::Release { id, token } => action(&c, &id, "release", token, json, None).await?,
        SandboxCmd::Snapshot { id, token, label } => {
            let s = {
                let _p = Progress::spinner(format!("snapshotting {id}"), json);
                c.snapshot_labelled(&id, &label, token).await?
            };
            if json {
                output::json(&s);
            } else {
                println!("{}", s["id"].as_str().unwrap_or(""));
                eprintln!(
                    "{} bytes in the trees, {} new bytes stored",
                    s["total_bytes"], s["new_bytes"]
                );
            }
        }
        SandboxCmd::Fork {
            id,
            snapshot,
            live,
            token,
        } => {
            let r = {
                let _p = Progress::spinner(format!("forking {id}"), json);
                if live {
                    c.fork_live(&id, token).await?
                } else {
                    c.fork(&id, snapshot.as_deref(), token).await?
                }
            };
            if json {
                output::json(&r);
            } else {
                println!("{}", r.sandbox.id);
            }
        }
        SandboxCmd::Hibernate { id, token } => {
            let p = Progress::spinner(format!("hibernating {id}"), json);
            action(&c, &id, "hibernate", token, json, Some(p)).await?
        }
        SandboxCmd::Wake { id } => {
            let p = Progress::spinner(format!("waking {id}"), json);
            action(&c, &id, "wake", None, json, Some(p)).await?
        }
        SandboxCmd::Snapshots { sandbox } => output::json(&c.snapshots(sandbox.as_deref()).await?),
        SandboxCmd::Manifest { id, refresh } => output::json(&c.manifest(&id, refresh).await?),
        SandboxCmd::Cp { src, dst, token } => {
            let n = match (parse_remote(&src), parse_remote(&dst)) {
                (None, Some((id, path))) => copy_in(&c, id, &src, path, token, json).await?,
                (Some((id, path)), None) => copy_out(&c, id, path, &dst, json).await?,
                _ => {
                    return Err(Failure::new(
                        ErrorCode::InvalidRequest,
                        "exactly one of SRC and DST must be ID:/absolute/path".into(),
                    ))
                }
            };
            if dst == "-" {
                // stdout carries the file itself
            } else if json {
                output::json(&serde_json::json!({"bytes": n}));
            } else {
                eprintln!("{n} bytes copied");
            }
        }
    }
    Ok(0)
}

async fn lease(cmd: LeaseCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    match cmd {
        LeaseCmd::Acquire { id, owner, ttl } => {
            let l = c.acquire_lease(&id, &owner, ttl).await?;
            if json {
                output::json(&l);
            } else {
                println!("{}", l.token);
            }
        }
        LeaseCmd::Renew { id, token, ttl } => {
            let l = c.renew_lease(&id, token, ttl).await?;
            if json {
                output::json(&l);
            } else {
                println!("{}", l.token);
            }
        }
        LeaseCmd::Release { id, token } => {
            c.release_lease(&id, token).await?;
            if json {
                output::json(&serde_json::json!({"released": true}));
            }
        }
    }
    Ok(0)
}

async fn events(a: EventsArgs, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    let limit = a.limit.unwrap_or(100);
    let list = match a.after {
        Some(after) => {
            c.events(a.sandbox.as_deref(), Some(after), Some(limit))
                .await?
        }
        None => c.newest_events(a.sandbox.as_deref(), limit).await?,
    };
    let print = |e: &aviary_core::api::Event| {
        if json {
            match serde_json::to_string(e) {
                Ok(s) => println!("{s}"),
                Err(err) => eprintln!("aviary: {err}"),
            }
        } else {
            output::event_line(e);
        }
        let _ = std::io::stdout().flush();
    };
    let mut last = a.after;
    for e in &list.events {
        print(e);
        last = Some(e.id);
    }
    if !a.follow {
        return Ok(0);
    }
    // from the last one shown (or from now), pushed by the server
    let mut stream = c.follow_events(a.sandbox.as_deref(), last).await?;
    loop {
        tokio::select! {
            next = stream.next() => match next? {
                Some(e) => print(&e),
                None => return Ok(0),
            },
            _ = tokio::signal::ctrl_c() => return Ok(130),
        }
    }
}

async fn snapshot_cmd(cmd: SnapshotCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    match cmd {
        SnapshotCmd::Ls { sandbox } => output::json(&c.snapshots(sandbox.as_deref()).await?),
        SnapshotCmd::Rm { id } => {
            let s = c.delete_snapshot(&id).await?;
            if json {
                output::json(&s);
            } else {
                println!("{id} deleted");
            }
        }
    }
    Ok(0)
}

async fn template(cmd: TemplateCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    match cmd {
        TemplateCmd::Rm { name } => {
            c.remove_template(&name).await?;
            if json {
                output::json(&serde_json::json!({"removed": name}));
            } else {
                println!("{name} removed");
            }
        }
        TemplateCmd::Ls => {
            let l = c.templates().await?;
            if json {
                output::json(&l);
            } else {
                output::template_table(&l.templates);
            }
        }
        TemplateCmd::Import {
            name,
            archive,
            force,
        } => {
            let t = {
                let size = std::fs::metadata(&archive).map(|m| m.len()).unwrap_or(0);
                let _p = Progress::spinner(
                    format!("importing {} ({size} bytes) as {name}", archive.display()),
                    json,
                );
                c.import_template_with(&name, &archive, force).await?
            };
            if json {
                output::json(&t);
            } else {
                println!("{} {}", t.name, t.digest);
            }
        }
    }
    Ok(0)
}

async fn key(cmd: KeyCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    match cmd {
        KeyCmd::Create { tenant, admin } => {
            let k = c.create_key(&tenant, admin).await?;
            if json {
                output::json(&k);
            } else {
                eprintln!("aviary: key {} for tenant {}", k.id, k.tenant);
                println!("{}", k.key);
            }
        }
        KeyCmd::Ls => {
            let keys = c.list_keys().await?;
            if json {
                output::json(&keys);
            } else {
                output::key_table(&keys);
            }
        }
        KeyCmd::Revoke { id } => {
            let k = c.revoke_key(&id).await?;
            if json {
                output::json(&k);
            } else {
                println!("{} revoked", k.id);
            }
        }
    }
    Ok(0)
}

fn read_json(p: &Path) -> Result<serde_json::Value, Failure> {
    let text = if p.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .map_err(|e| Failure::new(ErrorCode::NotFound, format!("reading stdin: {e}")))?;
        s
    } else {
        std::fs::read_to_string(p).map_err(|e| {
            Failure::new(ErrorCode::NotFound, format!("reading {}: {e}", p.display()))
        })?
    };
    serde_json::from_str(&text).map_err(|e| {
        Failure::new(
            ErrorCode::InvalidRequest,
            format!("{} is not valid JSON: {e}", p.display()),
        )
    })
}

async fn plan(intent: PathBuf, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    let ctx = read_json(&intent)?;
    let r = c.plan(&ctx).await?;
    if json {
        output::json(&r);
    } else {
        let i = &r["intent"];
        println!(
            "class:       {} ({} cpu, {} MiB)",
            i["resource_class"].as_str().unwrap_or("?"),
            i["cpu"],
            i["memory_mb"]
        );
        println!(
            "source:      {} (confidence {})",
            i["source"].as_str().unwrap_or("?"),
            i["confidence"]
        );
        println!("reason:      {}", i["reason"].as_str().unwrap_or(""));
        let p = &r["policy"];
        if p["approved"].as_bool() == Some(true) {
            println!(
                "policy:      approved {}{}",
                p["class"].as_str().unwrap_or("?"),
                if p["clamped"].as_bool() == Some(true) {
                    " (clamped)"
                } else {
                    ""
                }
            );
        } else {
            println!(
                "policy:      denied [{}]",
                p["denial_code"].as_str().unwrap_or("?")
            );
        }
        for reason in p["reasons"].as_array().into_iter().flatten() {
            println!("             {}", reason.as_str().unwrap_or(""));
        }
    }
    Ok(0)
}

async fn pool(cmd: PoolCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    let list = match cmd {
        PoolCmd::Ls => c.pools().await?,
        PoolCmd::Set { class, min, max } => c.set_pool(&class, min, max).await?,
    };
    if json {
        output::json(&list);
        return Ok(0);
    }
    output::table(
        [
            "CLASS", "TEMPLATE", "RT", "MIN", "MAX", "BMIN", "BMAX", "IDLE", "HANDED", "HITS",
            "MISSES",
        ],
        list["pools"].as_array().into_iter().flatten().map(|p| {
            let n = |k: &str| p[k].as_u64().unwrap_or(0).to_string();
            let t = |k: &str| p[k].as_str().unwrap_or("").to_owned();
            [
                t("class"),
                t("template"),
                t("runtime"),
                n("pool_min"),
                n("pool_max"),
                n("buffer_min"),
                n("buffer_max"),
                n("idle"),
                n("handed_out"),
                n("hits"),
                n("misses"),
            ]
        }),
    );
    Ok(0)
}

/// A sandbox action (`POST /v1/sandboxes/{id}/{what}`), printing the
/// sandbox; `progress` (if any) is cleared before the answer is printed.
async fn action(
    c: &Client,
    id: &str,
    what: &str,
    token: Option<LeaseToken>,
    json: bool,
    progress: Option<Progress>,
) -> Result<(), Failure> {
    let s = c.sandbox_action(id, what, token).await;
    drop(progress);
    let s = s?;
    if json {
        output::json(&s);
    } else {
        println!("{} {}", s.id, s.state);
    }
    Ok(())
}

async fn node(a: NodeArgs) -> Result<i32, Failure> {
    crate::telemetry::init();
    let fail = |e: String| Failure::new(ErrorCode::Internal, e);
    std::fs::create_dir_all(&a.data_dir)
        .map_err(|e| fail(format!("creating {}: {e}", a.data_dir.display())))?;
    let token = match a.token {
        Some(t) => t,
        None => {
            let p = a.data_dir.join("node.token");
            match std::fs::read_to_string(&p) {
                Ok(t) => t.trim().to_owned(),
                Err(_) => {
                    let t = format!("avn_{}", aviary_core::new_id("t").trim_start_matches("t-"));
                    std::fs::write(&p, &t)
                        .map_err(|e| fail(format!("writing {}: {e}", p.display())))?;
                    use std::os::unix::fs::PermissionsExt;
                    let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600));
                    t
                }
            }
        }
    };
    let binary = aviary_runtime_oci::OciBinary::try_from(
        a.runtime
            .parse::<aviary_core::RuntimeName>()
            .map_err(|e| Failure::new(ErrorCode::InvalidRequest, e))?,
    )
    .map_err(|e| Failure::new(ErrorCode::InvalidRequest, e.to_string()))?;
    let templates_dir = a
        .templates_dir
        .unwrap_or_else(|| a.data_dir.join("templates"));
    let mut oci = aviary_runtime_oci::OciConfig::new(binary, a.data_dir.join("sandboxes"))
        .with_template_store(&templates_dir);
    oci.disk_fs = a
        .disk_fs
        .parse()
        .map_err(|e: String| Failure::new(ErrorCode::InvalidRequest, format!("--disk-fs: {e}")))?;
    let runtime =
        aviary_runtime_oci::OciRuntime::new(oci).map_err(|e| fail(format!("runtime: {e}")))?;
    runtime
        .probe()
        .await
        .map_err(|e| fail(format!("runtime self-check: {e}")))?;
    let templates = aviary_templates::TemplateStore::open(templates_dir)
        .map_err(|e| fail(format!("templates: {e}")))?;
    let envd = find_envd(a.envd);
    let runtime = std::sync::Arc::new(runtime);
    let running = aviary_node::start_node(aviary_node::NodeConfig {
        id: a.id.clone(),
        listen: a.listen,
        token,
        runtime: runtime.clone(),
        layers: Some(runtime),
        templates,
        state_dir: a.data_dir.join("agent"),
        capacity: aviary_node::Capacity::detect(),
        provided_binds: vec![aviary_node::ProvidedBind::envd(envd)],
    })
    .await
    .map_err(|e| fail(format!("{e}")))?;
    eprintln!(
        "aviary: node {} listening on {} (token in {}); register it with `aviary nodes add {} {} --token …`",
        a.id,
        running.addr(),
        a.data_dir.join("node.token").display(),
        a.id,
        running.addr()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| fail(e.to_string()))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    running.stop().await;
    Ok(0)
}

async fn nodes(cmd: NodesCmd, json: bool) -> Result<i32, Failure> {
    let c = client()?;
    let list = match cmd {
        NodesCmd::Ls => c.nodes().await?,
        NodesCmd::Add { id, address, token } => c.add_node(&id, &address, &token).await?,
    };
    if json {
        output::json(&list);
        return Ok(0);
    }
    output::table(
        [
            "ID", "ADDRESS", "CPU", "MEM MiB", "CPU USED", "MEM USED", "HEALTHY",
        ],
        list["nodes"].as_array().into_iter().flatten().map(|n| {
            [
                n["id"].as_str().unwrap_or("").to_owned(),
                n["address"].as_str().unwrap_or("").to_owned(),
                n["cpu_capacity"].to_string(),
                n["memory_capacity_mb"].to_string(),
                format!("{:.1}", n["cpu_committed"].as_f64().unwrap_or(0.0)),
                n["memory_committed_mb"].to_string(),
                n["healthy"].to_string(),
            ]
        }),
    );
    Ok(0)
}

#[cfg(test)]
mod tests {

    #[test]
    fn only_plain_file_names_are_joined_to_a_local_dir() {
        for ok in ["a", "a.txt", ".hidden", "..x", "x.."] {
            assert!(plain_file_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../etc", "/etc/passwd", "a/b", "a\0b"] {
            assert!(!plain_file_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn server_urls_take_a_bare_host_and_refuse_the_rest() {
        assert_eq!(
            server_url("127.0.0.1:7400").unwrap(),
            "http://127.0.0.1:7400"
        );
        assert_eq!(
            server_url("https://aviary.example/").unwrap(),
            "https://aviary.example"
        );
        for bad in ["ftp://h", "http://", ":7400", "unix:///x"] {
            let e = server_url(bad).unwrap_err();
            assert!(e.message.contains("AVIARY_URL"), "{bad}: {}", e.message);
            assert_eq!(e.code, ErrorCode::InvalidRequest.cli_exit_code());
        }
    }

    use super::*;

    #[test]
    fn compat_env_prints_one_export_a_line_for_the_server() {
        let lines = compat_env_lines("http://10.0.0.5:7400");
        assert!(lines.contains(&"export E2B_API_URL=http://10.0.0.5:7400/e2b".to_owned()));
        assert!(lines.contains(&"export E2B_SANDBOX_URL=http://10.0.0.5:7400/e2b/envd".to_owned()));
        assert!(lines.contains(&"export OPEN_SANDBOX_DOMAIN=10.0.0.5:7400/opensandbox".to_owned()));
        assert!(lines.contains(&"export OPEN_SANDBOX_PROTOCOL=http".to_owned()));
        let tls = compat_env_lines("https://aviary.example:443");
        assert!(tls.contains(&"export OPEN_SANDBOX_PROTOCOL=https".to_owned()));
        for l in &lines {
            assert!(l.starts_with("export ") || l.starts_with('#'), "{l}");
            if let Some(e) = l.strip_prefix("export ") {
                let (name, value) = e.split_once('=').unwrap();
                assert!(
                    name.bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
                    "{l}"
                );
                assert!(!value.contains(' '), "{l}");
            }
        }
    }

    #[test]
    fn api_errors_exit_through_the_error_table() {
        for code in ErrorCode::ALL {
            let f = Failure::from(ClientError::Api {
                status: code.http_status(),
                code,
                message: "m".into(),
            });
            assert_eq!(f.code, code.cli_exit_code(), "{code:?}");
            assert!(f.message.contains(code.as_str()), "{}", f.message);
        }
    }

    #[test]
    fn help_documents_every_exit_code() {
        let codes = ErrorCode::ALL
            .into_iter()
            .map(ErrorCode::cli_exit_code)
            .chain([EXIT_IO_ERROR, EXIT_CONFIG]);
        for exit in codes {
            assert!(
                AFTER_HELP.contains(&format!(" {exit} ")),
                "--help does not explain exit code {exit}"
            );
        }
    }
}
