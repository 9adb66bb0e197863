// Aviary web console: hash-routed pages over the v1 API (see api.js).
//   #/login            API key
//   #/sandboxes        live list with filters
//   #/new              create form (shows a policy denial's reason)
//   #/sandboxes/ID     one sandbox, its live event timeline, destroy
import { render } from "preact";
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { api, ApiError, metadataQuery, parseLabels, readEventStream, session } from "./api.js";

const STATES = [
  "Requested", "Planning", "Allocating", "Provisioning", "Locking", "Ready", "Leased", "Running",
  "Idle", "ReuseChecking", "Recycling", "Hibernating", "Sanitizing", "Terminated", "Failed", "Lost",
];
const REFRESH_MS = 2000;

function useHash() {
  const [hash, setHash] = useState(location.hash || "#/sandboxes");
  useEffect(() => {
    const on = () => setHash(location.hash || "#/sandboxes");
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return hash;
}

const go = (hash) => {
  location.hash = hash;
};

function age(iso, now) {
  const s = Math.max(0, Math.floor((now - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function Labels({ labels }) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return <span class="muted">none</span>;
  return (
    <ul class="labels">
      {entries.map(([k, v]) => (
        <li key={k}><code>{k}={v}</code></li>
      ))}
    </ul>
  );
}

function ErrorNote({ error }) {
  if (!error) return null;
  const api = error instanceof ApiError;
  return (
    <div class="error" role="alert" data-testid="error">
      {api ? <strong class="code">{error.code}</strong> : null}
      {api ? ": " : ""}
      <span class="message">{error.message}</span>
      {api && error.requestId ? <span class="muted"> (request {error.requestId})</span> : null}
    </div>
  );
}

// Focuses a page's heading when the page changes, so keyboard and screen
// reader users land on the new content.
function Heading({ children }) {
  const ref = useRef(null);
  useEffect(() => ref.current && ref.current.focus(), []);
  return <h1 tabIndex={-1} ref={ref}>{children}</h1>;
}

function Login({ onLogin }) {
  const [key, setKey] = useState("");
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      // the key is checked by asking the API for something it guards
      await api("GET", "/v1/sandboxes", undefined, { key: key.trim() });
      session.set(key.trim());
      onLogin();
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return (
    <main id="main" class="narrow">
      <Heading>Log in</Heading>
      <p>Use an Aviary API key. It stays in this tab only (session storage) and is sent as a bearer token.</p>
      <form onSubmit={submit}>
        <label for="api-key">API key</label>
        <input id="api-key" name="api-key" type="password" autocomplete="off" required value={key}
          onInput={(e) => setKey(e.currentTarget.value)} />
        <button type="submit" disabled={busy}>Log in</button>
      </form>
      <ErrorNote error={error} />
    </main>
  );
}

function SandboxList() {
  const [state, setState] = useState("");
  const [labelText, setLabelText] = useState("");
  const [showEnded, setShowEnded] = useState(false);
  const [live, setLive] = useState(true);
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const [now, setNow] = useState(Date.now());

  const load = useCallback(async () => {
    const q = new URLSearchParams();
    if (showEnded || state === "Terminated" || state === "Failed") q.set("all", "true");
    if (state) q.set("state", state);
    try {
      const labels = parseLabels(labelText);
      if (Object.keys(labels).length) q.set("metadata", metadataQuery(labels));
      const r = await api("GET", `/v1/sandboxes?${q}`);
      setData(r.sandboxes);
      setError(null);
    } catch (err) {
      setError(err);
    }
    setNow(Date.now());
  }, [state, labelText, showEnded]);

  useEffect(() => {
    load();
    if (!live) return undefined;
    const t = setInterval(load, REFRESH_MS);
    return () => clearInterval(t);
  }, [load, live]);

  return (
    <main id="main">
      <Heading>Sandboxes</Heading>
      <form class="filters" onSubmit={(e) => { e.preventDefault(); load(); }} aria-label="Filter sandboxes">
        <div>
          <label for="f-state">State</label>
          <select id="f-state" value={state} onChange={(e) => setState(e.currentTarget.value)}>
            <option value="">any</option>
            {STATES.map((s) => <option key={s} value={s}>{s}</option>)}
          </select>
        </div>
        <div>
          <label for="f-labels">Labels (key=value, comma separated)</label>
          <input id="f-labels" value={labelText} onInput={(e) => setLabelText(e.currentTarget.value)}
            placeholder="team=search" />
        </div>
        <div class="check">
          <input id="f-ended" type="checkbox" checked={showEnded} onChange={(e) => setShowEnded(e.currentTarget.checked)} />
          <label for="f-ended">Include ended</label>
        </div>
        <div class="check">
          <input id="f-live" type="checkbox" checked={live} onChange={(e) => setLive(e.currentTarget.checked)} />
          <label for="f-live">Live refresh</label>
        </div>
      </form>
      <ErrorNote error={error} />
      {data === null ? <p aria-busy="true">Loading…</p> : (
        <div class="table-wrap">
          <table data-testid="sandbox-table">
            <caption class="sr-only">Sandboxes visible to this key</caption>
            <thead>
              <tr>
                <th scope="col">Id</th><th scope="col">State</th><th scope="col">Class</th>
                <th scope="col">Runtime</th><th scope="col">Node</th><th scope="col">Lease holder</th>
                <th scope="col">Age</th><th scope="col">Labels</th>
              </tr>
            </thead>
            <tbody>
              {data.map((s) => (
                <tr key={s.id} data-sandbox={s.id}>
                  <td data-label="Id"><a href={`#/sandboxes/${encodeURIComponent(s.id)}`}><code>{s.id}</code></a></td>
                  <td data-label="State"><span class={`state state-${s.state}`}>{s.state}</span>{s.paused ? " (paused)" : ""}</td>
                  <td data-label="Class">{s.resource_class}</td>
                  <td data-label="Runtime">{s.runtime}</td>
                  <td data-label="Node">{s.node}</td>
                  <td data-label="Lease holder">{s.lease_owner || <span class="muted">none</span>}</td>
                  <td data-label="Age"><time datetime={s.created_at}>{age(s.created_at, now)}</time></td>
                  <td data-label="Labels"><Labels labels={s.metadata} /></td>
                </tr>
              ))}
            </tbody>
          </table>
          {data.length === 0 ? <p class="muted" data-testid="empty">No sandboxes match.</p> : null}
        </div>
      )}
    </main>
  );
}

function CreateSandbox() {
  const [templates, setTemplates] = useState([]);
  const [form, setForm] = useState({ class: "", template: "", network: "", labels: "" });
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  useEffect(() => {
    api("GET", "/v1/templates").then((r) => setTemplates(r.templates || [])).catch(setError);
  }, []);
  const field = (name) => ({
    value: form[name],
    onInput: (e) => setForm({ ...form, [name]: e.currentTarget.value }),
  });
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    setBusy(true);
    try {
      const body = { metadata: parseLabels(form.labels) };
      if (form.class.trim()) body.class = form.class.trim();
      if (form.template) body.template = form.template;
      if (form.network.trim()) body.network = form.network.trim();
      const r = await api("POST", "/v1/sandboxes", body);
      // the create's answer names why (reuse decision, restore branch, score):
      // kept for this tab so the sandbox's page can show it
      sessionStorage.setItem(`aviary.decision.${r.id}`, JSON.stringify(r.decision));
      go(`#/sandboxes/${encodeURIComponent(r.id)}`);
    } catch (err) {
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return (
    <main id="main" class="narrow">
      <Heading>New sandbox</Heading>
      <form onSubmit={submit}>
        <label for="c-class">Resource class</label>
        <input id="c-class" {...field("class")} placeholder="the default class" aria-describedby="c-class-help" />
        <p id="c-class-help" class="help">The policy guard approves, clamps or denies it.</p>
        <label for="c-template">Template</label>
        <select id="c-template" value={form.template} onChange={(e) => setForm({ ...form, template: e.currentTarget.value })}>
          <option value="">the default template</option>
          {templates.map((t) => <option key={t.name} value={t.name}>{t.name}</option>)}
        </select>
        <label for="c-network">Network profile</label>
        <input id="c-network" {...field("network")} placeholder="none" />
        <label for="c-labels">Labels (one key=value per line)</label>
        <textarea id="c-labels" rows={3} {...field("labels")} />
        <button type="submit" disabled={busy}>{busy ? "Creating…" : "Create"}</button>
      </form>
      <ErrorNote error={error} />
    </main>
  );
}

function eventSummary(ev) {
  const parts = [];
  if (ev.old_state || ev.new_state) parts.push(`${ev.old_state || "∅"} → ${ev.new_state || "∅"}`);
  const m = ev.metadata || {};
  for (const k of ["reason", "message", "action", "branch", "score", "class", "command", "exit_code", "owner"]) {
    if (m[k] !== undefined && m[k] !== null && typeof m[k] !== "object") parts.push(`${k}: ${m[k]}`);
  }
  return parts.join(" · ");
}

function Timeline({ id }) {
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
        const r = await api("GET", `/v1/sandboxes/${encodeURIComponent(id)}/events?limit=1000&newest=true`, undefined, { signal: ctl.signal });
        add(r.events);
        if (r.events.length) after = r.events[r.events.length - 1].id;
      } catch (err) {
        if (!ctl.signal.aborted) { setError(err); setStatus("stopped"); }
        return;
      }
      while (!ctl.signal.aborted) {
        try {
          await readEventStream(`/v1/events/stream?sandbox=${encodeURIComponent(id)}&after=${after}`, {
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
  }, [id]);
  return (
    <section aria-labelledby="timeline-h">
      <h2 id="timeline-h">Events <span class={`live live-${status}`} data-testid="stream-status">{status}</span></h2>
      <ErrorNote error={error} />
      <ol class="timeline" aria-live="polite" data-testid="timeline">
        {events.map((ev) => (
          <li key={ev.id} data-event-id={ev.id} data-event-type={ev.event_type}>
            <time datetime={ev.timestamp}>{new Date(ev.timestamp).toLocaleTimeString()}</time>
            <strong>{ev.event_type}</strong>
            <span class="summary">{eventSummary(ev)}</span>
            {ev.request_id ? <span class="muted"> request {ev.request_id}</span> : null}
            {ev.metadata && Object.keys(ev.metadata).length ? (
              <details>
                <summary>details</summary>
                <pre>{JSON.stringify(ev.metadata, null, 2)}</pre>
              </details>
            ) : null}
          </li>
        ))}
      </ol>
    </section>
  );
}

function SandboxPage({ id }) {
  const [sbx, setSbx] = useState(null);
  const [error, setError] = useState(null);
  const [confirming, setConfirming] = useState(false);
  const [note, setNote] = useState(null);
  const load = useCallback(async () => {
    try {
      setSbx(await api("GET", `/v1/sandboxes/${encodeURIComponent(id)}`));
      setError(null);
    } catch (err) {
      setError(err);
    }
  }, [id]);
  useEffect(() => {
    load();
    const t = setInterval(load, REFRESH_MS);
    return () => clearInterval(t);
  }, [load]);
  const destroy = async () => {
    try {
      await api("DELETE", `/v1/sandboxes/${encodeURIComponent(id)}`);
      setConfirming(false);
      setNote("Destroyed.");
      load();
    } catch (err) {
      setError(err);
    }
  };
  const ended = sbx && (sbx.state === "Terminated" || sbx.state === "Failed");
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
          {ended ? null : confirming ? (
            <div class="confirm" role="group" aria-label="Confirm destroy">
              <p>Destroy this sandbox? Its processes and files are gone for good.</p>
              <button type="button" class="danger" onClick={destroy}>Yes, destroy</button>
              <button type="button" onClick={() => setConfirming(false)}>Cancel</button>
            </div>
          ) : (
            <button type="button" class="danger" onClick={() => setConfirming(true)}>Destroy…</button>
          )}
        </>
      ) : error ? null : <p aria-busy="true">Loading…</p>}
      {error && error.status === 404 ? null : <Timeline id={id} />}
    </main>
  );
}

function App() {
  const hash = useHash();
  const [key, setKey] = useState(session.key());
  const logout = () => {
    session.clear();
    setKey(null);
    go("#/login");
  };
  if (!key) return <Login onLogin={() => { setKey(session.key()); go("#/sandboxes"); }} />;
  const m = hash.match(/^#\/sandboxes\/([^/]+)$/);
  let page;
  if (m) page = <SandboxPage key={m[1]} id={decodeURIComponent(m[1])} />;
  else if (hash === "#/new") page = <CreateSandbox />;
  else page = <SandboxList />;
  const current = (h) => (hash === h ? "page" : undefined);
  return (
    <>
      <header>
        <a class="brand" href="#/sandboxes">Aviary</a>
        <nav aria-label="Main">
          <a href="#/sandboxes" aria-current={current("#/sandboxes")}>Sandboxes</a>
          <a href="#/new" aria-current={current("#/new")}>New sandbox</a>
          <button type="button" class="link" onClick={logout}>Log out</button>
        </nav>
      </header>
      {page}
    </>
  );
}

render(<App />, document.getElementById("app"));
