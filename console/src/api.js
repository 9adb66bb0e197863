// The console's only door to the server: the v1 API, with the API key the
// user logged in with (sessionStorage: gone when the tab closes; never put in
// a URL). The page adds no privilege: everything it shows is what the API
// answers for this key.

const KEY = "aviary.apiKey";

export const session = {
  admin: () => sessionStorage.getItem("aviary.admin") === "1",
  setAdmin: (yes) => sessionStorage.setItem("aviary.admin", yes ? "1" : "0"),
  key: () => sessionStorage.getItem(KEY),
  set: (k) => sessionStorage.setItem(KEY, k),
  // logging out forgets everything this tab kept (the key, create decisions)
  clear: () => sessionStorage.clear(),
};

/** An API refusal: HTTP status, the stable error code and the server's message. */
export class ApiError extends Error {
  constructor(status, code, message, requestId) {
    super(message);
    this.status = status;
    this.code = code;
    this.requestId = requestId;
  }
}

function headers(extra = {}, key = session.key()) {
  const h = { Accept: "application/json", ...extra };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function failure(res) {
  let code = `http_${res.status}`;
  let message = res.statusText || "request failed";
  let requestId = res.headers.get("x-request-id");
  try {
    const body = await res.json();
    if (body && body.error) {
      code = body.error.code || code;
      message = body.error.message || message;
      requestId = body.error.request_id || requestId;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(res.status, code, message, requestId);
}

/** `method path` with an optional JSON body; the parsed answer or an ApiError. */
export async function api(method, path, body, { key, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }, key ?? session.key()), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const res = await fetch(path, init);
  if (!res.ok) throw await failure(res);
  if (res.status === 204) return null;
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

/**
 * Reads a Server-Sent Events stream with fetch() (EventSource cannot send
 * the Authorization header) and calls `onEvent(type, data)` for every
 * complete event. Resolves when the stream ends; rejects on an HTTP error.
 */
export async function readEventStream(path, { signal, onOpen, onEvent }) {
  const res = await fetch(path, { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!res.ok) throw await failure(res);
  if (onOpen) onOpen();
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let type = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") type = val;
        else if (field === "data") data.push(val);
      }
      if (data.length) onEvent(type, data.join("\n"));
    }
  }
}

/** `k=v` lines (or comma-separated) into a labels object; throws on a malformed entry. */
export function parseLabels(text) {
  const out = {};
  for (const raw of text.split(/[\n,]/)) {
    const item = raw.trim();
    if (!item) continue;
    const eq = item.indexOf("=");
    if (eq <= 0) throw new Error(`label "${item}" is not key=value`);
    out[item.slice(0, eq).trim()] = item.slice(eq + 1).trim();
  }
  return out;
}

/** The list filter's `metadata` parameter: `k=v&k2=v2`, each part form-encoded. */
export function metadataQuery(labels) {
  return Object.entries(labels)
    .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(v)}`)
    .join("&");
}

/** `GET path` as bytes (a file's content); an ApiError on refusal. */
export async function apiBytes(path, { signal } = {}) {
  const res = await fetch(path, { headers: headers({ Accept: "application/octet-stream" }), signal });
  if (!res.ok) throw await failure(res);
  return res.blob();
}

/** `PUT path` with raw bytes (an upload); the parsed answer or an ApiError. */
export async function apiPutBytes(path, body, { token } = {}) {
  const extra = { "Content-Type": "application/octet-stream" };
  if (token) extra["x-aviary-lease-token"] = token;
  const res = await fetch(path, { method: "PUT", headers: headers(extra), body });
  if (!res.ok) throw await failure(res);
  return res.json();
}

/** `GET path` as text (the Prometheus metrics). */
export async function apiText(path, { signal } = {}) {
  const res = await fetch(path, { headers: headers({ Accept: "text/plain" }), signal });
  if (!res.ok) throw await failure(res);
  return res.text();
}

/**
 * A terminal WebSocket into a sandbox. Browsers cannot set headers on a
 * WebSocket: the key travels as the subprotocol `aviary.bearer.<key>` beside
 * `aviary.tty.v1` (the server echoes only the latter), never in the URL;
 * a lease token as `aviary.lease.<token>`.
 */
export function ttySocket(id, leaseToken) {
  const url = new URL(`/v1/sandboxes/${encodeURIComponent(id)}/exec/tty`, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const protocols = ["aviary.tty.v1", `aviary.bearer.${session.key()}`];
  // a leased sandbox: the token the same way (`aviary.lease.FENCE.SECRET`)
  if (leaseToken) protocols.push(`aviary.lease.${leaseToken}`);
  const ws = new WebSocket(url, protocols);
  ws.binaryType = "arraybuffer";
  return ws;
}

/** Whether this key is an admin key (the admin-only key list answers it). */
export async function probeAdmin() {
  try {
    await api("GET", "/v1/keys");
    return true;
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) return false;
    throw err;
  }
}

/**
 * Prometheus / OpenMetrics text into samples: `[{name, labels, value}]`.
 * Only what the console charts needs: no exemplars, no timestamps kept.
 */
export function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) {
      for (const lm of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
        labels[lm[1]] = lm[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      }
    }
    const value = Number(m[4]);
    if (!Number.isNaN(value)) out.push({ name: m[1], labels, value });
  }
  return out;
}
