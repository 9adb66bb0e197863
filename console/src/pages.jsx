// The cluster's pages: planner, events, audit of denials (everyone, each
// tenant its own; the admin may widen them to every tenant), and the admin
// pages: pools, nodes, charts from the server's metrics, tenants and keys.
import { useEffect, useRef, useState } from "preact/hooks";
import { api, apiText, ApiError, parseMetrics, readEventStream, session } from "./api.js";
import { LineChart } from "./chart.jsx";
import { ErrorNote, EventItem, Fields, Heading, usePoll } from "./ui.jsx";

const SAMPLES = 150; // 5 minutes at one sample per 2 s

function AllTenants({ checked, onChange }) {
  if (!session.admin()) return null;
  return (
    <div class="check">
      <input id="all-tenants" type="checkbox" checked={checked} onChange={(e) => onChange(e.currentTarget.checked)} />
      <label for="all-tenants">All tenants (admin)</label>
    </div>
  );
}

export function PlannerPage() {
  const [all, setAll] = useState(false);
  const [data, error] = usePoll(() => api("GET", "/v1/allocations?limit=200"), []);
  const [task, setTask] = useState("");
  const [plan, setPlan] = useState(null);
  const [planError, setPlanError] = useState(null);
  const ask = async (e) => {
    e.preventDefault();
    setPlanError(null);
    try {
      setPlan(await api("POST", "/v1/plan", { task: task.trim() }));
    } catch (err) {
      setPlan(null);
      setPlanError(err);
    }
  };
  const rows = data ? data.allocations : [];
  const count = (f) => rows.filter(f).length;
  return (
    <main id="main">
      <Heading>Planner</Heading>
      <p>What the planner recommended for each task, what the policy approved, and why. <em>Telemetry</em> means a
        correction from measured peaks of similar work; a plan whose LLM answer was refused or failed shows the planner it
        fell back to.</p>
      <AllTenants checked={all} onChange={setAll} />
      <form onSubmit={ask} class="narrow">
        <label for="p-task">Try a task</label>
        <textarea id="p-task" rows={2} value={task} onInput={(e) => setTask(e.currentTarget.value)} placeholder="pip install pandas and train a small model" required />
        <button type="submit">Plan</button>
      </form>
      <ErrorNote error={planError} testid="plan-error" />
      {plan ? (
        <section aria-labelledby="plan-h" data-testid="plan">
          <h2 id="plan-h">Plan</h2>
          <Fields rows={[
            ["Class", plan.intent.resource_class], ["Source", plan.intent.source], ["Confidence", plan.intent.confidence],
            ["Reason", plan.intent.reason], ["Features", plan.trace.features], ["Fell back", plan.trace.fell_back ? "yes" : "no"],
            ["Policy", plan.policy.approved ? `approved: ${plan.policy.class}${plan.policy.clamped ? " (clamped)" : ""}` : `denied: ${plan.policy.denial_code}`],
            ["Policy reasons", plan.policy.reasons.join("; ") || "—"],
          ]} />
          <h3>Trace</h3>
          <ol class="trace" data-testid="plan-trace">
            {plan.trace.steps.map((s, i) => <li key={i}><strong>{s.planner}</strong> {s.outcome}: {s.detail} <span class="muted">({s.elapsed_ms.toFixed(1)} ms)</span></li>)}
          </ol>
        </section>
      ) : null}
      <h2>Recent plans</h2>
      <ErrorNote error={error} />
      {data ? (
        <>
          <p data-testid="planner-summary">{rows.length} plans: {count((a) => a.source === "heuristic")} heuristic,{" "}
            {count((a) => a.source === "telemetry")} telemetry corrections, {count((a) => a.source === "llm")} LLM,{" "}
            {count((a) => a.actual_class && a.actual_class !== a.recommended_class)} changed by the policy.</p>
          <div class="table-wrap">
            <table data-testid="planner-table">
              <caption class="sr-only">Recent plans, newest first</caption>
              <thead><tr><th scope="col">When</th><th scope="col">Task</th><th scope="col">Recommended</th><th scope="col">Approved</th><th scope="col">Source</th><th scope="col">Confidence</th><th scope="col">Reason</th><th scope="col">Sandbox</th><th scope="col">Measured</th></tr></thead>
              <tbody>
                {rows.map((a) => (
                  <tr key={a.id}>
                    <td data-label="When">{new Date(a.created_at).toLocaleString()}</td>
                    <td data-label="Task">{a.task_id || <span class="muted">—</span>}</td>
                    <td data-label="Recommended">{a.recommended_class}</td>
                    <td data-label="Approved">{a.actual_class || <span class="muted">denied</span>}</td>
                    <td data-label="Source"><span class={`tag src-${a.source}`}>{a.source}</span></td>
                    <td data-label="Confidence">{a.confidence.toFixed(2)}</td>
                    <td data-label="Reason">{a.reason}</td>
                    <td data-label="Sandbox">{a.sandbox_id ? <a href={`#/sandboxes/${encodeURIComponent(a.sandbox_id)}`}><code>{a.sandbox_id}</code></a> : "—"}</td>
                    <td data-label="Measured">{a.usage ? <code>{JSON.stringify(a.usage)}</code> : "—"}</td>
                  </tr>
                ))}
              </tbody>
            </table>
            {rows.length === 0 ? <p class="muted">No plans yet: creates with a task context and <code>POST /v1/plan</code> record one.</p> : null}
          </div>
        </>
      ) : null}
    </main>
  );
}

