"""AgentScope 2.0's OpenSandboxWorkspace against Aviary: initialize → exec
→ write/read → close (pause) → a second workspace with the same id
re-attaches (resume) and sees the files. Reads OPEN_SANDBOX_DOMAIN /
OPEN_SANDBOX_API_KEY; prints one JSON object of observations on the last
line of stdout. Kills the sandbox it made before it exits.

One step of AgentScope is replaced, loudly: the in-sandbox MCP gateway
bootstrap (`_setup_mcp_gateway`: apt-get, curl https://astral.sh, uv pip
install from PyPI, then a gateway process polled on :5600). It needs
outbound internet from the sandbox, which Aviary's default network profile
(`none`) does not give and this test machine does not have. Everything else
of initialize/close (metadata lookup, create or resume, workspace layout,
.mcp restore, skills migration shim, pause) runs unmodified."""

import asyncio
import json
import os
import time
import traceback

import httpx
from agentscope.workspace import OpenSandboxWorkspace

DOMAIN = os.environ["OPEN_SANDBOX_DOMAIN"]
KEY = os.environ["OPEN_SANDBOX_API_KEY"]

obs = {"skipped_steps": ["_setup_mcp_gateway (needs outbound internet in the sandbox)"]}


class OfflineGatewayWorkspace(OpenSandboxWorkspace):
    async def _setup_mcp_gateway(self) -> None:
        return None


def api(method, path):
    r = httpx.request(method, f"http://{DOMAIN}{path}",
                      headers={"OPEN-SANDBOX-API-KEY": KEY}, timeout=60)
    try:
        return r.status_code, r.json()
    except Exception:
        return r.status_code, r.text


def workspace(wid):
    return OfflineGatewayWorkspace(workspace_id=wid, api_key=KEY, domain=DOMAIN,
                                   protocol="http", timeout_seconds=300)


async def run():
    wid = f"ws-{int(time.time() * 1000)}"
    ws = workspace(wid)
    await ws.initialize()
    first = ws.sandbox_id
    obs["first_id"] = first
    try:
        backend = ws.get_backend()
        r = await backend.exec_shell(["sh", "-c", "echo hello from $(pwd); ls -d data skills sessions"])
        obs["exec_exit"] = r.exit_code
        obs["exec_stdout"] = r.stdout.decode()
        r = await backend.exec_shell(["sh", "-c", "exit 7"])
        obs["exec_exit7"] = r.exit_code
        await backend.write_file("/workspace/data/note.txt", b"persist me\n")
        obs["read_back"] = (await backend.read_file("/workspace/data/note.txt")).decode()
        try:
            await backend.read_file("/workspace/data/missing.txt")
            obs["missing"] = "read succeeded"
        except FileNotFoundError:
            obs["missing"] = "FileNotFoundError"
        obs["info_before_close"] = api("GET", f"/v1/sandboxes/{first}")[1]["metadata"]
        await ws.close()
        obs["state_after_close"] = api("GET", f"/v1/sandboxes/{first}")[1]["status"]["state"]

        ws2 = workspace(wid)
        await ws2.initialize()
        obs["second_id"] = ws2.sandbox_id
        obs["state_after_reattach"] = api("GET", f"/v1/sandboxes/{first}")[1]["status"]["state"]
        b2 = ws2.get_backend()
        obs["read_after_reattach"] = (await b2.read_file("/workspace/data/note.txt")).decode()
        await ws2.close()
        obs["state_after_second_close"] = api("GET", f"/v1/sandboxes/{first}")[1]["status"]["state"]
        # a different workspace id must not attach to this sandbox
        ws3 = workspace(wid + "-other")
        await ws3.initialize()
        obs["other_workspace_id"] = ws3.sandbox_id
        await ws3.close()
    finally:
        obs["kill"] = api("DELETE", f"/v1/sandboxes/{first}")[0]
        for extra in {obs.get("second_id"), obs.get("other_workspace_id")} - {None, first}:
            obs.setdefault("kill_extra", []).append(api("DELETE", f"/v1/sandboxes/{extra}")[0])


def main():
    try:
        asyncio.run(run())
    except BaseException as e:
        obs["exception"] = "".join(traceback.format_exception(e))[-4000:]
    print(json.dumps(obs))


if __name__ == "__main__":
    main()
