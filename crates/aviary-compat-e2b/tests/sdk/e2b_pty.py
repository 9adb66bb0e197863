"""The official e2b SDK's PTY (`sandbox.pty`), unmodified, against Aviary.

Run by crates/aviary-server/tests/compat_e2b.rs like e2b_sync.py. Starts
bash on a terminal, types into it, resizes it, reads what it printed, and
ends with `exit 3`; then a second PTY killed from outside; then a plain
command's stdin (`send_stdin`, `close_stdin`). Prints one JSON
object of observations as its last line. Every sandbox it creates is
killed before it exits.
"""

import json
import os

from e2b import CommandExitException, PtySize, Sandbox

obs = {}
created = []
try:
    sbx = Sandbox.create(metadata={"run": os.environ["RUN"]})
    created.append(sbx.sandbox_id)
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    obs["pid"] = h.pid
    sbx.pty.send_stdin(h.pid, b"stty size; echo $((6*7)); tty >/dev/null && echo is-a-tty\n")
    out = []
    resized = False
    # read the terminal as it prints; once bash answered (not just the
    # terminal echoing what was typed), resize it and type the rest;
    # resize it and type the rest
    for _stdout, _stderr, pty in h:
        if pty is None:
            continue
        out.append(pty)
        if not resized and b"\n42\r\n" in b"".join(out):
            resized = True
            sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
            sbx.pty.send_stdin(h.pid, b"stty size\nexit 3\n")
    try:
        h.wait()
        obs["exit_code"] = 0
    except CommandExitException as e:
        obs["exit_code"] = e.exit_code
    text = b"".join(out).decode("utf-8", "replace")
    obs["saw_42"] = "\n42\r\n" in text
    obs["saw_tty"] = "\nis-a-tty\r\n" in text
    obs["saw_24_80"] = "24 80\r\n" in text
    obs["saw_40_120"] = "40 120\r\n" in text

    # a second terminal, listed while it runs, ended by kill
    h2 = sbx.pty.create(PtySize(rows=10, cols=40))
    obs["listed"] = any(p.pid == h2.pid for p in sbx.commands.list())
    obs["killed"] = sbx.pty.kill(h2.pid)
    try:
        h2.wait()
        obs["second_exit"] = 0
    except CommandExitException as e:
        obs["second_exit"] = e.exit_code
    # input to a plain command is refused in E2B's own error shape
    c = sbx.commands.run("sleep 5", background=True)
    try:
        sbx.pty.send_stdin(c.pid, b"x")
        obs["plain_stdin"] = "accepted"
    except Exception as e:
        obs["plain_stdin"] = type(e).__name__
    c.kill()
    # a plain command's stdin: started with stdin=True, written twice
    # (str and bytes), then closed so the command reads end of file
    c = sbx.commands.run("tr a-z A-Z", background=True, stdin=True)
    sbx.commands.send_stdin(c.pid, "hello ")
    sbx.commands.send_stdin(c.pid, b"stdin\n")
    sbx.commands.close_stdin(c.pid)
    r = c.wait()
    obs["stdin_out"] = r.stdout
    obs["stdin_exit"] = r.exit_code
    # a command started without stdin refuses input to it
    c = sbx.commands.run("sleep 5", background=True)
    try:
        sbx.commands.send_stdin(c.pid, "x")
        obs["no_stdin"] = "accepted"
    except Exception as e:
        obs["no_stdin"] = type(e).__name__
    c.kill()
finally:
    for sid in created:
        try:
            Sandbox.kill(sid)
        except Exception:
            pass

print(json.dumps(obs))
