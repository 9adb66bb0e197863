"""One live ``aviary serve`` for the whole suite (real crun sandboxes).

Needs ``AVIARY_BIN`` (the ``aviary`` binary) and ``AVIARY_ENVD`` (the static
in-sandbox daemon); ``AVIARY_TEST_TEMPLATE_CACHE`` shares the prepared
templates between runs. Without them the suite skips, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest


@dataclass
class LiveServer:
    url: str
    key: str
    data_dir: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    binary, envd = os.environ.get("AVIARY_BIN"), os.environ.get("AVIARY_ENVD")
    if not binary or not envd:
        pytest.skip(
            "AVIARY_BIN and AVIARY_ENVD must name the aviary binary and the static envd "
            "(scripts/test.sh sets them); no server to test against"
        )
    if os.geteuid() != 0:
        pytest.skip("aviary serve runs crun sandboxes and needs root")
    cache = os.environ.get("AVIARY_TEST_TEMPLATE_CACHE", "/var/tmp/aviary-test-templates")
    os.makedirs(cache, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="avsdk", dir="/tmp"))
    tmp.chmod(0o711)  # sandboxes run in user namespaces and must reach their dirs
    data = tmp / "data"
    url = f"http://127.0.0.1:{_free_port()}"
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [binary, "serve", "--data-dir", str(data), "--listen", url[len("http://") :],
         "--templates-dir", cache, "--envd", envd],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        # the first run on a fresh machine builds the default template (minutes)
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, f"aviary serve exited: {(tmp / 'serve.log').read_text()}"
            try:
                _, body = _get(url + "/readyz")
            except OSError:
                body = ""
            if '"ready"' in body:
                break
            assert '"failed"' not in body, f"server failed: {body}"
            assert time.monotonic() < deadline, f"server not ready: {body}"
            time.sleep(0.2)
        key = (data / "admin.key").read_text().strip()
        yield LiveServer(url=url, key=key, data_dir=data)
    finally:
        try:
            _cleanup(url, data)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)


def _cleanup(url: str, data: Path) -> None:
    """Destroys whatever a failed test left running (the admin key sees
    every tenant). A sandbox still leased by a failed test is retried until
    its lease (short in these tests) expires."""
    key_file = data / "admin.key"
    if not key_file.exists():
        return
    key = key_file.read_text().strip()
    deadline = time.monotonic() + 120
    while True:
        status, body = _get(url + "/v1/sandboxes", key)
        if status != 200:
            return
        left = [s for s in json.loads(body)["sandboxes"] if s["state"] != "Terminated"]
        if not left or time.monotonic() > deadline:
            return
        for s in left:
            req = urllib.request.Request(url + f"/v1/sandboxes/{s['id']}", method="DELETE")
            req.add_header("authorization", f"Bearer {key}")
            try:
                urllib.request.urlopen(req, timeout=60).read()
            except urllib.error.HTTPError:
                pass
        time.sleep(1)


@pytest.fixture()
def env(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> LiveServer:
    """The server, exported as the SDK reads it (AVIARY_URL / AVIARY_API_KEY)."""
    monkeypatch.setenv("AVIARY_URL", server.url)
    monkeypatch.setenv("AVIARY_API_KEY", server.key)
    monkeypatch.delenv("AVIARY_DATA_DIR", raising=False)
    return server
