"""The asyncio client against a live server: every feature, real effects."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import List

import pytest

import aviary
from aviary import AsyncClient, AsyncSandbox

from .conftest import LiveServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_create_run_files_labels(env: LiveServer, tmp_path: Path) -> None:
    label = uuid.uuid4().hex[:12]
    async with AsyncClient() as c:
        async with await AsyncSandbox.create(
            c, env={"WHO": "async"}, metadata={"suite": label}, ttl_s=600
        ) as sbx:
            assert sbx.decision is not None and sbx.decision.action
            out: List[str] = []
            res = await sbx.run('echo "$WHO"; cat; echo e >&2', on_stdout=out.append, stdin="in")
            assert res.exit_code == 0 and res.stdout == "async\nin" and res.stderr == "e\n"
            assert "".join(out) == res.stdout
            assert [s.id for s in await c.list(metadata={"suite": label})] == [sbx.id]
            assert (await sbx.set_ttl(30)).expires_at is not None

            assert await sbx.files.write("/workspace/deep/x.txt", b"bytes") == 5
            assert await sbx.files.read("/workspace/deep/x.txt") == b"bytes"
            assert [e.name for e in await sbx.files.list("/workspace/deep")] == ["x.txt"]
            src = tmp_path / "src"
            (src / "d").mkdir(parents=True)
            (src / "d" / "f.txt").write_text("f")
            (src / "g.txt").write_text("g")
            assert await sbx.files.upload_dir(src, "/workspace/up") == 2
            assert await sbx.files.download_dir("/workspace/up", tmp_path / "down") == 2
            assert (tmp_path / "down" / "d" / "f.txt").read_text() == "f"
            await sbx.files.remove("/workspace/up", recursive=True)
            assert not await sbx.files.exists("/workspace/up")
        assert (await c.sandbox(sbx.id)).info.state == "Terminated"


async def test_leases_renew_in_the_background(env: LiveServer) -> None:
    async with AsyncClient() as c, await AsyncSandbox.create(c) as sbx:
        stranger = await c.sandbox(sbx.id)
        async with sbx.lease("async-agent", ttl_s=3) as lease:
            assert sbx.token == lease.token
            with pytest.raises(aviary.LeaseRequired):
                await stranger.run("true")
            await asyncio.sleep(8)
            assert lease.renew_error is None
            assert (await sbx.run("echo held")).stdout == "held\n"
        assert sbx.token is None
        assert (await stranger.run("echo free")).stdout == "free\n"
        leased = await c.create(lease_owner="async-owner", lease_ttl_s=20)
        try:
            assert leased.token is not None
            with pytest.raises(aviary.LeaseRequired):
                await (await c.sandbox(leased.id)).run("true")
            await leased.release()
            assert leased.token is None
        finally:
            await leased.destroy()


async def test_plan_snapshot_fork_lifecycle_events(env: LiveServer) -> None:
    async with AsyncClient() as c:
        plan = await c.plan("train a small model", languages=["python"], dependencies=["numpy"])
        assert plan.intent.resource_class and plan.intent.reason and plan.policy.approved
        async with await AsyncSandbox.create(c, intent={"task": "python script"}) as sbx:
            await sbx.files.write("/workspace/s.txt", "one")
            snap = await sbx.snapshot()
            assert snap.id in [s.id for s in await c.snapshots(sbx.id)]
            await sbx.files.write("/workspace/s.txt", "two")
            async with await sbx.fork(snapshot=snap.id) as child:
                assert (await child.files.read_text("/workspace/s.txt")) == "one"
            usage = await sbx.usage()
            assert usage.sandbox_id == sbx.id and usage.memory_bytes > 0 and usage.pids >= 1
            assert (await c.sandbox_usage(sbx.id)).memory_limit_bytes == usage.memory_limit_bytes
            assert (await sbx.pause()).paused
            assert (await sbx.usage()).paused
            with pytest.raises(aviary.InvalidState):
                await sbx.run("true")
            assert not (await sbx.resume()).paused
            assert (await sbx.hibernate()).state == "Hibernating"
            with pytest.raises(aviary.InvalidState):
                await sbx.usage()
            await sbx.wake()
            assert (await sbx.files.read_text("/workspace/s.txt")) == "two"
            events = await sbx.events()
            assert len(events) >= 4 and all(e.sandbox_id == sbx.id for e in events)
            followed = []
            async for ev in c.follow_events(sandbox=sbx.id, after=0):
                followed.append(ev.id)
                if len(followed) == len(events):
                    break
            assert followed == [e.id for e in events]
        with pytest.raises(aviary.NotFound):
            await c.sandbox("sbx-missing")
