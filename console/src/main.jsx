// Aviary web console: hash-routed pages over the v1 API (see api.js).
//   #/login            API key
//   #/sandboxes        live list with filters
//   #/new              create form (shows a policy denial's reason)
//   #/sandboxes/ID     one sandbox: terminal, files, processes, snapshots,
//                      manifest, planner record, live event timeline, destroy
//   #/planner #/events #/audit        everyone (their own tenant; the admin
//                                     may widen them to every tenant)
//   #/pools #/nodes #/charts #/keys   admin keys only
import "./csp-styles.js";
import { render } from "preact";
import { useCallback, useEffect, useState } from "preact/hooks";
import { api, metadataQuery, parseLabels, probeAdmin, session } from "./api.js";
import { SandboxPage } from "./sandbox.jsx";
import { AuditPage, ChartsPage, EventsPage, KeysPage, NodesPage, PlannerPage, PoolsPage } from "./pages.jsx";
import { age, ErrorNote, go, Heading, Labels, REFRESH_MS } from "./ui.jsx";

const STATES = [
  "Requested", "Planning", "Allocating", "Provisioning", "Locking", "Ready", "Leased", "Running",
  "Idle", "ReuseChecking", "Recycling", "Hibernating", "Sanitizing", "Terminated", "Failed", "Lost",
];

function useHash() {
  const [hash, setHash] = useState(location.hash || "#/sandboxes");
  useEffect(() => {
    const on = () => setHash(location.hash || "#/sandboxes");
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return hash;
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
      // which pages to offer: the admin-only key list answers it
      session.setAdmin(await probeAdmin());
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
  const [allTenants, setAllTenants] = useState(false);
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const [now, setNow] = useState(Date.now());

  const load = useCallback(async () => {
    const q = new URLSearchParams();
    if (showEnded || state === "Terminated" || state === "Failed") q.set("all", "true");
    if (state) q.set("state", state);
    if (allTenants) q.set("all_tenants", "true");
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
  }, [state, labelText, showEnded, allTenants]);

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
        {session.admin() ? (
          <div class="check">
            <input id="f-all-tenants" type="checkbox" checked={allTenants} onChange={(e) => setAllTenants(e.currentTarget.checked)} />
            <label for="f-all-tenants">All tenants (admin)</label>
          </div>
        ) : null}
      </form>
      <ErrorNote error={error} />
      {data === null ? <p aria-busy="true">Loading…</p> : (
        <div class="table-wrap">
          <table data-testid="sandbox-table">
            <caption class="sr-only">Sandboxes visible to this key</caption>
            <thead>
              <tr>
                <th scope="col">Id</th>{allTenants ? <th scope="col">Tenant</th> : null}<th scope="col">State</th><th scope="col">Class</th>
                <th scope="col">Runtime</th><th scope="col">Node</th><th scope="col">Lease holder</th>
                <th scope="col">Age</th><th scope="col">Labels</th>
              </tr>
            </thead>
            <tbody>
              {data.map((s) => (
                <tr key={s.id} data-sandbox={s.id} data-tenant={s.tenant}>
                  <td data-label="Id"><a href={`#/sandboxes/${encodeURIComponent(s.id)}`}><code>{s.id}</code></a></td>
                  {allTenants ? <td data-label="Tenant">{s.tenant}</td> : null}
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

function App() {
  const hash = useHash();
  const [key, setKey] = useState(session.key());
  const logout = () => {
    session.clear();
    setKey(null);
    go("#/login");
  };
  if (!key) return <Login onLogin={() => { setKey(session.key()); go("#/sandboxes"); }} />;
  const admin = session.admin();
  const m = hash.match(/^#\/sandboxes\/([^/]+)$/);
  const pages = {
    "#/new": CreateSandbox, "#/planner": PlannerPage, "#/events": EventsPage, "#/audit": AuditPage,
    ...(admin ? { "#/pools": PoolsPage, "#/nodes": NodesPage, "#/charts": ChartsPage, "#/keys": KeysPage } : {}),
  };
  let page;
  if (m) page = <SandboxPage key={m[1]} id={decodeURIComponent(m[1])} />;
  else if (pages[hash]) { const P = pages[hash]; page = <P key={hash} />; }
  else page = <SandboxList />;
  const current = (h) => (hash === h ? "page" : undefined);
  return (
    <>
      <header>
        <a class="brand" href="#/sandboxes">Aviary</a>
        <nav aria-label="Main">
          <a href="#/sandboxes" aria-current={current("#/sandboxes")}>Sandboxes</a>
          <a href="#/new" aria-current={current("#/new")}>New sandbox</a>
          <a href="#/planner" aria-current={current("#/planner")}>Planner</a>
          <a href="#/events" aria-current={current("#/events")}>Events</a>
          <a href="#/audit" aria-current={current("#/audit")}>Audit</a>
          {admin ? (
            <>
              <a href="#/pools" aria-current={current("#/pools")}>Pools</a>
              <a href="#/nodes" aria-current={current("#/nodes")}>Nodes</a>
              <a href="#/charts" aria-current={current("#/charts")}>Charts</a>
              <a href="#/keys" aria-current={current("#/keys")}>Tenants and keys</a>
            </>
          ) : null}
          <button type="button" class="link" onClick={logout}>Log out</button>
        </nav>
      </header>
      {page}
    </>
  );
}

render(<App />, document.getElementById("app"));
