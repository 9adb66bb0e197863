"""The sync client against a live server: every feature, real effects."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import List

import httpx
import pytest

import aviary
from aviary import Client, Sandbox

from .conftest import LiveServer


def _label() -> str:
    return uuid.uuid4().hex[:12]


def test_models_match_the_servers_openapi(server: LiveServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for model in aviary.models.MODELS:
        schema = schemas[model.SCHEMA]
        props = set(schema.get("properties", {}))
        names = {f.name.rstrip("_") for f in dataclasses.fields(model)}  # type: ignore[arg-type]
        assert names <= props, f"{model.__name__} has fields the server does not: {names - props}"
        required = set(schema.get("required", []))
        assert required <= names, f"{model.__name__} misses required {required - names}"
    codes = set(schemas["ErrorCode"]["enum"])
    assert codes == set(aviary.ERRORS_BY_CODE), codes ^ set(aviary.ERRORS_BY_CODE)


def test_url_and_key_come_from_the_environment(env: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client() as c:
        assert c.url == env.url
        assert c.templates(), "the default template is listed"
    # without AVIARY_API_KEY the admin key file of AVIARY_DATA_DIR is used, like the CLI
    monkeypatch.delenv("AVIARY_API_KEY")
    monkeypatch.setenv("AVIARY_DATA_DIR", str(env.data_dir))
    monkeypatch.setenv("AVIARY_URL", env.url.removeprefix("http://"))
    with Client() as c:
        assert c.url == env.url
        assert isinstance(c.list(), list)
    monkeypatch.setenv("AVIARY_API_KEY", "not-a-key")
    with Client() as c, pytest.raises(aviary.Unauthorized) as e:
        c.list()
    assert e.value.code == "unauthorized" and e.value.status == 401


def test_create_run_stream_stdin_env_labels_ttl(env: LiveServer) -> None:
    label = _label()
    with Sandbox.create(
        env={"GREETING": "hello from env"},
        metadata={"suite": label},
        ttl_s=900,
        scope="session",
        session_id=label,
    ) as sbx:
        assert sbx.decision is not None and sbx.decision.reason
        assert sbx.info.metadata == {"suite": label}
        assert sbx.info.scope == "session"
        out: List[str] = []
        err: List[str] = []
        res = sbx.run(
            'echo "$GREETING"; echo oops >&2; tr a-z A-Z; exit 3',
            on_stdout=out.append,
            on_stderr=err.append,
            stdin="shout this",
        )
        assert res.exit_code == 3
        assert res.stdout == "hello from env\nSHOUT THIS"
        assert "".join(out) == res.stdout and len(out) >= 1
        assert "".join(err) == res.stderr == "oops\n"
        argv = sbx.run(["/bin/sh", "-c", 'echo "$1 $X"', "sh", "arg1"], env={"X": "exec-env"}, cwd="/tmp")
        assert argv.stdout == "arg1 exec-env\n" and argv.exit_code == 0
        # a long output is streamed whole (the non-streaming route would cut it)
        big = sbx.run("head -c 3000000 /dev/zero | tr '\\0' x")
        assert len(big.stdout) == 3_000_000 and not big.truncated
        # labels filter the list
        with Client() as c:
            found = c.list(metadata={"suite": label})
            assert [s.id for s in found] == [sbx.id]
            assert c.list(metadata={"suite": label + "-other"}) == []
        before = sbx.info.expires_at
        info = sbx.set_ttl(60)
        assert info.expires_at is not None and before is not None and info.expires_at < before
        with pytest.raises(aviary.InvalidRequest):
            sbx.set_ttl(0)
    # leaving the with block destroyed it
    with Client() as c:
        assert c.sandbox(sbx.id).info.state == "Terminated"
        assert sbx.id not in [s.id for s in c.list()]


def test_files_and_directories(env: LiveServer, tmp_path: Path) -> None:
    with Sandbox.create() as sbx:
        assert sbx.files.write("/workspace/a/b.txt", "hello") == 5
        assert sbx.files.read_text("/workspace/a/b.txt") == "hello"
        assert sbx.run("cat /workspace/a/b.txt").stdout == "hello"
        sbx.files.mkdir("/workspace/empty")
        names = {e.name: e.kind for e in sbx.files.list("/workspace")}
        assert names["a"] == "dir" and names["empty"] == "dir"
        st = sbx.files.stat("/workspace/a/b.txt")
        assert st.kind == "file" and st.size == 5
        sbx.files.remove("/workspace/a/b.txt")
        assert not sbx.files.exists("/workspace/a/b.txt")
        with pytest.raises(aviary.NotFound):
            sbx.files.read("/workspace/a/b.txt")
        with pytest.raises(aviary.InvalidPath):
            sbx.files.read("relative/path")

        src = tmp_path / "src"
        (src / "pkg" / "sub").mkdir(parents=True)
        (src / "top.txt").write_text("top")
        (src / "pkg" / "mod.py").write_text("print('mod')\n")
        (src / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 40)
        assert sbx.files.upload_dir(src, "/workspace/proj") == 3
        assert sbx.run("python3 /workspace/proj/pkg/mod.py").stdout == "mod\n"
        assert sbx.run("wc -c < /workspace/proj/pkg/sub/data.bin").stdout.strip() == "10240"
        # a symlink the sandbox made is not followed out of the download
        sbx.run("ln -s /etc/passwd /workspace/proj/escape && mkdir -p /workspace/proj/d2")
        dst = tmp_path / "dst"
        assert sbx.files.download_dir("/workspace/proj", dst) == 3
        assert (dst / "top.txt").read_text() == "top"
        assert (dst / "pkg" / "sub" / "data.bin").read_bytes() == bytes(range(256)) * 40
        assert (dst / "d2").is_dir()
        assert not (dst / "escape").exists()
        assert sbx.files.download("/workspace/proj/top.txt", tmp_path / "one") == 3


def test_leases_carry_their_token_and_renew(env: LiveServer) -> None:
    with Sandbox.create() as sbx, Client() as other:
        stranger = other.sandbox(sbx.id)
        with sbx.lease("agent-a", ttl_s=3) as lease:
            assert sbx.token == lease.token and lease.token
            assert sbx.refresh().lease_owner == "agent-a"
            with pytest.raises(aviary.LeaseRequired):
                stranger.run("true")
            with pytest.raises(aviary.LeaseRequired):
                stranger.files.write("/workspace/x", "no")
            forged = other.sandbox(sbx.id, token=f"{int(lease.token.split('.')[0]) + 7}.{'0' * 32}")
            with pytest.raises(aviary.StaleToken):
                forged.run("true")
            with pytest.raises(aviary.LeaseHeld):
                stranger.lease("agent-b").acquire()
            # three lease lifetimes later the lease still holds: renewed in the background
            time.sleep(10)
            assert lease.renew_error is None
            assert sbx.run("echo leased").stdout == "leased\n"
            assert sbx.files.write("/workspace/x", "mine") == 4
            with pytest.raises(aviary.LeaseRequired):
                stranger.run("true")
        assert sbx.token is None
        assert sbx.refresh().lease_owner is None
        assert stranger.run("cat /workspace/x").stdout == "mine"


def test_create_with_lease_then_release(env: LiveServer) -> None:
    label = _label()
    sbx = Sandbox.create(lease_owner="agent-c", lease_ttl_s=3, scope="session", session_id=label)
    try:
        assert sbx.token is not None and sbx.held_lease is not None
        # the lease taken at create is renewed in the background too (at a third of its 3 s)
        time.sleep(8)
        assert sbx.held_lease.renew_error is None
        assert sbx.run("echo ok").stdout == "ok\n"
        with Client() as c, pytest.raises(aviary.LeaseRequired):
            c.sandbox(sbx.id).run("true")
        info = sbx.release()
        assert sbx.token is None and info.lease_owner is None
        with Client() as c:
            assert c.sandbox(sbx.id).run("echo free").stdout == "free\n"
    finally:
        sbx.release_lease()
        sbx.destroy()


def test_plan_with_reasons(env: LiveServer) -> None:
    with Client() as c:
        plan = c.plan("compile and test a rust crate", languages=["rust"], needs_compile=True)
        assert plan.intent.resource_class and plan.intent.reason
        assert 0.0 <= plan.intent.confidence <= 1.0
        assert plan.policy.approved and plan.policy.class_
        small = c.plan("print hello", expected_duration_s=5)
        assert small.intent.reason
        with pytest.raises(aviary.InvalidRequest):
            c.plan("x", risk="apocalyptic")


def test_create_from_intent(env: LiveServer) -> None:
    with Sandbox.create(intent={"task": "run a python script", "languages": ["python"]}) as sbx:
        assert sbx.info.resource_class
        assert sbx.run("echo planned").stdout == "planned\n"
        assert any(e.event_type for e in sbx.events())


def test_snapshot_and_fork(env: LiveServer) -> None:
    with Sandbox.create() as sbx:
        sbx.files.write("/workspace/state.txt", "v1")
        snap = sbx.snapshot(label="clean")
        assert snap.sandbox_id == sbx.id and snap.label == "clean" and snap.total_bytes >= 2
        assert snap.id in [s.id for s in sbx.snapshots()]
        sbx.files.write("/workspace/state.txt", "v2")
        with sbx.fork(snapshot=snap.id) as child:
            assert child.id != sbx.id
            assert child.decision is not None
            assert child.files.read_text("/workspace/state.txt") == "v1"
            child.files.write("/workspace/state.txt", "child")
        with sbx.fork() as latest:
            assert latest.files.read_text("/workspace/state.txt") == "v2"
        assert sbx.files.read_text("/workspace/state.txt") == "v2"
        sbx.reset(level=2)
        assert sbx.files.read_text("/workspace/state.txt") == "v1"


def test_live_fork_is_unsupported_on_crun(env: LiveServer) -> None:
    with Sandbox.create() as sbx:
        with pytest.raises(aviary.Unsupported) as e:
            sbx.fork(live=True)
        assert e.value.status == 409
        assert sbx.run("echo still").stdout == "still\n"


def test_pause_resume_hibernate_wake(env: LiveServer) -> None:
    with Sandbox.create() as sbx:
        sbx.files.write("/workspace/keep.txt", "kept")
        assert sbx.pause().paused
        with pytest.raises(aviary.InvalidState):
            sbx.run("true")
        assert not sbx.resume().paused
        assert sbx.run("echo back").stdout == "back\n"
        hib = sbx.hibernate()
        assert hib.state == "Hibernating"
        woke = sbx.wake()
        assert woke.state != "Hibernating"
        assert sbx.files.read_text("/workspace/keep.txt") == "kept"
        types = [e.event_type for e in sbx.events()]
        assert len(types) >= 4


def test_usage_shows_memory_processes_and_limits(env: LiveServer) -> None:
    with Client() as admin, Sandbox.create(admin) as sbx:
        base = sbx.usage()
        assert base.sandbox_id == sbx.id and not base.paused
        assert base.memory_bytes > 0 and base.pids >= 1
        assert base.memory_limit_bytes == sbx.info.resources.memory_mb << 20
        assert base.pids_limit == sbx.info.resources.pids
        # ~64 MiB written by a process that stays
        sbx.run("nohup python3 -c 'import time; b = b\"x\" * (64 << 20); time.sleep(600)' >/dev/null 2>&1 &")
        grown = sbx.usage()
        for _ in range(200):
            if grown.memory_bytes >= base.memory_bytes + (48 << 20):
                break
            time.sleep(0.05)
            grown = sbx.usage()
        assert grown.memory_bytes >= base.memory_bytes + (48 << 20), (base, grown)
        assert grown.pids > base.pids
        percent = grown.cpu_percent_since(base)
        assert percent is None or percent >= 0
        # by id, and across tenants for the admin only
        assert admin.sandbox_usage(sbx.id).sandbox_id == sbx.id
        key = admin.create_key(f"tenant-{_label()}")
        with Client(api_key=key) as other:
            with pytest.raises(aviary.NotFound):
                other.sandbox_usage(sbx.id)
            with pytest.raises(aviary.Forbidden):
                other.sandbox_usage(sbx.id, all_tenants=True)
            theirs = Sandbox.create(other)
            try:
                with pytest.raises(aviary.NotFound):
                    admin.sandbox_usage(theirs.id)
                assert admin.sandbox_usage(theirs.id, all_tenants=True).sandbox_id == theirs.id
            finally:
                theirs.destroy()
        # a paused sandbox keeps its counters; a hibernated one has none
        assert sbx.pause().paused
        assert sbx.usage().paused
        sbx.resume()
        sbx.hibernate()
        with pytest.raises(aviary.InvalidState):
            sbx.usage()
        sbx.wake()
        assert sbx.usage().memory_bytes > 0


def test_events_and_follow(env: LiveServer) -> None:
    with Client() as c:
        with Sandbox.create(c) as sbx:
            sbx.run("true")
            sbx_events = sbx.events()
            assert sbx_events and all(e.sandbox_id == sbx.id for e in sbx_events)
            all_events = c.events(sandbox=sbx.id)
            assert [e.id for e in all_events] == [e.id for e in sbx_events]
            followed = []
            for ev in c.follow_events(sandbox=sbx.id, after=0):
                followed.append(ev)
                if len(followed) == len(sbx_events):
                    break
            assert [e.id for e in followed] == [e.id for e in sbx_events]
            newest = sbx.events(limit=1, newest=True)
            assert newest[0].id == sbx_events[-1].id


def test_other_tenants_never_reach_the_sandbox(env: LiveServer) -> None:
    with Client() as admin:
        key = admin.create_key(f"tenant-{_label()}")
        with Sandbox.create(admin) as sbx, Client(api_key=key) as other:
            with pytest.raises(aviary.NotFound):
                other.sandbox(sbx.id)
            assert sbx.id not in [s.id for s in other.list()]
            with pytest.raises(aviary.Forbidden):
                other.create_key("x")


def test_errors_are_classes_by_code(env: LiveServer) -> None:
    with Client() as c:
        with pytest.raises(aviary.NotFound) as e:
            c.sandbox("sbx-does-not-exist")
        assert e.value.code == "not_found" and e.value.status == 404
        assert isinstance(e.value, aviary.ApiError) and isinstance(e.value, aviary.AviaryError)
        with pytest.raises(aviary.InvalidRequest) as bad:
            c.create(template="no-such-template")
        assert "no-such-template" in bad.value.message
    with Client(url="http://127.0.0.1:1") as dead, pytest.raises(aviary.TransportError):
        dead.list()


def test_port_url_reaches_the_proxy(env: LiveServer) -> None:
    with Sandbox.create(ttl_s=300) as sbx:
        url = sbx.port_url(8000)
        assert url.endswith(f"/v1/sandboxes/{sbx.id}/ports/8000/")
        ep = sbx.port_endpoint(8000)
        assert ep.url == url and ep.port == 8000 and len(ep.token) == 64
        # nothing listens there yet: the proxy says so with its own code
        r = httpx.get(url, headers={ep.header: ep.token})
        assert r.status_code == 502 and r.json()["error"]["code"] == "port_unreachable"
        assert aviary.ERRORS_BY_CODE["port_unreachable"] is aviary.PortUnreachable
