"""A normal session of an `opensandbox` SDK user against Aviary, async or
sync flavour (argv[1]). Reads OPEN_SANDBOX_DOMAIN / OPEN_SANDBOX_API_KEY
(plus OSB_OTHER_KEY, another tenant's key). Prints one JSON object of
observations on the last line of stdout; the Rust test asserts on it.
Every sandbox it creates is killed before it exits."""

import asyncio
import json
import os
import sys
import time
import traceback
from datetime import datetime, timedelta, timezone

import httpx
from opensandbox import Sandbox, SandboxManager
from opensandbox.config import ConnectionConfig, ConnectionConfigSync
from opensandbox.models.execd import ExecutionHandlers, RunCommandOpts
from opensandbox.models.filesystem import WriteEntry
from opensandbox.models.sandboxes import SandboxFilter
from opensandbox.sync import SandboxManagerSync, SandboxSync

DOMAIN = os.environ["OPEN_SANDBOX_DOMAIN"]
KEY = os.environ["OPEN_SANDBOX_API_KEY"]
OTHER_KEY = os.environ["OSB_OTHER_KEY"]
BIG = 100000

obs = {}


def step(name):
    def wrap(f):
        f.step = name
        return f
    return wrap


def iso(t):
    return t.isoformat() if t else None


def raw(method, path, key=KEY, **kw):
    """A request the SDK would not send (malformed bodies, other tenants)."""
    headers = kw.pop("headers", {})
    if key is not None:
        headers["OPEN-SANDBOX-API-KEY"] = key
    r = httpx.request(method, f"http://{DOMAIN}{path}", headers=headers, timeout=60, **kw)
    try:
        body = r.json()
    except Exception:
        body = r.text
    return r.status_code, body


def adversarial(sid, endpoint, headers):
    """Wrong tokens, other tenants, malformed bodies: clear 4xx, JSON bodies."""
    out = {}
    base = f"http://{endpoint}"
    out["execd_no_token"] = httpx.get(f"{base}/ping", timeout=30).status_code
    out["execd_wrong_token"] = httpx.get(
        f"{base}/ping", headers={k: "0" * 64 for k in headers}, timeout=30
    ).status_code
    r = httpx.post(f"{base}/command", json={"command": "true"},
                   headers={"OPEN-SANDBOX-API-KEY": KEY}, timeout=30)
    out["execd_api_key_instead_of_token"] = r.status_code
    out["other_tenant_get"] = raw("GET", f"/v1/sandboxes/{sid}", key=OTHER_KEY)
    out["other_tenant_delete"] = raw("DELETE", f"/v1/sandboxes/{sid}", key=OTHER_KEY)[0]
    out["other_tenant_endpoint"] = raw("GET", f"/v1/sandboxes/{sid}/endpoints/44772", key=OTHER_KEY)[0]
    out["no_key"] = raw("GET", "/v1/sandboxes", key=None)
    out["create_array_body"] = raw("POST", "/v1/sandboxes", content=b"[]",
                                   headers={"content-type": "application/json"})
    out["create_bad_json"] = raw("POST", "/v1/sandboxes", content=b"{not json",
                                 headers={"content-type": "application/json"})
    out["create_volumes"] = raw("POST", "/v1/sandboxes", json={"image": {"uri": "x"}, "volumes": [{"name": "v"}]})
    out["create_huge_cpu"] = raw("POST", "/v1/sandboxes", json={"timeout": 60, "resourceLimits": {"cpu": "512", "memory": "1Gi"}})
    out["create_bad_metadata"] = raw("POST", "/v1/sandboxes", json={"timeout": 60, "metadata": {"k" * 300: "v"}})
    out["list_bad_state"] = raw("GET", "/v1/sandboxes?state=running")
    out["renew_past"] = raw("POST", f"/v1/sandboxes/{sid}/renew-expiration",
                            json={"expiresAt": "2001-01-01T00:00:00+00:00"})
    out["command_bad_body"] = httpx.post(f"{base}/command", json={"command": ""}, headers=headers, timeout=30).status_code
    out["command_missing_cwd"] = httpx.post(
        f"{base}/command", json={"command": "true", "cwd": "/no/such/dir"}, headers=headers, timeout=30
    ).status_code
    bad_meta = (
        b"--B\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\r\n"
        b"{\"path\": \"relative/x\", \"mode\": 755}\r\n"
        b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\nx\r\n--B--\r\n"
    )
    out["upload_relative_path"] = httpx.post(
        f"{base}/files/upload", content=bad_meta,
        headers={**headers, "content-type": "multipart/form-data; boundary=B"}, timeout=30,
    ).status_code
    lone_file = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\nx\r\n--B--\r\n"
    out["upload_file_without_metadata"] = httpx.post(
        f"{base}/files/upload", content=lone_file,
        headers={**headers, "content-type": "multipart/form-data; boundary=B"}, timeout=30,
    ).status_code
    out["egress"] = httpx.get(f"http://{endpoint.rsplit('/execd', 1)[0]}/egress/policy",
                              headers=headers, timeout=30).status_code
    return out


