"""The official e2b SDK (async flavour), unmodified, against Aviary.

Same contract as e2b_sync.py: env E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY, RUN; prints one JSON object of observations last; kills what
it creates.
"""

import asyncio
import json
import os

from e2b import AsyncSandbox, CommandExitException, SandboxQuery, SandboxState

RUN = os.environ["RUN"]


async def listed(query):
    ids = []
    paginator = AsyncSandbox.list(query=query)
    while paginator.has_next:
        ids.extend(s.sandbox_id for s in await paginator.next_items())
    return ids


async def main():
    obs = {}
    sbx = await AsyncSandbox.create(
        metadata={"suite": "async", "run": RUN, "agentscope.workspace.id": "ws-" + RUN},
        envs={"LEVEL": "async"},
        timeout=120,
    )
    try:
        obs["sandbox_id"] = sbx.sandbox_id
        # streamed output, proved by causality as in the sync flow
        chunks = []

        async def on_stdout(data):
            chunks.append(data)
            if "line1" in data:
                await sbx.files.write("/tmp/go", "go")

        r = await sbx.commands.run(
            "echo line1; for i in $(seq 300); do [ -e /tmp/go ] && break; sleep 0.1; done; "
            "[ -e /tmp/go ] && echo saw-go || echo no-go; echo line3; echo $LEVEL >&2",
            on_stdout=on_stdout,
        )
        obs["stream_chunks"] = chunks
        obs["stdout"] = r.stdout
        obs["stderr"] = r.stderr
        try:
            await sbx.commands.run("exit 3")
            obs["exit3"] = "no exception"
        except CommandExitException as e:
            obs["exit3"] = e.exit_code
        # a background command, found by List and ended by kill
        handle = await sbx.commands.run("sleep 300", background=True)
        obs["bg_listed"] = handle.pid in [p.pid for p in await sbx.commands.list()]
        obs["bg_killed"] = await sbx.commands.kill(handle.pid)
        try:
            await handle.wait()
            obs["bg_wait"] = "exited normally"
        except CommandExitException as e:
            obs["bg_wait"] = e.exit_code
        obs["bg_listed_after"] = handle.pid in [p.pid for p in await sbx.commands.list()]

        # attach to a running command: it prints only after the attached
        # client exists (the go file is written after connect returns)
        waiter = await sbx.commands.run(
            "for i in $(seq 300); do [ -e /tmp/go2 ] && break; sleep 0.1; done; echo after-attach",
            background=True,
        )
        attached = await sbx.commands.connect(waiter.pid)
        await sbx.files.write("/tmp/go2", "go")
        done = await attached.wait()
        obs["attached_stdout"] = done.stdout
        obs["attached_exit"] = done.exit_code
        obs["started_stdout"] = (await waiter.wait()).stdout

        await sbx.files.write("/tmp/async/data.txt", "async data")
        obs["read"] = await sbx.files.read("/tmp/async/data.txt")
        obs["list"] = [e.name for e in await sbx.files.list("/tmp/async")]
        info = await sbx.get_info()
        obs["metadata"] = info.metadata
        # the dotted key is filterable, as AgentScope's lookup needs
        obs["list_dotted"] = await listed(
            SandboxQuery(metadata={"agentscope.workspace.id": "ws-" + RUN})
        )
        obs["pause"] = await sbx.pause()
        obs["pause_again"] = await AsyncSandbox.pause(sbx.sandbox_id)
        obs["running_paused"] = await sbx.is_running()
        obs["list_paused"] = await listed(
            SandboxQuery(metadata={"run": RUN}, state=[SandboxState.PAUSED])
        )
        back = await AsyncSandbox.connect(sbx.sandbox_id)
        obs["running_back"] = await back.is_running()
        obs["read_back"] = await back.files.read("/tmp/async/data.txt")
        obs["kill"] = await back.kill()
        obs["kill_again"] = await AsyncSandbox.kill(sbx.sandbox_id)
        obs["running_killed"] = await sbx.is_running()
    finally:
        await AsyncSandbox.kill(sbx.sandbox_id)
    print(json.dumps(obs))


asyncio.run(main())
