// One sandbox: its fields and create decision, its live resource usage, a
// terminal into it, its files (upload, download), its processes, its snapshots and their lineage,
// its environment manifest, the planner's allocation for it, and the live
// timeline of its events.
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { api, apiBytes, apiPutBytes, ApiError, readEventStream, session, ttySocket } from "./api.js";
import { bytes, ErrorNote, EventItem, Fields, go, Heading, Labels, REFRESH_MS, usePoll } from "./ui.jsx";

const enc = new TextEncoder();
const sid = (id) => encodeURIComponent(id);

function Timeline({ id, foreign = false }) {
  const [events, setEvents] = useState([]);
  const [status, setStatus] = useState("connecting");
  const [error, setError] = useState(null);
  useEffect(() => {
    const ctl = new AbortController();
    const seen = new Set();
    const add = (list) => {
      const fresh = list.filter((e) => !seen.has(e.id));
      fresh.forEach((e) => seen.add(e.id));
      if (fresh.length) setEvents((old) => [...old, ...fresh]);
    };
    (async () => {
      // history first, then the live stream from the last id seen; a dropped
      // stream is reopened from there
      let after = 0;
      try {
        // another tenant's sandbox (the admin's read-only view): the
        // cross-tenant event query
        const history = foreign
          ? `/v1/events?sandbox=${sid(id)}&limit=1000&newest=true&all_tenants=true`
          : `/v1/sandboxes/${sid(id)}/events?limit=1000&newest=true`;
        const r = await api("GET", history, undefined, { signal: ctl.signal });
        add(r.events);
        if (r.events.length) after = r.events[r.events.length - 1].id;
      } catch (err) {
        if (!ctl.signal.aborted) { setError(err); setStatus("stopped"); }
        return;
      }
      while (!ctl.signal.aborted) {
        try {
          await readEventStream(`/v1/events/stream?sandbox=${sid(id)}&after=${after}${foreign ? "&all_tenants=true" : ""}`, {
            signal: ctl.signal,
            onOpen: () => setStatus("live"),
            onEvent: (type, data) => {
              if (type !== "event") return;
              const ev = JSON.parse(data);
              after = Math.max(after, ev.id);
              add([ev]);
            },
          });
        } catch (err) {
          if (ctl.signal.aborted) return;
          if (err instanceof ApiError) { setError(err); setStatus("stopped"); return; }
        }
        if (ctl.signal.aborted) return;
        setStatus("reconnecting");
        await new Promise((r) => setTimeout(r, 1000));
      }
    })();
    return () => ctl.abort();
  }, [id, foreign]);
  // the decisions worth a second look: why it was reused or made, what the
  // policy said
  const decisions = events.filter((e) => /plan|reuse|policy|restore|taint|egress|fork/.test(e.event_type));
  return (
    <section aria-labelledby="timeline-h">
      <h2 id="timeline-h">Events <span class={`live live-${status}`} data-testid="stream-status">{status}</span></h2>
      <ErrorNote error={error} />
      {decisions.length ? (
        <p class="muted" data-testid="decision-events">
          Decisions in this log: {decisions.map((e) => e.event_type).join(", ")}
        </p>
      ) : null}
      <ol class="timeline" aria-live="polite" data-testid="timeline">
        {events.map((ev) => <EventItem key={ev.id} ev={ev} />)}
      </ol>
    </section>
  );
}

