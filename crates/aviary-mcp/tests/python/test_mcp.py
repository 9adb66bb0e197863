"""``aviary mcp`` driven by the official MCP Python client (the ``mcp``
package), over stdio and over streamable HTTP, against a live server."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, List, Optional

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

import aviary
from tests.conftest import LiveServer

pytestmark = pytest.mark.anyio

TOOLS = {
    "plan",
    "create_sandbox",
    "run_command",
    "read_file",
    "write_file",
    "list_files",
    "list_sandboxes",
    "snapshot",
    "fork",
    "release_sandbox",
    "destroy_sandbox",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _env(server: LiveServer) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(AVIARY_URL=server.url, AVIARY_API_KEY=server.key, AVIARY_LOG="warn")
    return env


@asynccontextmanager
async def stdio_session(server: LiveServer, *extra: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=os.environ["AVIARY_BIN"], args=["mcp", *extra], env=_env(server))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        yield s


@asynccontextmanager
async def http_session(url: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write, _), ClientSession(read, write) as s:
        await s.initialize()
        yield s


def data(r: CallToolResult) -> Any:
    assert not r.isError, r.content
    return json.loads(r.content[0].text)  # type: ignore[union-attr]


def error_text(r: CallToolResult) -> str:
    assert r.isError, r.content
    return r.content[0].text  # type: ignore[union-attr]


def sdk(server: LiveServer) -> aviary.Client:
    return aviary.Client(server.url, server.key)


async def test_stdio_tools_create_run_files_snapshot_fork_release(server: LiveServer) -> None:
    created: List[str] = []
    try:
        async with stdio_session(server) as s:
            tools = (await s.list_tools()).tools
            assert {t.name for t in tools} == TOOLS
            for t in tools:
                assert t.description and len(t.description) > 40, t.name
                assert t.inputSchema["type"] == "object"
            run_schema = next(t for t in tools if t.name == "run_command").inputSchema
            assert set(run_schema["required"]) == {"sandbox_id", "command"}
            assert run_schema["properties"]["command"]["description"]

            plan = data(await s.call_tool("plan", {"task": "build a rust crate", "languages": ["rust"], "needs_compile": True}))
            assert plan["intent"]["resource_class"] and plan["intent"]["reason"]
            assert plan["policy"]["approved"] is True

            sbx = data(await s.call_tool("create_sandbox", {"intent": {"task": "python tests"}, "metadata": {"via": "mcp"}}))
            created.append(sbx["id"])
            assert sbx["leased_by_this_session"] is True and sbx["decision"]["reason"]
            assert "token" not in sbx["lease"]
            with sdk(server) as c:
                info = c.sandbox(sbx["id"]).info
                assert info.lease_owner and info.lease_owner.startswith("mcp-")
                with pytest.raises(aviary.LeaseRequired):
                    c.sandbox(sbx["id"]).run("true")

            progress: List[str] = []

            async def on_progress(p: float, total: Optional[float], message: Optional[str]) -> None:
                progress.append(message or "")

            ran = data(
                await s.call_tool(
                    "run_command",
                    {"sandbox_id": sbx["id"], "command": "echo one; echo two >&2; cat; exit 4", "stdin": "three"},
                    progress_callback=on_progress,
                )
            )
            assert ran["exit_code"] == 4
            assert ran["stdout"] == "one\nthree" and ran["stderr"] == "two\n"
            streamed = "".join(progress)
            assert "[stdout] one" in streamed and "[stderr] two" in streamed

            assert data(await s.call_tool("write_file", {"sandbox_id": sbx["id"], "path": "/workspace/src/app.py", "content": "print(42)\n"}))["bytes"] == 10
            read = data(await s.call_tool("read_file", {"sandbox_id": sbx["id"], "path": "/workspace/src/app.py"}))
            assert read["content"] == "print(42)\n" and read["encoding"] == "utf8"
            listed = data(await s.call_tool("list_files", {"sandbox_id": sbx["id"], "path": "/workspace/src"}))
            assert [e["name"] for e in listed["entries"]] == ["app.py"]
            mine = data(await s.call_tool("list_sandboxes", {"metadata": {"via": "mcp"}}))["sandboxes"]
            assert [(x["id"], x["leased_by_this_session"]) for x in mine] == [(sbx["id"], True)]

            snap = data(await s.call_tool("snapshot", {"sandbox_id": sbx["id"], "label": "clean"}))
            assert snap["sandbox_id"] == sbx["id"] and snap["label"] == "clean"
            await s.call_tool("write_file", {"sandbox_id": sbx["id"], "path": "/workspace/src/app.py", "content": "changed"})
            fork = data(await s.call_tool("fork", {"sandbox_id": sbx["id"], "snapshot_id": snap["id"]}))
            created.append(fork["id"])
            assert fork["id"] != sbx["id"] and fork["leased_by_this_session"] is True
            assert data(await s.call_tool("read_file", {"sandbox_id": fork["id"], "path": "/workspace/src/app.py"}))["content"] == "print(42)\n"
            # a live fork needs the gVisor runtime (this sandbox runs on crun), and takes no snapshot
            assert "unsupported" in error_text(await s.call_tool("fork", {"sandbox_id": sbx["id"], "live": True}))
            assert "invalid_request" in error_text(await s.call_tool("fork", {"sandbox_id": sbx["id"], "live": True, "snapshot_id": snap["id"]}))

            # bad input and API failures are tool errors carrying the code and the reason
            assert "invalid_request" in error_text(await s.call_tool("run_command", {"sandbox_id": "../../v1/keys", "command": "true"}))
            assert "not_found" in error_text(await s.call_tool("read_file", {"sandbox_id": sbx["id"], "path": "/nope"}))
            gpu = {"task": "train a model on a GPU", "needs_gpu": True}
            verdict = data(await s.call_tool("plan", gpu))["policy"]
            assert verdict["approved"] is False and verdict["denial_code"] and verdict["reasons"]
            denied = error_text(await s.call_tool("create_sandbox", {"intent": gpu}))
            assert denied.startswith("forbidden: policy denied"), denied
            assert verdict["denial_code"] in denied

            released = data(await s.call_tool("release_sandbox", {"sandbox_id": sbx["id"]}))
            assert released.get("lease_owner") is None
            with sdk(server) as c:
                assert c.sandbox(sbx["id"]).run("cat /workspace/src/app.py").stdout == "changed"
                assert c.sandbox(fork["id"]).info.lease_owner is not None
        # the session closed: the fork's lease was given back
        with sdk(server) as c:
            assert c.sandbox(fork["id"]).info.lease_owner is None
            assert c.sandbox(fork["id"]).run("echo free").stdout == "free\n"
    finally:
        with sdk(server) as c:
            for sid in created:
                try:
                    c.sandbox(sid).destroy()
                except aviary.AviaryError:
                    pass


async def test_the_session_renews_its_leases(server: LiveServer) -> None:
    sid = ""
    try:
        async with stdio_session(server, "--lease-ttl", "3") as s:
            sid = data(await s.call_tool("create_sandbox", {}))["id"]
            # three lease lifetimes later the session still holds the sandbox
            await anyio.sleep(10)
            assert data(await s.call_tool("run_command", {"sandbox_id": sid, "command": "echo still mine"}))["stdout"] == "still mine\n"
            with sdk(server) as c:
                with pytest.raises(aviary.LeaseRequired):
                    c.sandbox(sid).run("true")
    finally:
        with sdk(server) as c:
            if sid:
                c.sandbox(sid).destroy()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def mcp_http(server: LiveServer) -> Any:
    port = _free_port()
    proc = subprocess.Popen(
        [os.environ["AVIARY_BIN"], "mcp", "--http", f"127.0.0.1:{port}"],
        env=_env(server),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"http://(\S+)/mcp", line)
        assert m, f"aviary mcp --http said: {line!r}"
        yield f"http://{m.group(1)}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_http_refuses_a_non_loopback_address(server: LiveServer) -> None:
    out = subprocess.run(
        [os.environ["AVIARY_BIN"], "mcp", "--http", "0.0.0.0:0"],
        env=_env(server),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "loopback" in out.stderr, out.stderr


async def test_http_sessions_are_fenced_from_each_other(server: LiveServer, mcp_http: str) -> None:
    sid = ""
    try:
        async with http_session(mcp_http) as a:
            assert {t.name for t in (await a.list_tools()).tools} == TOOLS
            sbx = data(await a.call_tool("create_sandbox", {"ttl_s": 600}))
            sid = sbx["id"]
            async with http_session(mcp_http) as b:
                refused = error_text(await b.call_tool("run_command", {"sandbox_id": sid, "command": "echo intruder > /workspace/x"}))
                assert refused.startswith("lease_required"), refused
                assert error_text(await b.call_tool("write_file", {"sandbox_id": sid, "path": "/workspace/x", "content": "no"})).startswith("lease_required")
                assert error_text(await b.call_tool("destroy_sandbox", {"sandbox_id": sid})).startswith("lease_required")
                assert error_text(await b.call_tool("snapshot", {"sandbox_id": sid})).startswith("lease_required")
                seen = {x["id"]: x["leased_by_this_session"] for x in data(await b.call_tool("list_sandboxes", {}))["sandboxes"]}
                assert seen[sid] is False
            ran = data(await a.call_tool("run_command", {"sandbox_id": sid, "command": "test ! -e /workspace/x && echo clean"}))
            assert ran["stdout"] == "clean\n"
            assert data(await a.call_tool("write_file", {"sandbox_id": sid, "path": "/workspace/x", "content": "a"}))["bytes"] == 1
            fork = data(await a.call_tool("fork", {"sandbox_id": sid}))
            assert data(await a.call_tool("read_file", {"sandbox_id": fork["id"], "path": "/workspace/x"}))["content"] == "a"
            assert data(await a.call_tool("destroy_sandbox", {"sandbox_id": fork["id"]}))["state"] == "Terminated"
            assert data(await a.call_tool("release_sandbox", {"sandbox_id": sid})).get("lease_owner") is None
            leased_again = data(await a.call_tool("create_sandbox", {"ttl_s": 600}))
            sid2 = leased_again["id"]
        # session A closed: its remaining lease is released in the background
        with sdk(server) as c:
            deadline = time.monotonic() + 30
            while c.sandbox(sid2).info.lease_owner is not None:
                assert time.monotonic() < deadline, "the closed session's lease was not released"
                time.sleep(0.2)
            c.sandbox(sid2).destroy()
    finally:
        with sdk(server) as c:
            if sid:
                try:
                    c.sandbox(sid).destroy()
                except aviary.AviaryError:
                    pass
