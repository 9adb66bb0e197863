// The console's browser flow, run by crates/aviary-server/tests/console.rs
// against a live server: real Chromium (Debian's) driven by puppeteer-core.
// Prints what it observed as one JSON object on its last line; the Rust
// test asserts on it and cross-checks the API.
//
// env: AVIARY_URL, TEAM_KEY (tenant allowed only network "none"),
//      RIVAL_KEY (another tenant), ADMIN_KEY (an admin key),
//      RUN (a unique label value),
//      CHROMIUM (browser binary), PUPPETEER (puppeteer-core's ESM entry),
//      SHOTS (directory for the screenshots)
const { AVIARY_URL: base, TEAM_KEY: teamKey, RIVAL_KEY: rivalKey, ADMIN_KEY: adminKey, RUN: run, CHROMIUM, PUPPETEER, SHOTS } = process.env;
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const { default: puppeteer } = await import(PUPPETEER);

const WAIT = { timeout: 60_000 };
const out = { requests_with_key_in_url: [], api_requests: 0, api_requests_without_auth: [], page_errors: [], console_errors: [] };
mkdirSync(SHOTS, { recursive: true });

async function apiCall(method, path, body, key = teamKey) {
  const res = await fetch(base + path, {
    method,
    headers: { Authorization: `Bearer ${key}`, ...(body ? { "Content-Type": "application/json" } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

const browser = await puppeteer.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"],
});
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 800 });
  page.on("pageerror", (e) => out.page_errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") out.console_errors.push(m.text()); });
  page.on("request", (r) => {
    const url = r.url();
    if (url.includes(teamKey) || url.includes(rivalKey) || url.includes(adminKey)) out.requests_with_key_in_url.push(url);
    if (new URL(url).pathname.startsWith("/v1/")) {
      out.api_requests += 1;
      if (!(r.headers().authorization || "").startsWith("Bearer ")) out.api_requests_without_auth.push(url);
    }
  });
  const text = (sel) => page.$eval(sel, (el) => el.textContent);
  const login = async (key) => {
    await page.waitForSelector("#api-key", WAIT);
    await page.$eval("#api-key", (el) => { el.value = ""; });
    await page.type("#api-key", key);
    await page.keyboard.press("Enter");
  };
  const logout = async () => {
    await page.click("nav button.link");
    await page.waitForSelector("#api-key", WAIT);
  };

  // login: a wrong key is refused with the API's reason, the right one lets in
  const resp = await page.goto(base + "/", { waitUntil: "networkidle0" });
  out.index_csp = resp.headers()["content-security-policy"];
  await page.waitForSelector("#api-key", WAIT);
  out.login_label = await page.$eval("label[for=api-key]", (el) => el.textContent);
  await page.screenshot({ path: join(SHOTS, "login.png") });
  await login("not-a-key");
  await page.waitForSelector("[data-testid=error]", WAIT);
  out.bad_login_error = await text("[data-testid=error]");
  out.key_stored_after_bad_login = await page.evaluate(() => sessionStorage.getItem("aviary.apiKey"));
  await login(teamKey);
  await page.waitForSelector("[data-testid=sandbox-table]", WAIT);
  out.key_in_session_storage = (await page.evaluate(() => sessionStorage.getItem("aviary.apiKey"))) === teamKey;

  // keyboard: Tab from the top reaches "New sandbox", Enter opens the form
  // (each page focuses its heading, so Tab goes on from the page's content)
  out.focused_after_login = await page.evaluate(() => document.activeElement.tagName + ":" + document.activeElement.textContent);
  out.tab_order = [];
  for (let i = 0; i < 15; i++) {
    await page.keyboard.press("Tab");
    const label = await page.evaluate(() => {
      const el = document.activeElement;
      return el === document.body ? "(body)" : el.id || el.textContent.trim();
    });
    out.tab_order.push(label);
    if (label === "New sandbox") break;
  }
  await page.keyboard.press("Enter");
  await page.waitForSelector("#c-class", WAIT);
  out.form_labels = await page.$$eval("form input, form select, form textarea", (els) =>
    els.map((el) => (el.labels && el.labels.length ? el.labels[0].textContent : null)));

  // a network profile the tenant may not use: the policy's reason, nothing created
  await page.waitForFunction(() => document.querySelectorAll("#c-template option").length > 1, WAIT);
  out.templates_offered = await page.$$eval("#c-template option", (os) => os.map((o) => o.value).filter(Boolean));
  await page.type("#c-network", "open");
  // a label is data, never markup (values are the caller's, shown to others)
  await page.type("#c-labels", `suite=console\nrun=${run}\nnote=<img src=x onerror="window.__pwned=1">`);
  await page.click("form button[type=submit]");
  await page.waitForSelector("[data-testid=error]", WAIT);
  out.denial = await text("[data-testid=error]");
  out.denial_role = await page.$eval("[data-testid=error]", (el) => el.getAttribute("role"));
  await page.screenshot({ path: join(SHOTS, "create-denied.png"), fullPage: true });

  // the same form without the network: created, the page opens it
  await page.$eval("#c-network", (el) => { el.value = ""; el.dispatchEvent(new Event("input", { bubbles: true })); });
  await page.click("form button[type=submit]");
  await page.waitForFunction(() => /^#\/sandboxes\/[^/]+$/.test(location.hash), WAIT);
  const id = decodeURIComponent(await page.evaluate(() => location.hash.split("/")[2]));
  out.created_id = id;

  // one sandbox: its fields, and a new event arriving live
  await page.waitForSelector("[data-testid=fields]", WAIT);
  await page.waitForFunction(() => document.querySelector("[data-testid=stream-status]")?.textContent === "live", WAIT);
  out.fields_state = await text("[data-field=State]");
  out.fields_tenant = await text("[data-field=Tenant]");
  out.decision = await page.$$eval("[data-decision]", (dds) => Object.fromEntries(dds.map((d) => [d.dataset.decision, d.textContent])));
  out.label_texts = await page.$$eval("[data-testid=fields] .labels code", (cs) => cs.map((c) => c.textContent));
  out.injected_images = await page.$$eval("[data-testid=fields] img", (is) => is.length);
  out.pwned = await page.evaluate(() => window.__pwned === 1);

  // live usage: the runtime's counters beside the limits, re-read every 2 s
  // (a second read gives a CPU percentage)
  await page.waitForFunction(() => Number(document.querySelector("[data-testid=usage] [data-usage=memory]")?.dataset.value) > 0, WAIT);
  await page.waitForFunction(() => /% of one core/.test(document.querySelector("[data-testid=usage] [data-usage=cpu] .usage-text")?.textContent || ""), WAIT);
  out.usage = await page.$eval("[data-testid=usage]", (dl) => Object.fromEntries([...dl.querySelectorAll("[data-usage]")].map((r) => {
    const m = r.querySelector("meter");
    return [r.dataset.usage, {
      value: r.dataset.value,
      text: r.querySelector(".usage-text").textContent,
      meter: m ? { max: Number(m.max), value: Number(m.value), label: document.getElementById(m.getAttribute("aria-labelledby"))?.textContent, valuetext: m.getAttribute("aria-valuetext") } : null,
    }];
  })));

  // the terminal: a shell in the sandbox over the WebSocket; what it prints
  // is drawn by xterm.js
  await page.click("[data-testid=term-open]");
  await page.waitForFunction(() => document.querySelector("[data-testid=term-status]")?.textContent === "open", WAIT);
  out.term_focus = await page.evaluate(() => document.activeElement.getAttribute("aria-label"));
  await page.keyboard.type("echo term-$((6*7))\n");
  await page.waitForFunction(() => document.querySelector("[data-testid=terminal] .xterm-rows")?.textContent.includes("term-42"), WAIT);
  out.term_rows = await page.$eval("[data-testid=terminal] .xterm-rows", (el) => [...el.children].map((r) => r.textContent.trimEnd()).filter(Boolean));
  // F6 hands focus back to the page (the shell keeps Tab)
  await page.keyboard.press("F6");
  out.term_f6_focus = await page.evaluate(() => document.activeElement.textContent);
  await page.focus("[data-testid=terminal] .xterm-helper-textarea");
  await page.keyboard.type("exit 3\n");
  await page.waitForSelector("[data-testid=term-exit]", WAIT);
  out.term_exit = await text("[data-testid=term-exit]");

  // files: upload bytes from the page, see them listed, download them back
  const work = mkdtempSync(join(tmpdir(), "aviary-console-"));
  const payload = Buffer.concat([randomBytes(200_000), Buffer.from([0, 255, 10, 13, 0])]);
  const upPath = join(work, "upload.bin");
  writeFileSync(upPath, payload);
  out.upload_sha256 = createHash("sha256").update(payload).digest("hex");
  out.upload_size = payload.length;
  await page.waitForSelector("[data-testid=file-table]", WAIT);
  const fileInput = await page.$("#fb-upload");
  await fileInput.uploadFile(upPath);
  await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Upload").click());
  await page.waitForSelector('[data-testid=file-table] tr[data-file="upload.bin"]', WAIT);
  out.upload_note = await text("[data-testid=files-note]");
  out.listed_size = await page.$eval('tr[data-file="upload.bin"] td[data-label=Size]', (td) => td.textContent);
  const viaApi = Buffer.from(await (await fetch(`${base}/v1/sandboxes/${id}/files?path=/workspace/upload.bin`, { headers: { Authorization: `Bearer ${teamKey}` } })).arrayBuffer());
  out.api_bytes_equal = viaApi.equals(payload);
  const dl = join(work, "downloads");
  mkdirSync(dl);
  const cdp = await page.createCDPSession();
  await cdp.send("Browser.setDownloadBehavior", { behavior: "allow", downloadPath: dl });
  await page.click('tr[data-file="upload.bin"] button');
  await page.waitForSelector("[data-testid=files-note]", WAIT);
  const target = join(dl, "upload.bin");
  for (let i = 0; i < 600 && !(existsSync(target) && readFileSync(target).length === payload.length && !readdirSync(dl).some((f) => f.endsWith(".crdownload"))); i++) {
    await new Promise((r) => setTimeout(r, 100));
  }
  out.download_equal = existsSync(target) && readFileSync(target).equals(payload);
  out.download_note = await text("[data-testid=files-note]");
  rmSync(work, { recursive: true, force: true });
  await page.screenshot({ path: join(SHOTS, "sandbox-terminal-files.png"), fullPage: true });

  const before = await page.$$eval("[data-event-id]", (els) => els.map((e) => Number(e.dataset.eventId)));
  out.events_before = before;
  const maxBefore = Math.max(0, ...before);
  const exec = await apiCall("POST", `/v1/sandboxes/${id}/exec`, { shell: "echo from-the-api" });
  out.exec_stdout = exec.stdout;
  const lease = await apiCall("POST", `/v1/sandboxes/${id}/lease`, { owner: "console-flow", ttl_s: 120 });
  await page.waitForFunction((max) => [...document.querySelectorAll("[data-event-type=lease_acquired]")].some((e) => Number(e.dataset.eventId) > max), WAIT, maxBefore);
  out.live_events = await page.$$eval("[data-event-id]", (els, max) =>
    els.filter((e) => Number(e.dataset.eventId) > max).map((e) => ({ id: Number(e.dataset.eventId), type: e.dataset.eventType })), maxBefore);
  // each event's full record opens from its "details" (keyboard: a <summary>)
  const leaseEvent = out.live_events.find((e) => e.type === "lease_acquired");
  if (leaseEvent) {
    await page.focus(`[data-event-id="${leaseEvent.id}"] summary`);
    await page.keyboard.press("Enter");
    out.lease_event_details = JSON.parse(await page.$eval(`[data-event-id="${leaseEvent.id}"] details[open] pre`, (e) => e.textContent));
  }
  // the page re-reads the sandbox: the lease holder shows
  await page.waitForFunction(() => document.querySelector("[data-field='Lease holder']")?.textContent === "console-flow", WAIT);
  out.page_lease_holder = await text("[data-field='Lease holder']");
  // leased: a terminal without the holder's token is refused before it
  // starts; with the token (offered as a subprotocol) it works
  await page.click("[data-testid=term-open]");
  await page.waitForSelector("[data-testid=term-error]", WAIT);
  out.term_leased_without_token = await text("[data-testid=term-error]");
  out.lease_token_label = await page.$eval("label[for=lease-token]", (el) => el.textContent);
  await page.type("#lease-token", lease.token);
  await page.click("[data-testid=term-open]");
  await page.waitForFunction(() => document.querySelector("[data-testid=term-status]")?.textContent === "open", WAIT);
  await page.keyboard.type("echo leased-$((40+2))\n");
  await page.waitForFunction(() => document.querySelector("[data-testid=terminal] .xterm-rows")?.textContent.includes("leased-42"), WAIT);
  out.term_leased_rows = await page.$eval("[data-testid=terminal] .xterm-rows", (el) => [...el.children].map((r) => r.textContent.trimEnd()).filter(Boolean));
  await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Close terminal").click());
  await page.screenshot({ path: join(SHOTS, "sandbox.png"), fullPage: true });

  // the list: the sandbox with its lease holder and labels; label filters
  await page.click("nav a[href='#/sandboxes']");
  await page.waitForSelector(`tr[data-sandbox="${id}"]`, WAIT);
  // live refresh: a sandbox made and destroyed through the API comes and goes
  // while the list is open
  const other = await apiCall("POST", "/v1/sandboxes", { metadata: { suite: "console-api" } });
  out.api_created_id = other.id;
  await page.waitForSelector(`tr[data-sandbox="${other.id}"]`, WAIT);
  await apiCall("DELETE", `/v1/sandboxes/${other.id}`);
  await page.waitForFunction((oid) => !document.querySelector(`tr[data-sandbox="${oid}"]`), WAIT, other.id);
  out.api_sandbox_left_list = true;
  out.list_row = await page.$eval(`tr[data-sandbox="${id}"]`, (tr) =>
    Object.fromEntries([...tr.querySelectorAll("td")].map((td) => [td.dataset.label, td.textContent])));
  // the unfiltered list already shows exactly this sandbox: first a filter
  // that matches nothing (seen applied: the list is empty), then the real
  // one, so the rows read are the filter's and not the list's before it
  await page.type("#f-labels", `run=${run}x`);
  await page.waitForSelector("[data-testid=empty]", WAIT);
  await page.keyboard.press("Backspace");
  await page.waitForFunction(() => { const r = document.querySelectorAll("tr[data-sandbox]"); return r.length === 1; }, WAIT);
  out.filtered_ids = await page.$$eval("tr[data-sandbox]", (rs) => rs.map((r) => r.dataset.sandbox));
  await page.screenshot({ path: join(SHOTS, "sandboxes.png"), fullPage: true });
  await page.type("#f-labels", "-nomatch");
  await page.waitForSelector("[data-testid=empty]", WAIT);
  out.nomatch_rows = await page.$$eval("tr[data-sandbox]", (rs) => rs.length);
  await page.$eval("#f-labels", (el) => { el.value = ""; el.dispatchEvent(new Event("input", { bubbles: true })); });
  await page.waitForSelector(`tr[data-sandbox="${id}"]`, WAIT);
  await page.select("#f-state", "Terminated");
  await page.waitForFunction((id) => !document.querySelector(`tr[data-sandbox="${id}"]`) && document.querySelector("[data-testid=sandbox-table]"), WAIT, id);
  out.in_terminated_filter = await page.$$eval(`tr[data-sandbox="${id}"]`, (rs) => rs.length);
  await page.select("#f-state", "");
  await page.waitForSelector(`tr[data-sandbox="${id}"]`, WAIT);
  // narrow screen: one card per sandbox, nothing wider than the screen
  await page.setViewport({ width: 390, height: 844 });
  await page.waitForFunction(() => getComputedStyle(document.querySelector("thead")).position === "absolute", WAIT);
  out.narrow_overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  await page.screenshot({ path: join(SHOTS, "sandboxes-narrow.png"), fullPage: true });
  await page.setViewport({ width: 1280, height: 800 });

  // another tenant: the sandbox is neither listed nor readable
  await logout();
  out.storage_after_logout = await page.evaluate(() => sessionStorage.length);
  await login(rivalKey);
  await page.waitForSelector("[data-testid=sandbox-table]", WAIT);
  out.rival_ids = await page.$$eval("tr[data-sandbox]", (rs) => rs.map((r) => r.dataset.sandbox));
  await page.goto(`${base}/#/sandboxes/${encodeURIComponent(id)}`);
  await page.waitForSelector("[data-testid=error]", WAIT);
  out.rival_page_error = await text("[data-testid=error]");
  out.rival_sees_fields = (await page.$$("[data-testid=fields]")).length;
  await page.screenshot({ path: join(SHOTS, "other-tenant.png"), fullPage: true });
  await logout();

  // destroy from the page (the lease released first through the API)
  await apiCall("DELETE", `/v1/sandboxes/${id}/lease`, { token: lease.token });
  await login(teamKey);
  await page.waitForSelector(`tr[data-sandbox="${id}"] a`, WAIT);
  await page.click(`tr[data-sandbox="${id}"] a`);
  await page.waitForSelector("[data-testid=fields]", WAIT);
  await page.waitForFunction(() => [...document.querySelectorAll("button")].some((b) => b.textContent === "Destroy…"), WAIT);
  await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Destroy…").click());
  await page.waitForFunction(() => [...document.querySelectorAll("button")].some((b) => b.textContent === "Yes, destroy"), WAIT);
  await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Yes, destroy").click());
  await page.waitForSelector("[data-testid=note]", WAIT);
  await page.waitForFunction(() => document.querySelector("[data-field=State]")?.textContent.startsWith("Terminated"), WAIT);
  out.destroyed_state = await text("[data-field=State]");
  out.destroy_note = await text("[data-testid=note]");

  // the tenant's audit page: its policy denial with the reason
  await page.goto(`${base}/#/audit`);
  await page.waitForSelector("[data-testid=audit-table] tr[data-denial]", WAIT);
  out.audit_rows = await page.$$eval("[data-testid=audit-table] tr[data-denial]", (rs) => rs.map((r) => r.textContent));
  await page.screenshot({ path: join(SHOTS, "audit.png"), fullPage: true });

  // a create with a task context: its timeline lists the planner's trace
  const planned = await apiCall("POST", "/v1/sandboxes", { intent: { task: "print hello world in python", languages: ["python"] } });
  out.planned_sandbox = planned.id;
  await page.goto(`${base}/#/sandboxes/${encodeURIComponent(planned.id)}`);
  await page.waitForSelector("[data-testid=planned-trace] li", WAIT);
  out.planned_trace = await page.$$eval("[data-testid=planned-trace] li", (ls) => ls.map((l) => l.textContent));
  out.planned_decisions = await text("[data-testid=decision-events]");
  await apiCall("DELETE", `/v1/sandboxes/${planned.id}`);
  // a tenant is offered no admin page, and has no "all tenants" switch
  out.tenant_nav = await page.$$eval("header nav a", (as) => as.map((a) => a.textContent));
  out.tenant_all_switch = await page.$$eval("#all-tenants, #f-all-tenants", (els) => els.length);
  await logout();

  // the admin: every tenant's sandboxes in one list (a rival sandbox made
  // through the API beside the team's)
  const rivalSbx = await apiCall("POST", "/v1/sandboxes", { metadata: { suite: "console-rival" } }, rivalKey);
  const teamSbx = await apiCall("POST", "/v1/sandboxes", { metadata: { suite: "console-team" } }, teamKey);
  out.rival_sandbox = rivalSbx.id;
  out.team_sandbox = teamSbx.id;
  await login(adminKey);
  await page.waitForSelector("[data-testid=sandbox-table]", WAIT);
  out.admin_own_rows = await page.$$eval("tr[data-sandbox]", (rs) => rs.map((r) => r.dataset.sandbox));
  await page.click("#f-all-tenants");
  await page.waitForFunction((a, b) => document.querySelector(`tr[data-sandbox="${a}"]`) && document.querySelector(`tr[data-sandbox="${b}"]`), WAIT, rivalSbx.id, teamSbx.id);
  out.admin_all_rows = await page.$$eval("tr[data-sandbox]", (rs) => rs.map((r) => ({ id: r.dataset.sandbox, tenant: r.querySelector("td[data-label=Tenant]")?.textContent })));
  await page.screenshot({ path: join(SHOTS, "admin-all-tenants.png"), fullPage: true });
  // another tenant's sandbox opens read only for the admin: fields and the
  // live timeline, no terminal, no files, no destroy
  await page.click(`tr[data-sandbox="${rivalSbx.id}"] a`);
  await page.waitForSelector("[data-testid=foreign]", WAIT);
  await page.waitForFunction(() => document.querySelector("[data-testid=stream-status]")?.textContent === "live" && document.querySelectorAll("[data-event-id]").length > 0, WAIT);
  out.admin_foreign = {
    tenant: await text("[data-field=Tenant]"),
    events: await page.$$eval("[data-event-id]", (els) => els.map((e) => e.dataset.eventType)),
    terminals: (await page.$$("[data-testid=term-open]")).length,
    file_tables: (await page.$$("[data-testid=file-table]")).length,
    destroy_buttons: await page.$$eval("button", (bs) => bs.filter((b) => b.textContent.startsWith("Destroy")).length),
  };
  // its usage reads through the admin's cross-tenant query
  await page.waitForFunction(() => Number(document.querySelector("[data-testid=usage] [data-usage=memory]")?.dataset.value) > 0, WAIT);
  out.admin_foreign.usage_memory = Number(await page.$eval("[data-testid=usage] [data-usage=memory]", (r) => r.dataset.value));
  await page.screenshot({ path: join(SHOTS, "admin-foreign-sandbox.png"), fullPage: true });
  await page.click("nav a[href='#/sandboxes']");
  await page.waitForSelector("[data-testid=sandbox-table]", WAIT);

  // keyboard: from each page's heading (where each page puts focus),
  // Shift+Tab walks back into the navigation and reaches the next page's
  // link, Enter opens it; every page's inputs have labels
  const tour = ["Planner", "Events", "Audit", "Pools", "Nodes", "Charts", "Tenants and keys", "New sandbox", "Sandboxes"];
  out.admin_nav = await page.$$eval("header nav a", (as) => as.map((a) => a.textContent));
  out.keyboard_pages = [];
  for (const name of tour) {
    let reached = false;
    await page.focus("main h1");
    for (let i = 0; i < 40 && !reached; i++) {
      await page.keyboard.down("Shift");
      await page.keyboard.press("Tab");
      await page.keyboard.up("Shift");
      reached = await page.evaluate((n) => document.activeElement.tagName === "A" && document.activeElement.textContent === n && !!document.activeElement.closest("header nav"), name);
    }
    if (!reached) { out.keyboard_pages.push({ name, reached: false }); continue; }
    await page.keyboard.press("Enter");
    await page.waitForFunction((n) => document.activeElement.tagName === "H1" && document.querySelector("header nav a[aria-current=page]")?.textContent === n, WAIT, name);
    const unlabelled = await page.$$eval("main input, main select, main textarea", (els) =>
      els.filter((el) => !(el.labels && el.labels.length && el.labels[0].textContent.trim()) && !el.getAttribute("aria-label")).map((el) => el.id || el.outerHTML.slice(0, 80)));
    out.keyboard_pages.push({ name, reached: true, heading: await page.evaluate(() => document.activeElement.textContent), hash: await page.evaluate(() => location.hash), unlabelled });
    if (name === "Planner") {
      await page.type("#p-task", "pip install pandas and plot a csv");
      await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Plan").click());
      await page.waitForSelector("[data-testid=plan-trace] li", WAIT);
      out.plan_fields = await page.$$eval("[data-testid=plan] [data-field]", (dds) => Object.fromEntries(dds.map((d) => [d.dataset.field, d.textContent])));
      out.plan_steps = await page.$$eval("[data-testid=plan-trace] li", (ls) => ls.map((l) => l.textContent));
      await page.waitForFunction(() => document.querySelectorAll("[data-testid=planner-table] tbody tr").length > 0, WAIT);
    }
    if (name === "Events") {
      await page.click("#all-tenants");
      await page.waitForFunction((a) => [...document.querySelectorAll("[data-event-id]")].some((e) => e.textContent.includes(a)), WAIT, rivalSbx.id);
      out.events_tenants = await page.$$eval("[data-testid=events] li", (ls) => [...new Set(ls.map((l) => l.querySelector(".muted")?.textContent.trim().split(" ")[0]))]);
      await page.type("#e-type", "lease");
      await page.waitForFunction(() => [...document.querySelectorAll("[data-testid=events] li")].every((l) => l.dataset.eventType.includes("lease")), WAIT);
      out.events_filtered_types = await page.$$eval("[data-testid=events] li", (ls) => [...new Set(ls.map((l) => l.dataset.eventType))]);
    }
    if (name === "Nodes") {
      await page.waitForSelector("[data-node]", WAIT);
      out.nodes = await page.$$eval("[data-node]", (ns) => ns.map((n) => ({ id: n.dataset.node, health: n.querySelector("[data-testid=node-health]").textContent, meters: n.querySelectorAll("meter").length })));
    }
    if (name === "Pools") {
      await page.waitForSelector("[data-testid=pool-table]", WAIT);
      out.pool_rows = await page.$$eval("tr[data-pool]", (rs) => rs.map((r) => r.dataset.pool));
    }
    if (name === "Charts") {
      await page.waitForSelector("[data-testid=chart-states] polyline", WAIT);
      // a create while the page samples: its latency is charted
      const probe = await apiCall("POST", "/v1/sandboxes", { metadata: { suite: "console-chart" } }, teamKey);
      out.chart_probe_sandbox = probe.id;
      await apiCall("DELETE", `/v1/sandboxes/${probe.id}`, undefined, teamKey);
      await page.waitForSelector("[data-testid=chart-create-latency] :is(polyline, circle)", WAIT);
      out.chart_latency_legend = await page.$eval("[data-testid=chart-create-latency] [data-series]", (e) => e.textContent);
      out.charts = await page.$$eval("figure.chart", (fs) => fs.map((f) => f.dataset.testid));
      out.charts_now = await text("[data-testid=charts-now]");
      await page.waitForFunction(() => /history: \d+ samples/.test(document.querySelector("[data-testid=charts-history]")?.textContent || ""), WAIT);
      out.charts_history = await text("[data-testid=charts-history]");
    }
    if (name === "Tenants and keys") {
      await page.waitForSelector('[data-testid=tenant-table] tr[data-tenant="rival"]', WAIT);
      out.tenant_rows = await page.$$eval("[data-testid=tenant-table] tr[data-tenant]", (rs) => rs.map((r) => r.dataset.tenant));
    }
    const file = { "Tenants and keys": "keys", "New sandbox": "new", Sandboxes: "sandboxes-admin" }[name] || name.toLowerCase();
    if (name !== "New sandbox" && name !== "Sandboxes") await page.screenshot({ path: join(SHOTS, `${file}.png`), fullPage: true });
  }

  // a narrow screen (400 px): no page is wider than the screen
  await page.setViewport({ width: 400, height: 860 });
  out.narrow_overflow_by_page = {};
  for (const h of ["#/sandboxes", "#/new", "#/planner", "#/events", "#/audit", "#/pools", "#/nodes", "#/charts", "#/keys"]) {
    await page.evaluate((x) => { location.hash = x; }, h);
    await page.waitForFunction((x) => location.hash === x && document.activeElement.tagName === "H1", WAIT, h);
    await new Promise((r) => setTimeout(r, 300));
    out.narrow_overflow_by_page[h] = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  }
  await page.screenshot({ path: join(SHOTS, "keys-narrow.png"), fullPage: true });
  await page.setViewport({ width: 1280, height: 800 });
  await logout();

  // the team's own page of its second sandbox, narrow, with the terminal open
  await login(teamKey);
  await page.waitForSelector("[data-testid=sandbox-table]", WAIT);
  await page.setViewport({ width: 400, height: 860 });
  await page.goto(`${base}/#/sandboxes/${encodeURIComponent(teamSbx.id)}`);
  await page.waitForSelector("[data-testid=term-open]", WAIT);
  await page.click("[data-testid=term-open]");
  await page.waitForFunction(() => document.querySelector("[data-testid=term-status]")?.textContent === "open", WAIT);
  await page.keyboard.type("uname -s\n");
  await page.waitForFunction(() => document.querySelector("[data-testid=terminal] .xterm-rows")?.textContent.includes("Linux"), WAIT);
  out.narrow_sandbox_overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  await page.screenshot({ path: join(SHOTS, "sandbox-narrow.png"), fullPage: true });
  await page.setViewport({ width: 1280, height: 800 });

  // snapshots: two taken from the page make a chain (the second's parent is
  // the first); forking the second opens the fork, whose tree shows where it
  // came from
  const takeSnapshot = async (n) => {
    await page.$$eval("button", (bs) => bs.find((b) => b.textContent === "Take snapshot").click());
    await page.waitForFunction((k) => document.querySelectorAll("[data-testid=snapshot-tree] li[data-snapshot]").length === k, WAIT, n);
  };
  await takeSnapshot(1);
  await takeSnapshot(2);
  out.snapshot_tree = await page.$$eval("[data-testid=snapshot-tree] li[data-snapshot]", (ls) =>
    ls.map((l) => ({ id: l.dataset.snapshot, parent: l.parentElement.closest("li[data-snapshot]")?.dataset.snapshot ?? null })));
  const second = out.snapshot_tree.find((x) => x.parent);
  await page.click(`li[data-snapshot="${second.id}"] > button`);
  await page.waitForSelector("[data-testid=forked-from]", WAIT);
  const forkId = decodeURIComponent(await page.evaluate(() => location.hash.split("/")[2]));
  out.fork_id = forkId;
  out.forked_from = await text("[data-testid=forked-from]");
  out.fork_decision = await page.$$eval("[data-decision]", (dds) => Object.fromEntries(dds.map((d) => [d.dataset.decision, d.textContent])));
  await page.waitForSelector(`[data-testid=snapshot-tree] li[data-fork="${forkId}"]`, WAIT);
  out.fork_lineage = await page.$eval(`li[data-fork="${forkId}"]`, (li) => ({ under: li.closest("li[data-snapshot]").dataset.snapshot, text: li.textContent }));
  await page.screenshot({ path: join(SHOTS, "snapshots-fork.png"), fullPage: true });
  await logout();
  await apiCall("DELETE", `/v1/sandboxes/${forkId}`, undefined, teamKey);
  await apiCall("DELETE", `/v1/sandboxes/${teamSbx.id}`, undefined, teamKey);
  await apiCall("DELETE", `/v1/sandboxes/${rivalSbx.id}`, undefined, rivalKey);
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
