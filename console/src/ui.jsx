// Small pieces every page uses: headings that take focus, error notes,
// labels, ages, polling.
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "./api.js";

export const REFRESH_MS = 2000;

export const go = (hash) => {
  location.hash = hash;
};

export function age(iso, now) {
  const s = Math.max(0, Math.floor((now - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function bytes(n) {
  if (n == null) return "";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

export function Labels({ labels }) {
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

export function ErrorNote({ error, testid = "error" }) {
  if (!error) return null;
  const api = error instanceof ApiError;
  return (
    <div class="error" role="alert" data-testid={testid}>
      {api ? <strong class="code">{error.code}</strong> : null}
      {api ? ": " : ""}
      <span class="message">{error.message}</span>
      {api && error.requestId ? <span class="muted"> (request {error.requestId})</span> : null}
    </div>
  );
}

// Focuses a page's heading when the page changes, so keyboard and screen
// reader users land on the new content.
export function Heading({ children }) {
  const ref = useRef(null);
  useEffect(() => ref.current && ref.current.focus(), []);
  return <h1 tabIndex={-1} ref={ref}>{children}</h1>;
}

/** Calls `load` now and every `ms` while `live`; `[data, error, reload]`. */
export function usePoll(load, deps, { ms = REFRESH_MS, live = true } = {}) {
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const run = useCallback(async () => {
    try {
      setData(await load());
      setError(null);
    } catch (err) {
      setError(err);
    }
  }, deps);
  useEffect(() => {
    run();
    if (!live) return undefined;
    const t = setInterval(run, ms);
    return () => clearInterval(t);
  }, [run, live, ms]);
  return [data, error, run];
}

/** A `<dl>` of `[label, value]` pairs; each value carries `data-field`. */
export function Fields({ rows, testid }) {
  return (
    <dl class="fields" data-testid={testid}>
      {rows.map(([k, v]) => (
        <div key={k}><dt>{k}</dt><dd data-field={k}>{v === null || v === undefined ? "—" : typeof v === "object" ? v : String(v)}</dd></div>
      ))}
    </dl>
  );
}

/** One event's short summary: the transition and its scalar metadata. */
export function eventSummary(ev) {
  const parts = [];
  if (ev.old_state || ev.new_state) parts.push(`${ev.old_state || "∅"} → ${ev.new_state || "∅"}`);
  const m = ev.metadata || {};
  for (const k of ["reason", "message", "code", "action", "branch", "restore_branch", "score", "class", "recommended_class", "approved_class", "source", "confidence", "command", "exit_code", "owner", "host", "label"]) {
    if (m[k] !== undefined && m[k] !== null && typeof m[k] !== "object") parts.push(`${k}: ${m[k]}`);
  }
  if (Array.isArray(m.reasons) && m.reasons.length) parts.push(`reasons: ${m.reasons.join("; ")}`);
  return parts.join(" · ");
}

/** An event as a list item: time, type, summary, the full record on demand. */
export function EventItem({ ev, showSandbox = false }) {
  return (
    <li data-event-id={ev.id} data-event-type={ev.event_type} class={`ev ev-${ev.event_type.replace(/[^a-z_]/g, "-")}`}>
      <time datetime={ev.timestamp}>{new Date(ev.timestamp).toLocaleTimeString()}</time>
      <strong>{ev.event_type}</strong>
      {showSandbox ? <span class="muted"> {ev.tenant}{ev.sandbox_id ? <> · <a href={`#/sandboxes/${encodeURIComponent(ev.sandbox_id)}`}><code>{ev.sandbox_id}</code></a></> : null}</span> : null}
      <span class="summary">{eventSummary(ev)}</span>
      {ev.request_id ? <span class="muted"> request {ev.request_id}</span> : null}
      {ev.event_type === "planned" && Array.isArray(ev.metadata?.trace?.steps) ? (
        <ol class="trace" data-testid="planned-trace" aria-label="planner trace">
          {ev.metadata.trace.steps.map((s, i) => (
            <li key={i}><strong>{String(s.planner)}</strong> {String(s.outcome)}: {String(s.detail)}
              {typeof s.elapsed_ms === "number" ? <span class="muted"> ({s.elapsed_ms.toFixed(1)} ms)</span> : null}</li>
          ))}
        </ol>
      ) : null}
      {ev.metadata && Object.keys(ev.metadata).length ? (
        <details>
          <summary>details</summary>
          <pre>{JSON.stringify(ev.metadata, null, 2)}</pre>
        </details>
      ) : null}
    </li>
  );
}
