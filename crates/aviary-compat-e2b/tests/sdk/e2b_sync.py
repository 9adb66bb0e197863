"""The official e2b SDK (sync flavour), unmodified, against Aviary.

Run by crates/aviary-server/tests/compat_e2b.rs with E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY pointing at a live test server, OTHER_KEY
(another tenant's key) and RUN (a unique label). Prints one JSON object of
observations as its last line; the Rust test asserts on them. Every
sandbox it creates is killed before it exits.
"""

import json
import os
import urllib.error
import urllib.request

import time

from e2b import CommandExitException, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException, TimeoutException

RUN = os.environ["RUN"]
OTHER_KEY = os.environ["OTHER_KEY"]
obs = {}
created = []


def envd_status(sandbox_id, token, route, body):
    """The HTTP status envd answers a raw Connect call with `token`."""
    req = urllib.request.Request(
        os.environ["E2B_SANDBOX_URL"] + route,
        data=json.dumps(body).encode(),
        headers={
            "content-type": "application/json",
            "connect-protocol-version": "1",
            "e2b-sandbox-id": sandbox_id,
            "x-access-token": token,
        },
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


try:
    sbx = Sandbox.create(metadata={"suite": "sync", "run": RUN}, envs={"GREETING": "hello"})
    created.append(sbx.sandbox_id)
    obs["sandbox_id"] = sbx.sandbox_id

    r = sbx.commands.run("echo $GREETING; echo oops >&2")
    obs["env_stdout"] = r.stdout
    obs["stderr"] = r.stderr
    obs["exit_code"] = r.exit_code
    obs["own_env_wins"] = sbx.commands.run("echo $GREETING", envs={"GREETING": "mine"}).stdout

    # streaming, proved by causality: line3 is printed only after the client
    # has seen line1 and answered by writing /tmp/go through the SDK
    chunks = []

    def on_stdout(data):
        chunks.append(data)
        if "line1" in data:
            sbx.files.write("/tmp/go", "go")

    r = sbx.commands.run(
        "echo line1; for i in $(seq 300); do [ -e /tmp/go ] && break; sleep 0.1; done; "
        "[ -e /tmp/go ] && echo saw-go || echo no-go; echo line3",
        on_stdout=on_stdout,
        timeout=60,
    )
    obs["stream_chunks"] = chunks
    obs["stream_stdout"] = r.stdout

    try:
        sbx.commands.run("echo before-exit; echo bad >&2; exit 3")
        obs["exit3"] = "no exception"
    except CommandExitException as e:
        obs["exit3"] = {"exit_code": e.exit_code, "stdout": e.stdout, "stderr": e.stderr}

    # the call's timeout is the process's lifetime: the server kills it
    try:
        sbx.commands.run("sleep 37; echo never", timeout=1)
        obs["deadline"] = "no exception"
    except TimeoutException:
        obs["deadline"] = "TimeoutException"
    except Exception as e:
        obs["deadline"] = type(e).__name__ + ": " + str(e)
    count = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 37' || true"
    for _ in range(100):  # converges as soon as envd has reaped the group
        left = sbx.commands.run(count).stdout.strip()
        if left == "0":
            break
        time.sleep(0.1)
    obs["deadline_left"] = left

    # files
    info = sbx.files.write("/tmp/e2b/a.txt", "x" * 100000)
    obs["write_path"] = info.path
    obs["read_len"] = len(sbx.files.read("/tmp/e2b/a.txt"))
    obs["wc"] = sbx.commands.run("wc -c < /tmp/e2b/a.txt").stdout.strip()
    sbx.files.write("/tmp/e2b/gz/z.txt", "zipped " * 5000, gzip=True)
    obs["gzip_wc"] = sbx.commands.run("wc -c < /tmp/e2b/gz/z.txt").stdout.strip()
    sbx.files.remove("/tmp/e2b/gz")
    sbx.files.write("/tmp/e2b/b.bin", b"\x00\x01\xffbin")
    obs["read_bytes"] = list(sbx.files.read("/tmp/e2b/b.bin", format="bytes"))
    obs["list"] = sorted((e.name, e.type.value) for e in sbx.files.list("/tmp/e2b"))
    obs["exists"] = [sbx.files.exists("/tmp/e2b/a.txt"), sbx.files.exists("/tmp/e2b/none")]
    obs["make_dir"] = [sbx.files.make_dir("/tmp/e2b/sub"), sbx.files.make_dir("/tmp/e2b/sub")]
    moved = sbx.files.rename("/tmp/e2b/b.bin", "/tmp/e2b/sub/c.bin")
    obs["moved"] = moved.path
    obs["moved_seen"] = sbx.commands.run("ls /tmp/e2b/sub").stdout.split()
    sbx.files.remove("/tmp/e2b/sub")
    obs["removed"] = sbx.files.exists("/tmp/e2b/sub")
    obs["file_info_size"] = sbx.files.get_info("/tmp/e2b/a.txt").size
    try:
        sbx.files.read("/tmp/e2b/missing")
        obs["read_missing"] = "no exception"
    except Exception as e:  # the SDK's FileNotFoundException / NotFoundException
        obs["read_missing"] = type(e).__name__
    # a file written by a command is read through /files
    sbx.commands.run("echo from-cmd > /tmp/e2b/cmd.txt")
    obs["cmd_file"] = sbx.files.read("/tmp/e2b/cmd.txt")
    # relative paths are the home's, where commands start
    sbx.files.write("rel.txt", "home")
    obs["pwd"] = sbx.commands.run("pwd").stdout.strip()
    obs["rel_cat"] = sbx.commands.run("cat rel.txt").stdout

    # info, timeout
    info = sbx.get_info()
    obs["info_metadata"] = info.metadata
    obs["info_state"] = info.state.value
    before = (info.end_at - info.started_at).total_seconds()
    sbx.set_timeout(600)
    info = sbx.get_info()
    obs["lifetime_before"] = before
    obs["lifetime_after"] = (info.end_at - info.started_at).total_seconds()

    # list with filters
    def listed(query):
        ids = []
        paginator = Sandbox.list(query=query, limit=1)
        while paginator.has_next:
            ids.extend(s.sandbox_id for s in paginator.next_items())
        return ids

    second = Sandbox.create(metadata={"suite": "sync-second", "run": RUN})
    created.append(second.sandbox_id)
    obs["second_id"] = second.sandbox_id
    obs["list_run"] = sorted(listed(SandboxQuery(metadata={"run": RUN})))
    obs["list_suite"] = listed(SandboxQuery(metadata={"run": RUN, "suite": "sync"}))
    obs["list_paused_before"] = listed(SandboxQuery(metadata={"run": RUN}, state=[SandboxState.PAUSED]))

    # pause → listed paused → connect resumes, files survive
    obs["pause"] = sbx.pause()
    obs["running_while_paused"] = sbx.is_running()
    obs["list_paused"] = listed(SandboxQuery(metadata={"run": RUN}, state=[SandboxState.PAUSED]))
    obs["list_running"] = listed(SandboxQuery(metadata={"run": RUN}, state=[SandboxState.RUNNING]))
    obs["info_paused_state"] = Sandbox.get_info(sbx.sandbox_id).state.value
    back = Sandbox.connect(sbx.sandbox_id, timeout=120)
    obs["running_after_connect"] = back.is_running()
    obs["file_after_resume"] = back.commands.run("wc -c < /tmp/e2b/a.txt").stdout.strip()

    # auth: a wrong token is 401; another tenant sees nothing
    obs["wrong_token"] = envd_status(
        sbx.sandbox_id, "wrong", "/filesystem.Filesystem/ListDir", {"path": "/"}
    )
    # the right token of one sandbox opens no other
    obs["token_of_other_sandbox"] = envd_status(
        second.sandbox_id,
        sbx._envd_access_token,
        "/filesystem.Filesystem/ListDir",
        {"path": "/"},
    )
    try:
        Sandbox.connect(sbx.sandbox_id, api_key=OTHER_KEY)
        obs["other_tenant_connect"] = "connected"
    except NotFoundException:
        obs["other_tenant_connect"] = "NotFoundException"
    except Exception as e:
        obs["other_tenant_connect"] = type(e).__name__ + ": " + str(e)
    obs["other_tenant_kill"] = Sandbox.kill(sbx.sandbox_id, api_key=OTHER_KEY)
    obs["other_tenant_list"] = [
        s.sandbox_id
        for s in Sandbox.list(query=SandboxQuery(metadata={"run": RUN}), api_key=OTHER_KEY).next_items()
    ]

    # kill: True, then False; not running after
    obs["kill"] = sbx.kill()
    obs["kill_again"] = Sandbox.kill(sbx.sandbox_id)
    obs["running_after_kill"] = sbx.is_running()
    obs["kill_second"] = second.kill()
finally:
    for sid in created:
        try:
            Sandbox.kill(sid)
        except Exception:
            pass

print(json.dumps(obs))