/** A shell in the sandbox over the terminal WebSocket, drawn by xterm.js. */
function TerminalPanel({ id, token }) {
  const host = useRef(null);
  const sess = useRef(null);
  const closeButton = useRef(null);
  const [status, setStatus] = useState("closed");
  const [error, setError] = useState(null);
  const [exit, setExit] = useState(null);

  const close = useCallback(() => {
    const s = sess.current;
    sess.current = null;
    if (!s) return;
    removeEventListener("resize", s.onResize);
    s.ws.close();
    s.term.dispose();
  }, []);
  useEffect(() => close, [close]);

  const open = async () => {
    close();
    setError(null);
    setExit(null);
    setStatus("connecting");
    let XTerm;
    let FitAddon;
    try {
      [{ Terminal: XTerm }, { FitAddon }] = await Promise.all([import("@xterm/xterm"), import("@xterm/addon-fit")]);
    } catch (err) {
      setError(err);
      setStatus("closed");
      return;
    }
    const term = new XTerm({ rows: 20, fontSize: 14, fontFamily: "ui-monospace, monospace", scrollback: 2000 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(host.current);
    term.textarea?.setAttribute("aria-label", "Terminal input");
    try { fit.fit(); } catch { /* not laid out yet: keep the default size */ }
    let ws;
    try {
      ws = ttySocket(id, token.trim() || undefined);
    } catch (err) {
      // e.g. a lease token with characters a subprotocol cannot carry
      term.dispose();
      setError(new ApiError(0, "invalid_request", `cannot open the terminal: ${err.message}`));
      setStatus("closed");
      return;
    }
    const send = (data) => { if (ws.readyState === WebSocket.OPEN) ws.send(data); };
    const onResize = () => {
      try { fit.fit(); } catch { return; }
      send(JSON.stringify({ type: "resize", cols: term.cols, rows: term.rows }));
    };
    sess.current = { term, ws, onResize };
    ws.onopen = () => {
      ws.send(JSON.stringify({ cols: term.cols, rows: term.rows }));
      setStatus("open");
      term.focus();
    };
    ws.onmessage = (m) => {
      if (typeof m.data !== "string") {
        term.write(new Uint8Array(m.data));
        return;
      }
      let msg;
      try { msg = JSON.parse(m.data); } catch { return; }
      if (msg.exit) setExit(msg.exit);
      else if (msg.error) setError(new ApiError(0, msg.error.code, msg.error.message, msg.error.request_id));
    };
    ws.onclose = (ev) => {
      setStatus(ev.code === 1000 ? "exited" : "closed");
      if (ev.code !== 1000 && ev.code !== 1005 && !sess.current?.errored) {
        setError((old) => old || new ApiError(ev.code, ev.code >= 4000 ? `http_${ev.code - 4000}` : "closed", ev.reason || "the terminal connection closed"));
      }
    };
    // the shell takes every key, Tab included; F6 hands focus back to the page
    term.attachCustomKeyEventHandler((e) => {
      if (e.type === "keydown" && e.key === "F6") {
        closeButton.current?.focus();
        return false;
      }
      return true;
    });
    term.onData((d) => send(enc.encode(d)));
    term.onBinary((d) => send(Uint8Array.from(d, (c) => c.charCodeAt(0))));
    addEventListener("resize", onResize);
  };

  return (
    <section aria-labelledby="term-h" class="panel">
      <h2 id="term-h">Terminal <span class={`live live-${status}`} data-testid="term-status">{status}</span></h2>
      <p class="help">A shell in the sandbox (<code>/bin/sh</code>). While it has focus every key, Tab included, goes to the shell; F6 moves focus back to the page.</p>
      <div class="row">
        <button type="button" onClick={open} data-testid="term-open">{status === "open" ? "Restart terminal" : "Open terminal"}</button>
        {status === "open" ? <button type="button" ref={closeButton} onClick={() => { close(); setStatus("closed"); }}>Close terminal</button> : null}
      </div>
      <ErrorNote error={error} testid="term-error" />
      {exit ? <p role="status" data-testid="term-exit">Exited with code {String(exit.exit_code)}{exit.signal ? ` (signal ${exit.signal})` : ""}.</p> : null}
      <div class="term-host" ref={host} role="region" aria-label="Terminal output" data-testid="terminal" />
    </section>
  );
}

function parentOf(path) {
  if (path === "/") return "/";
  const p = path.replace(/\/+$/, "").split("/").slice(0, -1).join("/");
  return p || "/";
}

function joinPath(dir, name) {
  return `${dir.replace(/\/+$/, "")}/${name}`;
}

/** Lists a directory; uploads into it; downloads a file. */
function FileBrowser({ id, token }) {
  const [dir, setDir] = useState("/workspace");
  const [typed, setTyped] = useState("/workspace");
  const [listing, setListing] = useState(null);
  const [error, setError] = useState(null);
  const [note, setNote] = useState(null);
  const [busy, setBusy] = useState(false);
  const fileInput = useRef(null);

  const load = useCallback(async (path) => {
    try {
      const r = await api("GET", `/v1/sandboxes/${sid(id)}/files/list?path=${encodeURIComponent(path)}`);
      const entries = [...r.entries].sort((a, b) => (a.kind === "dir") === (b.kind === "dir") ? a.name.localeCompare(b.name) : a.kind === "dir" ? -1 : 1);
      setListing({ entries, truncated: r.truncated });
      setError(null);
    } catch (err) {
      setListing(null);
      setError(err);
    }
  }, [id]);
  useEffect(() => { load(dir); }, [dir, load]);
  const cd = (path) => { setTyped(path); setDir(path); setNote(null); };

  const upload = async (e) => {
    e.preventDefault();
    const files = [...(fileInput.current?.files || [])];
    if (!files.length) return;
    setBusy(true);
    setError(null);
    try {
      const done = [];
      for (const f of files) {
        const r = await apiPutBytes(`/v1/sandboxes/${sid(id)}/files?path=${encodeURIComponent(joinPath(dir, f.name))}`, f, { token: token.trim() || undefined });
        done.push(`${f.name} (${r.bytes} bytes)`);
      }
      setNote(`Uploaded ${done.join(", ")}.`);
      fileInput.current.value = "";
      load(dir);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };

  const download = async (entry) => {
    setError(null);
    try {
      const blob = await apiBytes(`/v1/sandboxes/${sid(id)}/files?path=${encodeURIComponent(entry.path)}`);
      const url = URL.createObjectURL(blob);
      const a = document.createElement("a");
      a.href = url;
      a.download = entry.name;
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
      setNote(`Downloaded ${entry.name} (${blob.size} bytes).`);
    } catch (err) {
      setError(err);
    }
  };

  return (
    <section aria-labelledby="files-h" class="panel">
      <h2 id="files-h">Files</h2>
      <form class="row" onSubmit={(e) => { e.preventDefault(); cd(typed.trim() || "/"); }}>
        <div>
          <label for="fb-path">Directory</label>
          <input id="fb-path" value={typed} onInput={(e) => setTyped(e.currentTarget.value)} />
        </div>
        <button type="submit">Open</button>
        <button type="button" onClick={() => cd(parentOf(dir))} disabled={dir === "/"}>Up</button>
      </form>
      <form class="row" onSubmit={upload}>
        <div>
          <label for="fb-upload">Upload into {dir}</label>
          <input id="fb-upload" type="file" multiple ref={fileInput} />
        </div>
        <button type="submit" disabled={busy}>{busy ? "Uploading…" : "Upload"}</button>
      </form>
      <ErrorNote error={error} testid="files-error" />
      {note ? <p role="status" data-testid="files-note">{note}</p> : null}
      {listing ? (
        <div class="table-wrap">
          <table data-testid="file-table">
            <caption class="sr-only">Files in {dir}</caption>
            <thead><tr><th scope="col">Name</th><th scope="col">Kind</th><th scope="col">Size</th><th scope="col">Mode</th><th scope="col">Modified</th></tr></thead>
            <tbody>
              {listing.entries.map((f) => (
                <tr key={f.path} data-file={f.name}>
                  <td data-label="Name">
                    {f.kind === "dir"
                      ? <button type="button" class="link" onClick={() => cd(f.path)}>{f.name}/</button>
                      : f.kind === "file"
                        ? <button type="button" class="link" onClick={() => download(f)} aria-label={`Download ${f.name}`}>{f.name}</button>
                        : <span>{f.name}</span>}
                  </td>
                  <td data-label="Kind">{f.kind}</td>
                  <td data-label="Size">{f.kind === "file" ? bytes(f.size) : ""}</td>
                  <td data-label="Mode"><code>{(f.mode & 0o7777).toString(8).padStart(4, "0")}</code></td>
                  <td data-label="Modified">{new Date(f.modified_unix * 1000).toLocaleString()}</td>
                </tr>
              ))}
            </tbody>
          </table>
          {listing.entries.length === 0 ? <p class="muted">Empty directory.</p> : null}
          {listing.truncated ? <p class="muted">The listing was cut short.</p> : null}
        </div>
      ) : null}
    </section>
  );
}

function Processes({ id }) {
  const [live, setLive] = useState(true);
  const [data, error] = usePoll(() => api("GET", `/v1/sandboxes/${sid(id)}/processes`), [id], { live });
  return (
    <section aria-labelledby="procs-h" class="panel">
      <h2 id="procs-h">Processes</h2>
      <div class="check">
        <input id="procs-live" type="checkbox" checked={live} onChange={(e) => setLive(e.currentTarget.checked)} />
        <label for="procs-live">Live refresh</label>
      </div>
      <ErrorNote error={error} testid="procs-error" />
      {data ? (
        <div class="table-wrap">
          <table data-testid="proc-table">
            <caption class="sr-only">Processes in the sandbox</caption>
            <thead><tr><th scope="col">PID</th><th scope="col">Parent</th><th scope="col">User</th><th scope="col">State</th><th scope="col">Command</th></tr></thead>
            <tbody>
              {data.processes.map((p) => (
                <tr key={p.pid}>
                  <td data-label="PID">{p.pid}</td>
                  <td data-label="Parent">{p.ppid}</td>
                  <td data-label="User">{p.user ?? p.uid}</td>
                  <td data-label="State">{p.state}</td>
                  <td data-label="Command"><code>{p.argv.join(" ")}{p.truncated ? " …" : ""}</code></td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      ) : null}
    </section>
  );
}

/** Whether the page is visible (a hidden tab polls nothing). */
function usePageVisible() {
  const [visible, setVisible] = useState(() => document.visibilityState !== "hidden");
  useEffect(() => {
    const on = () => setVisible(document.visibilityState !== "hidden");
    document.addEventListener("visibilitychange", on);
    return () => document.removeEventListener("visibilitychange", on);
  }, []);
  return visible;
}

const pct = (part, whole) => (whole > 0 ? `${((part * 100) / whole).toFixed(1)}%` : "—");

/** One resource: its name, a meter of used against the limit (when it has one), the figures as text. */
function UsageMeter({ name, field, value, max, raw, text }) {
  const labelId = `usage-${field}-label`;
  return (
    <div class="usage-row" data-usage={field} data-value={String(raw ?? value)}>
      <dt id={labelId}>{name}</dt>
      <dd>
        {max > 0 ? <meter min="0" max={max} value={Math.min(value, max)} high={max * 0.9} optimum={0} aria-labelledby={labelId} aria-valuetext={text} /> : null}
        <span class="usage-text">{text}</span>
      </dd>
    </div>
  );
}

/**
 * The sandbox's live resource usage, read from its runtime every 2 s while
 * the page is visible: memory against its limit, CPU (the change of its CPU
 * time between two reads), processes, disk when the runtime knows it.
 */
function Usage({ id, foreign }) {
  const visible = usePageVisible();
  const [live, setLive] = useState(true);
  const prev = useRef(null);
  const [cpu, setCpu] = useState(null);
  const [data, error] = usePoll(async () => {
    const u = await api("GET", `/v1/sandboxes/${sid(id)}/usage${foreign ? "?all_tenants=true" : ""}`);
    const p = prev.current;
    const dt = p ? (Date.parse(u.sampled_at) - Date.parse(p.sampled_at)) / 1000 : 0;
    setCpu(p && dt > 0 ? Math.max(0, ((u.cpu_seconds - p.cpu_seconds) * 100) / dt) : null);
    prev.current = u;
    return u;
  }, [id, foreign], { live: live && visible });
  const cores = data ? `${data.cpu_limit} CPU${data.cpu_limit === 1 ? "" : "s"}` : "";
  return (
    <section aria-labelledby="usage-h" class="panel">
      <h2 id="usage-h">Usage</h2>
      <div class="check">
        <input id="usage-live" type="checkbox" checked={live} onChange={(e) => setLive(e.currentTarget.checked)} />
        <label for="usage-live">Live refresh (every 2 s while this page is visible)</label>
      </div>
      <ErrorNote error={error} testid="usage-error" />
      {data ? (
        <>
          <dl class="usage" data-testid="usage">
            <UsageMeter name="Memory" field="memory" value={data.memory_bytes} max={data.memory_limit_bytes}
              text={`${bytes(data.memory_bytes)} of ${bytes(data.memory_limit_bytes)} (${pct(data.memory_bytes, data.memory_limit_bytes)}); peak ${bytes(data.memory_peak_bytes)}`} />
            <UsageMeter name="CPU" field="cpu" value={cpu ?? 0} max={data.cpu_limit * 100} raw={data.cpu_seconds}
              text={`${cpu === null ? "measuring…" : `${cpu.toFixed(1)}% of one core`} (limit ${cores}); ${data.cpu_seconds.toFixed(2)} s used in all`} />
            <UsageMeter name="Processes" field="pids" value={data.pids} max={data.pids_limit}
              text={`${data.pids} of ${data.pids_limit} (envd included)`} />
            {data.disk_used_bytes == null ? (
              <UsageMeter name="Disk" field="disk" value={0} max={0} raw=""
                text={`not known to this runtime (size ${bytes(data.disk_limit_bytes)})`} />
            ) : (
              <UsageMeter name="Disk" field="disk" value={data.disk_used_bytes} max={data.disk_limit_bytes}
                text={`${bytes(data.disk_used_bytes)} of ${bytes(data.disk_limit_bytes)} (${pct(data.disk_used_bytes, data.disk_limit_bytes)})`} />
            )}
            <UsageMeter name="OOM kills" field="oom" value={data.oom_kills} max={0} text={String(data.oom_kills)} />
          </dl>
          <p class="muted" data-testid="usage-sampled">
            {data.paused ? "Paused: its counters stand still. " : ""}Read at <time datetime={data.sampled_at}>{new Date(data.sampled_at).toLocaleTimeString()}</time>.
          </p>
        </>
      ) : null}
    </section>
  );
}

/** Snapshot trees (parent → children, and the sandboxes forked from each)
 * that hold one of this sandbox's snapshots or the one it was forked from. */
function SnapshotNode({ snap, children, forks, id, onFork }) {
  const kids = children.get(snap.id) || [];
  const forked = forks.get(snap.id) || [];
  return (
    <li data-snapshot={snap.id}>
      <span class={snap.sandbox_id === id ? "own" : ""}>
        <code>{snap.id}</code> <span class="tag">{snap.label}</span>{" "}
        {snap.sandbox_id === id ? "this sandbox" : <>of <a href={`#/sandboxes/${sid(snap.sandbox_id)}`}><code>{snap.sandbox_id}</code></a></>}
        {" · "}{new Date(snap.created_at).toLocaleString()} · {bytes(snap.total_bytes)} ({bytes(snap.new_bytes)} new)
      </span>
      {" "}<button type="button" class="link" onClick={() => onFork(snap)} aria-label={`Fork a new sandbox from snapshot ${snap.id}`}>fork</button>
      {kids.length || forked.length ? (
        <ul>
          {kids.map((k) => <SnapshotNode key={k.id} snap={k} children={children} forks={forks} id={id} onFork={onFork} />)}
          {forked.map((f) => (
            <li key={f} data-fork={f} class="fork">
              forked into {f === id ? <strong>this sandbox</strong> : <a href={`#/sandboxes/${sid(f)}`}><code>{f}</code></a>}
            </li>
          ))}
        </ul>
      ) : null}
    </li>
  );
}

function Snapshots({ id, running }) {
  const [data, error, reload] = usePoll(async () => {
    const [snaps, events] = await Promise.all([
      api("GET", "/v1/snapshots"),
      api("GET", "/v1/events?limit=1000&newest=true"),
    ]);
    return { snapshots: snaps.snapshots || [], forked: events.events.filter((e) => e.event_type === "forked") };
  }, [], { ms: 5000 });
  const [actError, setActError] = useState(null);
  const [busy, setBusy] = useState(false);
  const take = async () => {
    setBusy(true);
    setActError(null);
    try {
      await api("POST", `/v1/sandboxes/${sid(id)}/snapshot`);
      reload();
    } catch (err) {
      setActError(err);
    } finally {
      setBusy(false);
    }
  };
  const fork = async (snap) => {
    setActError(null);
    try {
      const r = await api("POST", `/v1/sandboxes/${sid(snap.sandbox_id)}/fork`, { snapshot: snap.id });
      sessionStorage.setItem(`aviary.decision.${r.id}`, JSON.stringify(r.decision));
      go(`#/sandboxes/${sid(r.id)}`);
    } catch (err) {
      setActError(err);
    }
  };
  let body = null;
  if (data) {
    const all = data.snapshots;
    const byId = new Map(all.map((s) => [s.id, s]));
    const children = new Map();
    for (const s of all) {
      if (s.parent && byId.has(s.parent)) {
        if (!children.has(s.parent)) children.set(s.parent, []);
        children.get(s.parent).push(s);
      }
    }
    const forks = new Map();
    let source = null;
    for (const e of data.forked) {
      const snap = e.metadata?.snapshot;
      if (typeof snap !== "string" || !e.sandbox_id) continue;
      if (!forks.has(snap)) forks.set(snap, []);
      forks.get(snap).push(e.sandbox_id);
      if (e.sandbox_id === id) source = e.metadata;
    }
    const rootOf = (s) => { let r = s; const seen = new Set(); while (r.parent && byId.has(r.parent) && !seen.has(r.id)) { seen.add(r.id); r = byId.get(r.parent); } return r; };
    const mine = all.filter((s) => s.sandbox_id === id || (source && s.id === source.snapshot));
    const roots = [...new Map(mine.map((s) => { const r = rootOf(s); return [r.id, r]; })).values()];
    body = (
      <>
        {source ? <p data-testid="forked-from">Forked from snapshot <code>{source.snapshot}</code> of <a href={`#/sandboxes/${sid(source.parent_sandbox)}`}><code>{source.parent_sandbox}</code></a>.</p> : null}
        {roots.length
          ? <ul class="tree" data-testid="snapshot-tree">{roots.map((r) => <SnapshotNode key={r.id} snap={r} children={children} forks={forks} id={id} onFork={fork} />)}</ul>
          : <p class="muted">No snapshots of this sandbox.</p>}
      </>
    );
  }
  return (
    <section aria-labelledby="snaps-h" class="panel">
      <h2 id="snaps-h">Snapshots and forks</h2>
      {running ? <button type="button" onClick={take} disabled={busy}>{busy ? "Taking snapshot…" : "Take snapshot"}</button> : null}
      <ErrorNote error={error || actError} testid="snapshots-error" />
      {body}
    </section>
  );
}

function Manifest({ id, running }) {
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const load = async (refresh) => {
    setBusy(true);
    try {
      setData(await api("GET", `/v1/sandboxes/${sid(id)}/manifest${refresh ? "?refresh=true" : ""}`));
      setError(null);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  useEffect(() => { load(false); }, [id]);
  const pkgs = (set) => (set ? Object.keys(set.packages || {}).length : 0);
  return (
    <section aria-labelledby="manifest-h" class="panel">
      <h2 id="manifest-h">Environment manifest</h2>
      {running ? <button type="button" onClick={() => load(true)} disabled={busy}>{busy ? "Probing…" : "Probe now"}</button> : null}
      <ErrorNote error={error} testid="manifest-error" />
      {data ? (
        <>
          <Fields testid="manifest" rows={[
            ["Template digest", <code>{data.base_template_digest}</code>],
            ["Runtimes", Object.entries(data.runtimes || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "none found"],
            ["Python", [...(data.python_interpreters || [])].join(", ") || "none"],
            ["pip packages", pkgs(data.pip)], ["npm packages", pkgs(data.npm)], ["apt packages", pkgs(data.apt)],
            ["Dirty level", data.dirty_level], ["Dirty paths", (data.dirty_paths || []).join(", ") || "none"],
            ["Workspace", data.workspace_id], ["Last snapshot", data.last_snapshot_id],
          ]} />
          <details><summary>full manifest</summary><pre>{JSON.stringify(data, null, 2)}</pre></details>
        </>
      ) : null}
    </section>
  );
}

/** The planner's and the policy's record for this sandbox, with its measured usage. */
function Allocation({ id }) {
  const [data, error] = usePoll(() => api("GET", "/v1/allocations?limit=1000"), [id], { ms: 10000 });
  const mine = data ? data.allocations.filter((a) => a.sandbox_id === id) : [];
  return (
    <section aria-labelledby="alloc-h" class="panel">
      <h2 id="alloc-h">Planner and usage</h2>
      <ErrorNote error={error} testid="alloc-error" />
      {data && !mine.length ? <p class="muted">No planner record for this sandbox (it was created without a task context).</p> : null}
      {mine.map((a) => (
        <Fields key={a.id} testid="allocation" rows={[
          ["Task", a.task_id || "—"], ["Recommended class", a.recommended_class], ["Approved class", a.actual_class],
          ["Source", a.source], ["Confidence", a.confidence.toFixed(2)], ["Reason", a.reason],
          ["Asked for", `${a.cpu} CPU, ${a.memory_mb} MiB`],
          ["Measured usage", a.usage ? <code>{JSON.stringify(a.usage)}</code> : "not yet (measured when it ends)"],
        ]} />
      ))}
    </section>
  );
}

export function SandboxPage({ id }) {
  const [sbx, setSbx] = useState(null);
  const [error, setError] = useState(null);
  const [confirming, setConfirming] = useState(false);
  const [note, setNote] = useState(null);
  // a leased sandbox's writes (terminal, uploads) need the holder's token
  const [token, setToken] = useState("");
  // the admin opening another tenant's sandbox: read only (fields and
  // timeline through the admin's cross-tenant queries)
  const [foreign, setForeign] = useState(false);
  const load = useCallback(async () => {
    try {
      setSbx(await api("GET", `/v1/sandboxes/${sid(id)}${foreign ? "?all_tenants=true" : ""}`));
      setError(null);
    } catch (err) {
      if (!foreign && session.admin() && err instanceof ApiError && err.status === 404) {
        try {
          setSbx(await api("GET", `/v1/sandboxes/${sid(id)}?all_tenants=true`));
          setForeign(true);
          setError(null);
          return;
        } catch {
          // not in any tenant either: the first answer stands
        }
      }
      setError(err);
    }
  }, [id, foreign]);
  useEffect(() => {
    load();
    const t = setInterval(load, REFRESH_MS);
    return () => clearInterval(t);
  }, [load]);
  const destroy = async () => {
    try {
      await api("DELETE", `/v1/sandboxes/${sid(id)}`);
      setConfirming(false);
      setNote("Destroyed.");
      load();
    } catch (err) {
      setError(err);
    }
  };
  const ended = sbx && (sbx.state === "Terminated" || sbx.state === "Failed");
  // its compute exists (paused or not): the runtime has counters to read
  const holdsCompute = sbx && ["Ready", "Leased", "Running", "Idle", "ReuseChecking"].includes(sbx.state);
  const running = sbx && !foreign && !ended && !sbx.paused && ["Ready", "Leased", "Running", "Idle"].includes(sbx.state);
  let decision = null;
  try {
    decision = JSON.parse(sessionStorage.getItem(`aviary.decision.${id}`) || "null");
  } catch {
    decision = null;
  }
  return (
    <main id="main">
      <Heading>Sandbox <code>{id}</code></Heading>
      <ErrorNote error={error} />
      {note ? <p role="status" data-testid="note">{note}</p> : null}
      {sbx ? (
        <>
          <dl class="fields" data-testid="fields">
            {[
              ["State", `${sbx.state}${sbx.paused ? " (paused)" : ""}`], ["Tenant", sbx.tenant],
              ["Class", sbx.resource_class],
              ["Resources", sbx.resources ? `${sbx.resources.cpu} CPU, ${sbx.resources.memory_mb} MiB` : ""],
              ["Template", sbx.template], ["Template digest", sbx.template_digest], ["Runtime", sbx.runtime],
              ["Node", sbx.node], ["Network", sbx.network_profile], ["Scope", sbx.scope],
              ["User", sbx.user_id || "—"], ["Session", sbx.session_id || "—"], ["Agent", sbx.agent || "—"],
              ["Lease holder", sbx.lease_owner || "none"], ["Created", sbx.created_at],
              ["Expires", sbx.expires_at || "never"], ["Tainted", sbx.tainted ? "yes" : "no"],
            ].map(([k, v]) => (
              <div key={k}><dt>{k}</dt><dd data-field={k}>{String(v)}</dd></div>
            ))}
            <div><dt>Labels</dt><dd><Labels labels={sbx.metadata} /></dd></div>
          </dl>
          {decision ? (
            <section aria-labelledby="decision-h" data-testid="decision">
              <h2 id="decision-h">Create decision</h2>
              <dl class="fields">
                <div><dt>Action</dt><dd data-decision="action">{decision.action}</dd></div>
                <div><dt>Restore branch</dt><dd data-decision="branch">{decision.branch}</dd></div>
                <div><dt>Score</dt><dd data-decision="score">{String(decision.score)}</dd></div>
                <div><dt>Reason</dt><dd data-decision="reason">{decision.reason}</dd></div>
              </dl>
            </section>
          ) : null}
          {foreign ? (
            <p role="note" class="note" data-testid="foreign">
              Tenant <strong>{sbx.tenant}</strong>'s sandbox, shown read only to the admin: its terminal, files and
              actions belong to that tenant's keys.
            </p>
          ) : null}
          {ended || foreign ? null : confirming ? (
            <div class="confirm" role="group" aria-label="Confirm destroy">
              <p>Destroy this sandbox? Its processes and files are gone for good.</p>
              <button type="button" class="danger" onClick={destroy}>Yes, destroy</button>
              <button type="button" onClick={() => setConfirming(false)}>Cancel</button>
            </div>
          ) : (
            <button type="button" class="danger" onClick={() => setConfirming(true)}>Destroy…</button>
          )}
          {running && sbx.lease_owner ? (
            <div class="panel narrow-field">
              <label for="lease-token">Lease token (this sandbox is leased by {sbx.lease_owner})</label>
              <input id="lease-token" value={token} autocomplete="off" aria-describedby="lease-token-help"
                onInput={(e) => setToken(e.currentTarget.value)} placeholder="FENCE.SECRET" />
              <p id="lease-token-help" class="help">The terminal and uploads present it; without it the sandbox refuses them.</p>
            </div>
          ) : null}
          {running ? <TerminalPanel id={id} token={token} /> : null}
          {running ? <FileBrowser id={id} token={token} /> : null}
          {holdsCompute ? <Usage key={id} id={id} foreign={foreign} /> : null}
          {running ? <Processes id={id} /> : null}
          {foreign ? null : <Snapshots id={id} running={running} />}
          {ended || foreign ? null : <Manifest id={id} running={running} />}
          {foreign ? null : <Allocation id={id} />}
        </>
      ) : error ? null : <p aria-busy="true">Loading…</p>}
      {(error && error.status === 404) || (!sbx && !error) ? null : <Timeline key={String(foreign)} id={id} foreign={foreign} />}
    </main>
  );
}