/** Live events: the recent log, then the stream; filter by type and sandbox. */
export function EventsPage() {
  const [all, setAll] = useState(false);
  const [typeFilter, setTypeFilter] = useState("");
  const [sandboxFilter, setSandboxFilter] = useState("");
  const [events, setEvents] = useState([]);
  const [status, setStatus] = useState("connecting");
  const [error, setError] = useState(null);
  useEffect(() => {
    const ctl = new AbortController();
    const scope = all ? "&all_tenants=true" : "";
    setEvents([]);
    setError(null);
    (async () => {
      let after = 0;
      try {
        const r = await api("GET", `/v1/events?limit=200&newest=true${scope}`, undefined, { signal: ctl.signal });
        setEvents(r.events);
        if (r.events.length) after = r.events[r.events.length - 1].id;
      } catch (err) {
        if (!ctl.signal.aborted) { setError(err); setStatus("stopped"); }
        return;
      }
      while (!ctl.signal.aborted) {
        try {
          await readEventStream(`/v1/events/stream?after=${after}${scope}`, {
            signal: ctl.signal,
            onOpen: () => setStatus("live"),
            onEvent: (type, data) => {
              if (type !== "event") return;
              const ev = JSON.parse(data);
              after = Math.max(after, ev.id);
              setEvents((old) => [...old.slice(-999), ev]);
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
  }, [all]);
  const t = typeFilter.trim().toLowerCase();
  const s = sandboxFilter.trim();
  const shown = events.filter((e) => (!t || e.event_type.toLowerCase().includes(t)) && (!s || (e.sandbox_id || "").includes(s)));
  return (
    <main id="main">
      <Heading>Events <span class={`live live-${status}`} data-testid="stream-status">{status}</span></Heading>
      <form class="filters" onSubmit={(e) => e.preventDefault()} aria-label="Filter events">
        <div>
          <label for="e-type">Type contains</label>
          <input id="e-type" value={typeFilter} onInput={(e) => setTypeFilter(e.currentTarget.value)} placeholder="lease" />
        </div>
        <div>
          <label for="e-sandbox">Sandbox id contains</label>
          <input id="e-sandbox" value={sandboxFilter} onInput={(e) => setSandboxFilter(e.currentTarget.value)} />
        </div>
        <AllTenants checked={all} onChange={setAll} />
      </form>
      <ErrorNote error={error} />
      <p class="muted" data-testid="events-count">{shown.length} of {events.length} events</p>
      <ol class="timeline" aria-live="polite" data-testid="events">
        {[...shown].reverse().map((ev) => <EventItem key={ev.id} ev={ev} showSandbox />)}
      </ol>
    </main>
  );
}

const DENIALS = ["policy.denied", "egress_denied"];

/** Policy and egress denials with their reasons. */
export function AuditPage() {
  const [all, setAll] = useState(false);
  const [data, error] = usePoll(() => api("GET", `/v1/events?limit=1000&newest=true${all ? "&all_tenants=true" : ""}`), [all], { ms: 5000 });
  const rows = data ? data.events.filter((e) => DENIALS.includes(e.event_type)).reverse() : [];
  return (
    <main id="main">
      <Heading>Audit: denials</Heading>
      <p>Every create the policy guard refused and every connection the egress proxy refused, with the reason it gave
        (from the last 1000 events).</p>
      <AllTenants checked={all} onChange={setAll} />
      <ErrorNote error={error} />
      {data ? (
        <div class="table-wrap">
          <table data-testid="audit-table">
            <caption class="sr-only">Denials, newest first</caption>
            <thead><tr><th scope="col">When</th><th scope="col">Tenant</th><th scope="col">Kind</th><th scope="col">Code</th><th scope="col">Reason</th><th scope="col">Request</th></tr></thead>
            <tbody>
              {rows.map((e) => (
                <tr key={e.id} data-denial={e.id}>
                  <td data-label="When">{new Date(e.timestamp).toLocaleString()}</td>
                  <td data-label="Tenant">{e.tenant}</td>
                  <td data-label="Kind">{e.event_type}</td>
                  <td data-label="Code"><code>{e.metadata.code || e.metadata.denial_code || "—"}</code></td>
                  <td data-label="Reason">{e.metadata.message || e.metadata.reason || JSON.stringify(e.metadata)}</td>
                  <td data-label="Request">{e.request_id || "—"}</td>
                </tr>
              ))}
            </tbody>
          </table>
          {rows.length === 0 ? <p class="muted" data-testid="audit-empty">No denials.</p> : null}
        </div>
      ) : null}
    </main>
  );
}

/** Keeps the last SAMPLES values of `sample()` taken every 2 s. */
function useHistory(sample, deps) {
  const [hist, setHist] = useState([]);
  const [error, setError] = useState(null);
  const prev = useRef(null);
  useEffect(() => {
    let stop = false;
    const tick = async () => {
      try {
        const v = await sample(prev.current);
        if (stop) return;
        prev.current = v;
        setHist((h) => [...h.slice(-(SAMPLES - 1)), { t: Date.now(), ...v }]);
        setError(null);
      } catch (err) {
        if (!stop) setError(err);
      }
    };
    tick();
    const t = setInterval(tick, 2000);
    return () => { stop = true; clearInterval(t); };
  }, deps);
  return [hist, error];
}

const poolKey = (p) => `${p.class}/${p.template}/${p.runtime}`;
const hitRate = (hits, misses) => (hits + misses ? hits / (hits + misses) : null);

export function PoolsPage() {
  const [hist, error] = useHistory(async () => ({ pools: (await api("GET", "/v1/pools")).pools }), []);
  const now = hist.length ? hist[hist.length - 1].pools : null;
  const keys = now ? now.map(poolKey) : [];
  return (
    <main id="main">
      <Heading>Warm pools</Heading>
      <ErrorNote error={error} />
      {now ? (
        <>
          <div class="table-wrap">
            <table data-testid="pool-table">
              <caption class="sr-only">Warm pools</caption>
              <thead><tr><th scope="col">Class</th><th scope="col">Template</th><th scope="col">Runtime</th><th scope="col">Idle</th><th scope="col">Handed out</th><th scope="col">Min / max</th><th scope="col">Hits</th><th scope="col">Misses</th><th scope="col">Hit rate</th></tr></thead>
              <tbody>
                {now.map((p) => (
                  <tr key={poolKey(p)} data-pool={poolKey(p)}>
                    <td data-label="Class">{p.class}</td><td data-label="Template">{p.template}</td><td data-label="Runtime">{p.runtime}</td>
                    <td data-label="Idle">{p.idle}</td><td data-label="Handed out">{p.handed_out}</td>
                    <td data-label="Min / max">{p.pool_min} / {p.pool_max}</td>
                    <td data-label="Hits">{p.hits}</td><td data-label="Misses">{p.misses}</td>
                    <td data-label="Hit rate">{hitRate(p.hits, p.misses) === null ? "—" : `${(hitRate(p.hits, p.misses) * 100).toFixed(0)}%`}</td>
                  </tr>
                ))}
              </tbody>
            </table>
            {now.length === 0 ? <p class="muted">No warm pools are configured.</p> : null}
          </div>
          {keys.length ? (
            <>
              <LineChart title="Hit rate since start, by pool" unit="%" max={1} testid="chart-pool-hit-rate"
                series={keys.map((k) => ({ name: k, points: hist.map((h) => { const p = h.pools.find((x) => poolKey(x) === k); return p ? [h.t, hitRate(p.hits, p.misses)] : null; }).filter((x) => x && x[1] !== null) }))} />
              <LineChart title="Idle sandboxes, by pool" testid="chart-pool-idle"
                series={keys.map((k) => ({ name: k, points: hist.map((h) => { const p = h.pools.find((x) => poolKey(x) === k); return p ? [h.t, p.idle] : null; }).filter(Boolean) }))} />
            </>
          ) : null}
        </>
      ) : null}
    </main>
  );
}

export function NodesPage() {
  const [data, error] = usePoll(() => api("GET", "/v1/nodes"), []);
  return (
    <main id="main">
      <Heading>Nodes</Heading>
      <ErrorNote error={error} />
      {data ? (
        <ul class="cards" data-testid="node-list">
          {data.nodes.map((n) => (
            <li key={n.id} data-node={n.id} class="card">
              <h2>{n.id} <span class={`tag ${n.healthy ? "ok" : "bad"}`} data-testid="node-health">{n.healthy ? "healthy" : "unhealthy"}</span></h2>
              <p class="muted">{n.address || "this server"} · runtimes {(n.runtimes || []).join(", ")} · last seen {new Date(n.last_seen).toLocaleTimeString()}</p>
              <label for={`cpu-${n.id}`}>CPU committed {n.cpu_committed.toFixed(1)} of {n.cpu_capacity.toFixed(1)} (used {n.cpu_used.toFixed(1)})</label>
              <meter id={`cpu-${n.id}`} min="0" max={Math.max(n.cpu_capacity, n.cpu_committed)} high={n.cpu_capacity * 0.9} value={n.cpu_committed} />
              <label for={`mem-${n.id}`}>Memory committed {n.memory_committed_mb} of {n.memory_capacity_mb} MiB (used {n.memory_used_mb})</label>
              <meter id={`mem-${n.id}`} min="0" max={Math.max(n.memory_capacity_mb, n.memory_committed_mb)} high={n.memory_capacity_mb * 0.9} value={n.memory_committed_mb} />
              <p class="muted">Templates: {(n.templates || []).join(", ") || "—"}</p>
            </li>
          ))}
        </ul>
      ) : null}
    </main>
  );
}

const sum = (samples, name, pred = () => true) => samples.filter((s) => s.name === name && pred(s.labels)).reduce((a, s) => a + s.value, 0);
const isCreate = (l) => l.method === "POST" && l.route === "/v1/sandboxes" && l.status === "2xx";

/** The server's own samples (`GET /v1/metrics/history`) in the charts' shape. */
function fromHistory(samples) {
  const out = [];
  for (const s of samples) {
    const prev = out[out.length - 1];
    const dc = prev ? s.creates_served - prev.cCount : 0;
    out.push({
      t: Date.parse(s.at), hits: s.pool_hits, misses: s.pool_misses, cSum: s.create_seconds_sum, cCount: s.creates_served,
      states: s.by_state, live: s.live, latency: dc > 0 ? ((s.create_seconds_sum - prev.cSum) / dc) * 1000 : null,
    });
  }
  return out;
}

/** Charts from the server's metrics: its own history (the last hour), then
 * `/metrics` (the admin key may read it) sampled every 2 s while open. */
export function ChartsPage() {
  const [past, setPast] = useState(null);
  const [pastError, setPastError] = useState(null);
  useEffect(() => {
    let stop = false;
    api("GET", "/v1/metrics/history")
      .then((r) => { if (!stop) setPast({ interval: r.interval_ms, points: fromHistory(r.samples) }); })
      .catch((err) => { if (!stop) setPastError(err); });
    return () => { stop = true; };
  }, []);
  const [live, error] = useHistory(async (prev) => {
    const m = parseMetrics(await apiText("/metrics"));
    const hits = sum(m, "aviary_pool_hits_total");
    const misses = sum(m, "aviary_pool_misses_total");
    const cSum = sum(m, "aviary_http_request_duration_seconds_sum", isCreate);
    const cCount = sum(m, "aviary_http_request_duration_seconds_count", isCreate);
    const states = {};
    for (const s of m.filter((x) => x.name === "aviary_sandboxes")) states[s.labels.state] = s.value;
    // the mean latency of the creates that finished since the last sample
    const dc = prev ? cCount - prev.cCount : 0;
    const latency = dc > 0 ? ((cSum - prev.cSum) / dc) * 1000 : null;
    return { hits, misses, cSum, cCount, states, latency, live: sum(m, "aviary_sandboxes_live") };
  }, []);
  const older = past ? past.points : [];
  const since = older.length ? older[older.length - 1].t : 0;
  const hist = [...older, ...live.filter((h) => h.t > since)];
  const stateNames = [...new Set(hist.flatMap((h) => Object.keys(h.states)))].sort();
  const last = hist[hist.length - 1];
  return (
    <main id="main">
      <Heading>Charts</Heading>
      <p data-testid="charts-history">{past
        ? `The server's own history: ${past.points.length} samples, one every ${(past.interval / 1000).toFixed(0)} s (the last hour at most); then`
        : "Loading the server's history; meanwhile"} sampled from its <code>/metrics</code> every 2 seconds while this page is open.</p>
      <ErrorNote error={pastError || error} />
      {last ? (
        <p data-testid="charts-now">Now: {last.live} sandboxes with compute; {last.cCount} creates served
          {last.cCount ? `, mean ${((last.cSum / last.cCount) * 1000).toFixed(0)} ms` : ""}; pool hit rate {hitRate(last.hits, last.misses) === null ? "—" : `${(hitRate(last.hits, last.misses) * 100).toFixed(0)}%`}.</p>
      ) : null}
      <div class="charts">
        <LineChart title="Sandboxes by state" testid="chart-states"
          series={stateNames.map((st) => ({ name: st, points: hist.map((h) => [h.t, h.states[st] ?? 0]) }))} />
        <LineChart title="Create latency (mean per interval)" unit="ms" testid="chart-create-latency"
          series={[{ name: "POST /v1/sandboxes", points: hist.filter((h) => h.latency !== null).map((h) => [h.t, h.latency]) }]} />
        <LineChart title="Pool hit rate since start" unit="%" max={1} testid="chart-hit-rate"
          series={[{ name: "all pools", points: hist.filter((h) => h.hits + h.misses > 0).map((h) => [h.t, hitRate(h.hits, h.misses)]) }]} />
      </div>
    </main>
  );
}

/** Tenants (from their keys and sandboxes) and API keys: create, revoke. */
export function KeysPage() {
  const [keys, error, reload] = usePoll(() => api("GET", "/v1/keys"), [], { ms: 5000 });
  const [sbx] = usePoll(() => api("GET", "/v1/sandboxes?all_tenants=true"), [], { ms: 5000 });
  const [tenant, setTenant] = useState("");
  const [admin, setAdmin] = useState(false);
  const [issued, setIssued] = useState(null);
  const [actError, setActError] = useState(null);
  const create = async (e) => {
    e.preventDefault();
    setActError(null);
    try {
      setIssued(await api("POST", "/v1/keys", { tenant: tenant.trim(), admin }));
      reload();
    } catch (err) {
      setActError(err);
    }
  };
  const revoke = async (id) => {
    setActError(null);
    try {
      await api("DELETE", `/v1/keys/${encodeURIComponent(id)}`);
      reload();
    } catch (err) {
      setActError(err);
    }
  };
  const tenants = new Map();
  const t = (name) => { if (!tenants.has(name)) tenants.set(name, { keys: 0, sandboxes: 0, cpu: 0, memory: 0 }); return tenants.get(name); };
  for (const k of keys?.keys || []) if (!k.revoked_at) t(k.tenant).keys += 1;
  for (const s of sbx?.sandboxes || []) {
    const e = t(s.tenant);
    e.sandboxes += 1;
    e.cpu += s.resources?.cpu || 0;
    e.memory += s.resources?.memory_mb || 0;
  }
  return (
    <main id="main">
      <Heading>Tenants and keys</Heading>
      <ErrorNote error={error} />
      <h2>Tenants</h2>
      <div class="table-wrap">
        <table data-testid="tenant-table">
          <caption class="sr-only">Tenants with live keys or sandboxes</caption>
          <thead><tr><th scope="col">Tenant</th><th scope="col">Live keys</th><th scope="col">Sandboxes</th><th scope="col">CPU</th><th scope="col">Memory</th></tr></thead>
          <tbody>
            {[...tenants.entries()].sort().map(([name, v]) => (
              <tr key={name} data-tenant={name}>
                <td data-label="Tenant">{name}</td><td data-label="Live keys">{v.keys}</td><td data-label="Sandboxes">{v.sandboxes}</td>
                <td data-label="CPU">{v.cpu}</td><td data-label="Memory">{v.memory} MiB</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      <h2>New key</h2>
      <form onSubmit={create} class="narrow">
        <label for="k-tenant">Tenant</label>
        <input id="k-tenant" value={tenant} required onInput={(e) => setTenant(e.currentTarget.value)} />
        <div class="check">
          <input id="k-admin" type="checkbox" checked={admin} onChange={(e) => setAdmin(e.currentTarget.checked)} />
          <label for="k-admin">Admin key</label>
        </div>
        <button type="submit">Create key</button>
      </form>
      <ErrorNote error={actError} testid="keys-error" />
      {issued ? (
        <div role="status" class="issued" data-testid="issued-key">
          <p>Key <code>{issued.id}</code> for tenant {issued.tenant}. Its secret is shown this once:</p>
          <pre>{issued.key}</pre>
        </div>
      ) : null}
      <h2>Keys</h2>
      {keys ? (
        <div class="table-wrap">
          <table data-testid="key-table">
            <caption class="sr-only">API keys</caption>
            <thead><tr><th scope="col">Id</th><th scope="col">Tenant</th><th scope="col">Admin</th><th scope="col">Created</th><th scope="col">Revoked</th><th scope="col"><span class="sr-only">Actions</span></th></tr></thead>
            <tbody>
              {keys.keys.map((k) => (
                <tr key={k.id} data-key={k.id}>
                  <td data-label="Id"><code>{k.id}</code></td><td data-label="Tenant">{k.tenant}</td>
                  <td data-label="Admin">{k.admin ? "yes" : "no"}</td>
                  <td data-label="Created">{new Date(k.created_at).toLocaleString()}</td>
                  <td data-label="Revoked">{k.revoked_at ? new Date(k.revoked_at).toLocaleString() : "—"}</td>
                  <td data-label="Actions">{k.revoked_at ? null : <button type="button" class="danger" onClick={() => revoke(k.id)} aria-label={`Revoke key ${k.id}`}>Revoke</button>}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      ) : null}
    </main>
  );
}
