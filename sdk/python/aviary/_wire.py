"""What the sync and async clients share: configuration, request bodies,
error answers, and the server-sent-event framing of the streaming routes."""

from __future__ import annotations

import base64
import codecs
import json
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from .errors import AviaryError, ProtocolError, error_for
from .models import ExecResult, FileInfo

#: The header that carries the lease token on every call of a leased sandbox.
LEASE_TOKEN_HEADER = "x-aviary-lease-token"
DEFAULT_URL = "http://127.0.0.1:7400"
DEFAULT_DATA_DIR = "/var/lib/aviary"

#: A command: a shell string (run with ``/bin/sh -c``) or an argv list.
Command = Union[str, Sequence[str]]
OutputCallback = Callable[[str], Any]


def resolve_url(url: Optional[str]) -> str:
    """``url``, else ``AVIARY_URL``, else the local default; ``host:port``
    alone means ``http://host:port`` (as the CLI reads it)."""
    raw = (url or os.environ.get("AVIARY_URL") or DEFAULT_URL).strip().rstrip("/")
    if "://" not in raw:
        raw = "http://" + raw
    if not raw.startswith(("http://", "https://")):
        raise ValueError(f"AVIARY_URL {raw!r} is not an http(s) URL (e.g. {DEFAULT_URL})")
    return raw


def resolve_key(key: Optional[str]) -> str:
    """``key``, else ``AVIARY_API_KEY``, else the admin key that ``aviary
    serve`` wrote to ``<data dir>/admin.key`` (``AVIARY_DATA_DIR``, default
    ``/var/lib/aviary``), like the CLI."""
    if key:
        return key
    env = os.environ.get("AVIARY_API_KEY")
    if env:
        return env
    path = Path(os.environ.get("AVIARY_DATA_DIR") or DEFAULT_DATA_DIR) / "admin.key"
    try:
        return path.read_text().strip()
    except OSError as e:
        raise AviaryError(
            f"no API key: set AVIARY_API_KEY or make {path} readable ({e.strerror})"
        ) from None


def raise_for(response: httpx.Response, body: Optional[bytes] = None) -> None:
    """Raises the error class of an error answer; returns on 2xx."""
    if response.is_success:
        return
    raw = body if body is not None else response.content
    try:
        err = json.loads(raw)["error"]
        code, message = str(err["code"]), str(err["message"])
        request_id = err.get("request_id")
    except (ValueError, KeyError, TypeError):
        raise ProtocolError(
            f"HTTP {response.status_code} without an error body", status=response.status_code
        ) from None
    raise error_for(code, message, status=response.status_code, request_id=request_id)


def json_of(response: httpx.Response) -> Any:
    raise_for(response)
    try:
        return response.json()
    except ValueError:
        raise ProtocolError(f"the answer to {response.request.url.path} is not JSON") from None


def token_headers(token: Optional[str]) -> Dict[str, str]:
    return {LEASE_TOKEN_HEADER: token} if token else {}


def sandbox_path(sandbox_id: str, tail: str = "") -> str:
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{tail}"


def create_body(
    *,
    template: Optional[str],
    resource_class: Optional[str],
    intent: Optional[Mapping[str, Any]],
    scope: Optional[str],
    user_id: Optional[str],
    session_id: Optional[str],
    agent: Optional[str],
    network: Optional[str],
    env: Optional[Mapping[str, str]],
    metadata: Optional[Mapping[str, str]],
    ttl_s: Optional[int],
    runtime: Optional[str],
    from_snapshot: Optional[str],
    user_managed: bool,
    lease_owner: Optional[str],
    lease_ttl_s: Optional[int],
) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for name, value in (
        ("template", template),
        ("class", resource_class),
        ("intent", dict(intent) if intent is not None else None),
        ("scope", scope),
        ("user_id", user_id),
        ("session_id", session_id),
        ("agent", agent),
        ("network", network),
        ("ttl_s", ttl_s),
        ("runtime", runtime),
        ("from_snapshot", from_snapshot),
    ):
        if value is not None:
            body[name] = value
    if env:
        body["env"] = dict(env)
    if metadata:
        body["metadata"] = dict(metadata)
    if user_managed:
        body["user_managed"] = True
    if lease_owner is not None:
        lease: Dict[str, Any] = {"owner": lease_owner}
        if lease_ttl_s is not None:
            lease["ttl_s"] = lease_ttl_s
        body["lease"] = lease
    return body