async def run_async():
    cfg = ConnectionConfig(domain=DOMAIN, api_key=KEY, protocol="http",
                           request_timeout=timedelta(seconds=120))
    tag = f"t{int(time.time() * 1000)}"
    meta = {"agentscope.workspace.id": tag, "team": "osb async"}
    sbx = await Sandbox.create("default", timeout=timedelta(minutes=10), metadata=meta,
                               env={"OSB_DEFAULT": "from create", "GREETING": "overridden"},
                               connection_config=cfg, ready_timeout=timedelta(seconds=60))
    obs["id"] = sbx.id
    try:
        info = await sbx.get_info()
        obs["state"] = info.status.state
        obs["metadata"] = info.metadata
        obs["created_at"] = iso(info.created_at)
        obs["expires_at"] = iso(info.expires_at)

        seen = []

        async def on_stdout(msg):
            seen.append((msg.text, time.monotonic()))

        t0 = time.monotonic()
        ex = await sbx.commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.5; done",
            handlers=ExecutionHandlers(on_stdout=on_stdout),
        )
        obs["stream_texts"] = [t for t, _ in seen]
        obs["stream_offsets"] = [round(at - t0, 3) for _, at in seen]
        obs["stream_exit"] = ex.exit_code

        ex = await sbx.commands.run("echo out; echo err >&2")
        obs["split_stdout"] = "".join(m.text for m in ex.logs.stdout)
        obs["split_stderr"] = "".join(m.text for m in ex.logs.stderr)
        obs["exit3"] = (await sbx.commands.run("exit 3")).exit_code
        ex = await sbx.commands.run("pwd; echo $GREETING; echo $OSB_DEFAULT", opts=RunCommandOpts(
            working_directory="/tmp", envs={"GREETING": "hello env"}))
        obs["cwd_env"] = "".join(m.text for m in ex.logs.stdout)

        await sbx.files.write_files([
            WriteEntry(path="/tmp/osb/a.txt", data="x" * BIG, mode=755),
            WriteEntry(path="/tmp/osb/b.txt", data="hello file", mode=644),
        ])
        ex = await sbx.commands.run("wc -c < /tmp/osb/a.txt; stat -c %a /tmp/osb/a.txt /tmp/osb/b.txt")
        obs["files_seen"] = "".join(m.text for m in ex.logs.stdout).split()
        obs["read_back"] = await sbx.files.read_file("/tmp/osb/b.txt")
        obs["read_big_len"] = len(await sbx.files.read_bytes("/tmp/osb/a.txt"))

        mgr = await SandboxManager.create(cfg)
        try:
            page = await mgr.list_sandbox_infos(SandboxFilter(states=["Running"], metadata={"agentscope.workspace.id": tag}, page=1, page_size=50))
            obs["list_running_tagged"] = [s.id for s in page.sandbox_infos]
            page = await mgr.list_sandbox_infos(SandboxFilter(states=["Paused"], metadata={"agentscope.workspace.id": tag}))
            obs["list_paused_tagged"] = [s.id for s in page.sandbox_infos]
            page = await mgr.list_sandbox_infos(SandboxFilter(metadata={"agentscope.workspace.id": tag + "-other"}))
            obs["list_other_tag"] = [s.id for s in page.sandbox_infos]
            obs["pagination_total"] = page.pagination.total_items
        finally:
            await mgr.close()

        endpoint = await sbx.get_endpoint(44772)
        obs["endpoint"] = endpoint.endpoint
        obs["adversarial"] = adversarial(sbx.id, endpoint.endpoint, dict(endpoint.headers or {}))

        # a server inside the sandbox, reached through get_endpoint(port)
        await sbx.commands.run(
            "nohup python3 -m http.server 8123 --bind 127.0.0.1 --directory /etc >/dev/null 2>&1 &")
        app = await sbx.get_endpoint(8123)
        obs["app_endpoint"] = app.endpoint
        got = None
        for _ in range(100):
            r = httpx.get(f"http://{app.endpoint}/hostname", headers=dict(app.headers or {}), timeout=30)
            got = [r.status_code, r.text]
            if r.status_code != 502:
                break
            await asyncio.sleep(0.1)
        obs["app_get"] = got
        obs["app_hostname"] = "".join(
            m.text for m in (await sbx.commands.run("cat /etc/hostname")).logs.stdout)
        obs["app_no_token"] = httpx.get(f"http://{app.endpoint}/hostname", timeout=30).status_code

        await sbx.pause()
        states = []
        for _ in range(90):
            st = (await sbx.get_info()).status.state
            states.append(st)
            if st == "Paused":
                break
            await asyncio.sleep(0.5)
        obs["pause_states"] = states
        mgr = await SandboxManager.create(cfg)
        try:
            page = await mgr.list_sandbox_infos(SandboxFilter(states=["Paused"], metadata={"agentscope.workspace.id": tag}))
            obs["list_paused_after_pause"] = [s.id for s in page.sandbox_infos]
        finally:
            await mgr.close()
        resumed = await Sandbox.resume(sbx.id, connection_config=cfg, resume_timeout=timedelta(seconds=60))
        obs["resumed_state"] = (await resumed.get_info()).status.state
        ex = await resumed.commands.run("cat /tmp/osb/b.txt")
        obs["after_resume"] = "".join(m.text for m in ex.logs.stdout)

        renewed = await resumed.renew(timedelta(minutes=30))
        obs["renew_requested"] = iso(datetime.now(timezone.utc) + timedelta(minutes=30))
        info = await resumed.get_info()
        obs["expires_after_renew"] = iso(info.expires_at)
        obs["renew_answer"] = iso(renewed.expires_at)
        await resumed.close()
    finally:
        await sbx.kill()
        await sbx.close()
    obs["get_after_kill"] = raw("GET", f"/v1/sandboxes/{obs['id']}")


