"""AgentScope 2.0's E2BWorkspace, unmodified but for one step, against Aviary.

The one step left out is the in-sandbox MCP gateway's bootstrap
(`_setup_mcp_gateway`): it downloads uv and packages from the internet
inside the sandbox, and Aviary's sandboxes have no network by default (the
`none` profile). Everything else runs as AgentScope ships it: the
metadata lookup, create, the health polling, the workspace layout and
skills commands, exec, files, close (= pause), and a second workspace with
the same id re-attaching (connect resumes the paused sandbox).

Env: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, RUN. Prints one JSON object
of observations last; kills the sandbox at the end.
"""

import asyncio
import json
import os

from agentscope.workspace import E2BWorkspace
from e2b import AsyncSandbox, SandboxQuery


class Workspace(E2BWorkspace):
    async def _setup_mcp_gateway(self):
        # needs internet inside the sandbox (uv, PyPI); see the module doc
        return None


async def main():
    obs = {}
    wid = "aviary-" + os.environ["RUN"]
    ws = Workspace(workspace_id=wid, sandbox_metadata={"run": os.environ["RUN"]})
    sandbox_id = None
    try:
        await ws.initialize()
        sandbox_id = ws.sandbox_id
        obs["first_id"] = sandbox_id
        backend = ws.get_backend()
        r = await backend.exec_shell(["sh", "-c", "echo hello from $(pwd)"])
        obs["exec"] = [r.exit_code, r.stdout.decode()]
        r = await backend.exec_shell(["sh", "-c", "exit 5"])
        obs["exec_fail"] = r.exit_code
        await backend.write_file("/home/user/workspace/data/note.txt", b"kept across close")
        obs["read"] = (await backend.read_file("/home/user/workspace/data/note.txt")).decode()
        try:
            await backend.read_file("/home/user/workspace/none.txt")
            obs["read_missing"] = "no exception"
        except FileNotFoundError:
            obs["read_missing"] = "FileNotFoundError"
        r = await backend.exec_shell(["ls", "/home/user/workspace"])
        obs["layout"] = sorted(r.stdout.decode().split())
        await ws.close()
        info = await AsyncSandbox.get_info(sandbox_id)
        obs["state_after_close"] = info.state.value

        again = Workspace(workspace_id=wid, sandbox_metadata={"run": os.environ["RUN"]})
        await again.initialize()
        obs["second_id"] = again.sandbox_id
        obs["read_again"] = (
            await again.get_backend().read_file("/home/user/workspace/data/note.txt")
        ).decode()
        await again.close()
        # a workspace with another id gets a sandbox of its own
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"run": os.environ["RUN"]}))
        obs["sandboxes_of_run"] = len(await paginator.next_items())
    finally:
        if sandbox_id is not None:
            await AsyncSandbox.kill(sandbox_id)
    print(json.dumps(obs))


asyncio.run(main())
