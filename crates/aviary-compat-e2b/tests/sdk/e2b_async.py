"""The official e2b SDK (async flavour), unmodified, against Aviary.

Same contract as e2b_sync.py: env E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY, RUN; prints one JSON object of observations last; kills what
it creates.
"""

import asyncio
import json
import os
import urllib.error
import urllib.request

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

        # sandbox.get_host(port): Aviary routes `{port}-{id}.{domain}` hosts to
        # the port (wildcard DNS would point the domain here; the Host header
        # stands in for it), with the API key as credential
        await sbx.commands.run(
            "python3 -m http.server 8123 --bind 127.0.0.1 --directory /etc", background=True)
        host = sbx.get_host(8123)
        obs["host"] = host
        server = os.environ["E2B_API_URL"].rsplit("/e2b", 1)[0]
        got = None
        for _ in range(100):
            req = urllib.request.Request(f"{server}/hostname", headers={
                "Host": host, "Authorization": "Bearer " + os.environ["E2B_API_KEY"]})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    got = [r.status, r.read().decode()]
                break
            except urllib.error.HTTPError as e:
                got = [e.code, e.read().decode()]
                if e.code != 502:
                    break
            await asyncio.sleep(0.1)
        obs["host_get"] = got
        obs["hostname"] = (await sbx.commands.run("cat /etc/hostname")).stdout

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