def exec_body(
    cmd: Command,
    *,
    stdin: Optional[str],
    cwd: Optional[str],
    env: Optional[Mapping[str, str]],
    timeout_s: Optional[float],
) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if isinstance(cmd, str):
        body["shell"] = cmd
    else:
        argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("cmd must be a shell string or a non-empty list of strings")
        body["cmd"] = argv
    if stdin is not None:
        body["stdin"] = stdin
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body


def lease_lifetime_s(acquired_at: str, expires_at: str, default: float = 60.0) -> float:
    """Seconds a lease lives, from its RFC 3339 timestamps (``default`` when
    they cannot be read)."""
    from datetime import datetime

    def parse(ts: str) -> datetime:
        ts = ts.strip().replace("Z", "+00:00")
        head, dot, rest = ts.partition(".")
        if dot:  # fromisoformat before 3.11 takes at most 6 fraction digits
            digits = "".join(ch for ch in rest if ch.isdigit())
            zone = rest[len(digits):]
            ts = f"{head}.{digits[:6].ljust(6, '0')}{zone}"
        return datetime.fromisoformat(ts)

    try:
        life = (parse(expires_at) - parse(acquired_at)).total_seconds()
    except ValueError:
        return default
    return life if life > 0 else default


def label_filter(metadata: Optional[Mapping[str, str]]) -> Optional[str]:
    """The ``metadata`` query of ``GET /v1/sandboxes``: ``k=v&k2=v2``, each
    part form-encoded (httpx encodes the whole once more)."""
    if not metadata:
        return None
    return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in metadata.items())


class SseDecoder:
    """Turns the lines of a ``text/event-stream`` into ``(event, data)`` pairs."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: List[str] = []

    def feed(self, line: str) -> Optional[Tuple[str, str]]:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                self._event = "message"
                return None  # a keep-alive or an empty frame
            out = (self._event, "\n".join(self._data))
            self._event, self._data = "message", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


class ExecCollector:
    """Folds the events of a streaming exec into an ``ExecResult`` (the
    whole output, never cut), calling the output callbacks on the way."""

    def __init__(self, on_stdout: Optional[OutputCallback], on_stderr: Optional[OutputCallback]):
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._decoders = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }
        self._text: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        self.result: Optional[ExecResult] = None

    def _emit(self, stream: str, text: str) -> None:
        if not text:
            return
        self._text[stream].append(text)
        cb = self._callbacks[stream]
        if cb is not None:
            cb(text)

    def event(self, name: str, data: str) -> bool:
        """Takes one event; true once the stream is finished."""
        try:
            ev = json.loads(data)
        except ValueError:
            raise ProtocolError(f"bad exec event {data[:80]!r}") from None
        if name in ("stdout", "stderr"):
            chunk = base64.b64decode(ev.get("data", ""))
            self._emit(name, self._decoders[name].decode(chunk))
            return False
        if name == "exit":
            for stream, dec in self._decoders.items():
                self._emit(stream, dec.decode(b"", final=True))
            res = dict(ev["result"])
            res["stdout"] = "".join(self._text["stdout"])
            res["stderr"] = "".join(self._text["stderr"])
            self.result = ExecResult.from_json(res)
            return True
        if name == "error":
            raise error_for(str(ev.get("code", "internal")), str(ev.get("message", "")))
        return False

    def finish(self) -> ExecResult:
        if self.result is None:
            raise ProtocolError("the exec stream ended without an exit event")
        return self.result


def safe_relative(remote_root: str, entry: FileInfo) -> Optional[str]:
    """The local relative path of a listed entry below ``remote_root``, or
    ``None`` when the entry is not a plain descendant. The listing is the
    sandbox's (the attacker's): ``..``, absolute names and odd paths never
    reach the local file system."""
    root = posixpath.normpath(remote_root)
    path = entry.path
    if posixpath.normpath(path) != path or not path.startswith(root.rstrip("/") + "/"):
        return None
    rel = path[len(root.rstrip("/")) + 1 :]
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") or "\x00" in p or "\\" in p for p in parts):
        return None
    return os.path.join(*parts)


def local_tree(local: Union[str, "os.PathLike[str]"]) -> Iterable[Tuple[str, str, bool]]:
    """``(local path, path relative to local, is_dir)`` of a directory's
    content, directories first; symlinks are not followed."""
    base = Path(local)
    if not base.is_dir():
        raise NotADirectoryError(str(base))
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, base)
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                yield p, os.path.normpath(os.path.join(rel_dir, d)), True
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                yield p, os.path.normpath(os.path.join(rel_dir, f)), False


def remote_join(root: str, rel: str) -> str:
    return posixpath.join(root, *rel.split(os.sep))