def run_sync():
    cfg = ConnectionConfigSync(domain=DOMAIN, api_key=KEY, protocol="http",
                               request_timeout=timedelta(seconds=120))
    tag = f"s{int(time.time() * 1000)}"
    sbx = SandboxSync.create("default", timeout=timedelta(minutes=5), metadata={"flavour": "sync", "tag": tag},
                             connection_config=cfg, ready_timeout=timedelta(seconds=60))
    obs["id"] = sbx.id
    try:
        info = sbx.get_info()
        obs["state"] = info.status.state
        obs["metadata"] = info.metadata
        obs["created_at"] = iso(info.created_at)
        obs["expires_at"] = iso(info.expires_at)
        seen = []
        t0 = time.monotonic()
        from opensandbox.models.execd_sync import ExecutionHandlersSync
        ex = sbx.commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.5; done",
            handlers=ExecutionHandlersSync(on_stdout=lambda m: seen.append((m.text, time.monotonic()))),
        )
        obs["stream_texts"] = [t for t, _ in seen]
        obs["stream_offsets"] = [round(at - t0, 3) for _, at in seen]
        obs["stream_exit"] = ex.exit_code
        ex = sbx.commands.run("echo out; echo err >&2")
        obs["split_stdout"] = "".join(m.text for m in ex.logs.stdout)
        obs["split_stderr"] = "".join(m.text for m in ex.logs.stderr)
        obs["exit3"] = sbx.commands.run("exit 3").exit_code
        sbx.files.write_files([
            WriteEntry(path="/tmp/osb/a.txt", data=b"y" * BIG, mode=755),
            WriteEntry(path="/tmp/osb/b.txt", data="hello file", mode=644),
        ])
        ex = sbx.commands.run("wc -c < /tmp/osb/a.txt; stat -c %a /tmp/osb/a.txt /tmp/osb/b.txt")
        obs["files_seen"] = "".join(m.text for m in ex.logs.stdout).split()
        obs["read_back"] = sbx.files.read_file("/tmp/osb/b.txt")
        mgr = SandboxManagerSync.create(cfg)
        try:
            page = mgr.list_sandbox_infos(SandboxFilter(states=["Running"], metadata={"tag": tag}))
            obs["list_running_tagged"] = [s.id for s in page.sandbox_infos]
        finally:
            mgr.close()
        sbx.renew(timedelta(minutes=30))
        obs["renew_requested"] = iso(datetime.now(timezone.utc) + timedelta(minutes=30))
        obs["expires_after_renew"] = iso(sbx.get_info().expires_at)
        sbx.pause()
        states = []
        for _ in range(90):
            st = sbx.get_info().status.state
            states.append(st)
            if st == "Paused":
                break
            time.sleep(0.5)
        obs["pause_states"] = states
        resumed = SandboxSync.resume(sbx.id, connection_config=cfg, resume_timeout=timedelta(seconds=60))
        obs["resumed_state"] = resumed.get_info().status.state
        obs["after_resume"] = "".join(m.text for m in resumed.commands.run("cat /tmp/osb/b.txt").logs.stdout)
        resumed.close()
    finally:
        sbx.kill()
        sbx.close()
    obs["get_after_kill"] = raw("GET", f"/v1/sandboxes/{obs['id']}")


def main():
    flavour = sys.argv[1]
    try:
        if flavour == "async":
            asyncio.run(run_async())
        else:
            run_sync()
    except BaseException as e:  # the report says what broke; the test fails on it
        obs["exception"] = "".join(traceback.format_exception(e))[-4000:]
    print(json.dumps(obs))


if __name__ == "__main__":
    main()
