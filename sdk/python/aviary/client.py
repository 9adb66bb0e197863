"""The synchronous client: ``Client``, ``Sandbox``, ``Files``, ``LeaseHandle``.

A ``Sandbox`` carries the token of the lease it holds on every call, so
fenced operations (exec, writes, pause, snapshot, ...) pass the server's
fencing check without the caller threading tokens around. A held lease is
renewed by a background thread until it is released.
"""

from __future__ import annotations

import json
import os
import posixpath
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import httpx

from . import _wire
from ._wire import Command, OutputCallback, sandbox_path, token_headers
from .errors import AviaryError, NotFound, TransportError
from .models import (
    Decision,
    Event,
    ExecResult,
    FileInfo,
    Lease,
    Plan,
    PortEndpoint,
    SandboxInfo,
    SandboxUsage,
    Snapshot,
    Template,
)


class Client:
    """A connection to an Aviary server.

    ``url`` defaults to ``AVIARY_URL`` (else ``http://127.0.0.1:7400``),
    ``api_key`` to ``AVIARY_API_KEY`` (else the admin key in
    ``$AVIARY_DATA_DIR/admin.key``)."""

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 120.0,
    ) -> None:
        self.url = _wire.resolve_url(url)
        self._http = httpx.Client(
            base_url=self.url,
            headers={"authorization": f"Bearer {_wire.resolve_key(api_key)}"},
            timeout=timeout,
        )

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transport ---------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: Optional[Mapping[str, Any]] = None,
        json: Any = None,
        content: Optional[bytes] = None,
        token: Optional[str] = None,
    ) -> httpx.Response:
        headers = token_headers(token)
        if content is not None:
            headers["content-type"] = "application/octet-stream"
        try:
            return self._http.request(
                method, path, params=params, json=json, content=content, headers=headers
            )
        except httpx.TransportError as e:
            raise TransportError(f"cannot reach the aviary server at {self.url}: {e}") from e

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return _wire.json_of(self._send(method, path, **kw))

    # -- sandboxes ---------------------------------------------------------

    def create(
        self,
        *,
        template: Optional[str] = None,
        resource_class: Optional[str] = None,
        intent: Optional[Mapping[str, Any]] = None,
        scope: Optional[str] = None,
        user_id: Optional[str] = None,
        session_id: Optional[str] = None,
        agent: Optional[str] = None,
        network: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        ttl_s: Optional[int] = None,
        runtime: Optional[str] = None,
        from_snapshot: Optional[str] = None,
        user_managed: bool = False,
        lease_owner: Optional[str] = None,
        lease_ttl_s: Optional[int] = None,
    ) -> "Sandbox":
        """Creates (or, for a shared scope, reuses) a sandbox. ``intent`` is a
        task context for the planner (ignored when ``resource_class`` is
        set). With ``lease_owner`` the sandbox comes leased: its token rides
        on every call and a background thread renews it until ``release_lease()``."""
        body = _wire.create_body(
            template=template,
            resource_class=resource_class,
            intent=intent,
            scope=scope,
            user_id=user_id,
            session_id=session_id,
            agent=agent,
            network=network,
            env=env,
            metadata=metadata,
            ttl_s=ttl_s,
            runtime=runtime,
            from_snapshot=from_snapshot,
            user_managed=user_managed,
            lease_owner=lease_owner,
            lease_ttl_s=lease_ttl_s,
        )
        return Sandbox._from_create(self, self._json("POST", "/v1/sandboxes", json=body))

    def sandbox(self, sandbox_id: str, *, token: Optional[str] = None) -> "Sandbox":
        """An existing sandbox; ``token`` carries a lease token held elsewhere."""
        sbx = Sandbox(self, SandboxInfo.from_json(self._json("GET", sandbox_path(sandbox_id))))
        sbx._token = token
        return sbx

    def sandbox_usage(self, sandbox_id: str, *, all_tenants: bool = False) -> SandboxUsage:
        """Live resource usage of a sandbox by id; ``all_tenants=True`` finds
        any tenant's sandbox (admin keys only)."""
        params = {"all_tenants": "true"} if all_tenants else None
        return SandboxUsage.from_json(self._json("GET", sandbox_path(sandbox_id, "/usage"), params=params))

    def list(
        self, *, metadata: Optional[Mapping[str, str]] = None, all: bool = False
    ) -> List[SandboxInfo]:
        """The tenant's sandboxes; ``metadata`` keeps those whose labels have every pair."""
        params: Dict[str, Any] = {"all": "true" if all else "false"}
        labels = _wire.label_filter(metadata)
        if labels is not None:
            params["metadata"] = labels
        data = self._json("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.from_json(s) for s in data["sandboxes"]]

    # -- planning, snapshots, events ----------------------------------------

    def plan(self, task: str, **context: Any) -> Plan:
        """Runs the resource planner on a task context (DESIGN §7: ``plan``,
        ``languages``, ``dependencies``, ``needs_gpu``, ``risk``, ...) and
        shows what the policy guard would approve. Nothing is created."""
        return Plan.from_json(self._json("POST", "/v1/plan", json={"task": task, **context}))

    def snapshots(self, sandbox: Optional[str] = None) -> List[Snapshot]:
        params = {"sandbox": sandbox} if sandbox else None
        data = self._json("GET", "/v1/snapshots", params=params)
        return [Snapshot.from_json(s) for s in data["snapshots"]]

    def events(
        self,
        *,
        sandbox: Optional[str] = None,
        after: Optional[int] = None,
        limit: Optional[int] = None,
        newest: bool = False,
    ) -> List[Event]:
        """The event log (state transitions, decisions with reasons, leases, denials)."""
        params: Dict[str, Any] = {}
        if sandbox is not None:
            params["sandbox"] = sandbox
        if after is not None:
            params["after"] = after
        if limit is not None:
            params["limit"] = limit
        if newest:
            params["newest"] = "true"
        data = self._json("GET", "/v1/events", params=params)
        return [Event.from_json(e) for e in data["events"]]

    def follow_events(
        self, *, sandbox: Optional[str] = None, after: Optional[int] = None
    ) -> Iterator[Event]:
        """Events as they are recorded (``/v1/events/stream``); from now on
        unless ``after`` names an event id. Break out of the loop to stop."""
        params: Dict[str, Any] = {}
        if sandbox is not None:
            params["sandbox"] = sandbox
        if after is not None:
            params["after"] = after
        try:
            with self._http.stream(
                "GET", "/v1/events/stream", params=params, timeout=httpx.Timeout(30.0, read=None)
            ) as r:
                if not r.is_success:
                    _wire.raise_for(r, r.read())
                sse = _wire.SseDecoder()
                for line in r.iter_lines():
                    frame = sse.feed(line)
                    if frame is not None and frame[0] == "event":
                        yield Event.from_json(json.loads(frame[1]))
        except httpx.TransportError as e:
            raise TransportError(f"event stream broke: {e}") from e

    def templates(self) -> List[Template]:
        data = self._json("GET", "/v1/templates")
        return [Template.from_json(t) for t in data["templates"]]

    def create_key(self, tenant: str, *, admin: bool = False) -> str:
        """Issues an API key for a tenant (admin keys only); returns its secret."""
        data = self._json("POST", "/v1/keys", json={"tenant": tenant, "admin": admin})
        return str(data["key"])


class LeaseHandle:
    """A lease on a sandbox: while held, the sandbox sends its token on every
    call and a daemon thread renews it every ``ttl_s / 3`` seconds. Use it as
    a context manager (released on exit) or call ``release()``."""

    def __init__(self, sandbox: "Sandbox", owner: str, ttl_s: Optional[int]) -> None:
        self.sandbox = sandbox
        self.owner = owner
        self.ttl_s = ttl_s
        self.lease: Optional[Lease] = None
        #: The error that stopped the background renewal, if one did.
        self.renew_error: Optional[AviaryError] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def token(self) -> Optional[str]:
        return self.lease.token if self.lease else None

    def acquire(self) -> "LeaseHandle":
        if self.lease is None:
            body: Dict[str, Any] = {"owner": self.owner}
            if self.ttl_s is not None:
                body["ttl_s"] = self.ttl_s
            data = self.sandbox._client._json(
                "POST", sandbox_path(self.sandbox.id, "/lease"), json=body
            )
            self._hold(Lease.from_json(data))
        return self

    def _hold(self, lease: Lease) -> None:
        self.lease = lease
        self.sandbox._token = lease.token
        self.sandbox._held = self
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"aviary-lease-{self.sandbox.id}", daemon=True
        )
        self._thread.start()

    def renew(self) -> Lease:
        """Renews now (the background thread does this on its own)."""
        if self.lease is None:
            raise AviaryError("the lease is not held")
        body: Dict[str, Any] = {"token": self.lease.token}
        if self.ttl_s is not None:
            body["ttl_s"] = self.ttl_s
        data = self.sandbox._client._json("PUT", sandbox_path(self.sandbox.id, "/lease"), json=body)
        self.lease = Lease.from_json(data)
        return self.lease

    def _renew_loop(self) -> None:
        every = max(0.5, self._lifetime() / 3)
        while not self._stop.wait(every):
            try:
                self.renew()
            except AviaryError as e:
                self.renew_error = e
                return

    def _lifetime(self) -> float:
        if self.ttl_s is not None:
            return float(self.ttl_s)
        if self.lease is not None:
            return _wire.lease_lifetime_s(self.lease.acquired_at, self.lease.expires_at)
        return 60.0

    def _stop_renewing(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join()

    def release(self) -> None:
        """Stops renewing and gives the lease back (a lease the server already
        took back, say by a destroy or a reset, is simply forgotten)."""
        self._stop_renewing()
        lease, self.lease = self.lease, None
        if self.sandbox._held is self:
            self.sandbox._held = None
            self.sandbox._token = None
        if lease is not None:
            r = self.sandbox._client._send(
                "DELETE", sandbox_path(self.sandbox.id, "/lease"), json={"token": lease.token}
            )
            if r.status_code not in (404, 409):
                _wire.raise_for(r)

    def __enter__(self) -> "LeaseHandle":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Sandbox:
    """A sandbox and the calls on it. ``Sandbox.create(...)`` makes one;
    ``with Sandbox.create(...) as sbx:`` destroys it on exit."""

    def __init__(
        self,
        client: Client,
        info: SandboxInfo,
        decision: Optional[Decision] = None,
    ) -> None:
        self._client = client
        self.info = info
        #: Why the control plane created or reused it (create and fork only).
        self.decision = decision
        self.files = Files(self)
        self._token: Optional[str] = None
        self._held: Optional[LeaseHandle] = None

    @classmethod
    def create(cls, client: Optional[Client] = None, **kwargs: Any) -> "Sandbox":
        """``Client.create`` on ``client`` (default: a client from the environment)."""
        return (client or Client()).create(**kwargs)

    @classmethod
    def _from_create(cls, client: Client, data: Any) -> "Sandbox":
        sbx = cls(client, SandboxInfo.from_json(data), Decision.from_json(data["decision"]))
        if data.get("lease"):
            lease = Lease.from_json(data["lease"])
            handle = LeaseHandle(sbx, lease.owner, None)
            handle._hold(lease)
        return sbx

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.info.state!r})"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def token(self) -> Optional[str]:
        """The lease token this sandbox sends on every call, if it holds one."""
        return self._token

    @property
    def held_lease(self) -> Optional[LeaseHandle]:
        return self._held

    def _call(self, method: str, tail: str = "", **kw: Any) -> Any:
        return self._client._json(method, sandbox_path(self.id, tail), token=self._token, **kw)

    def _update(self, data: Any) -> SandboxInfo:
        self.info = SandboxInfo.from_json(data)
        return self.info

    def refresh(self) -> SandboxInfo:
        return self._update(self._call("GET"))

    # -- leases --------------------------------------------------------------

    def lease(self, owner: str, *, ttl_s: Optional[int] = None) -> LeaseHandle:
        """A lease handle; ``with sbx.lease("me"):`` acquires, renews in the
        background and releases. ``.acquire()`` takes it without ``with``."""
        return LeaseHandle(self, owner, ttl_s)

    def release_lease(self) -> None:
        """Gives back the lease this sandbox holds (taken at create or by ``lease()``)."""
        if self._held is not None:
            self._held.release()

    # -- exec ------------------------------------------------------------------

    def run(
        self,
        cmd: Command,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        stdin: Optional[str] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout_s: Optional[float] = None,
    ) -> ExecResult:
        """Runs a command (a shell string, or an argv list) and streams its
        output to the callbacks as it comes; the result has the whole output."""
        body = _wire.exec_body(cmd, stdin=stdin, cwd=cwd, env=env, timeout_s=timeout_s)
        collector = _wire.ExecCollector(on_stdout, on_stderr)
        sse = _wire.SseDecoder()
        try:
            with self._client._http.stream(
                "POST",
                sandbox_path(self.id, "/exec/stream"),
                json=body,
                headers=token_headers(self._token),
                timeout=httpx.Timeout(30.0, read=None),
            ) as r:
                if not r.is_success:
                    _wire.raise_for(r, r.read())
                for line in r.iter_lines():
                    frame = sse.feed(line)
                    if frame is not None and collector.event(*frame):
                        break
        except httpx.TransportError as e:
            raise TransportError(f"exec stream broke: {e}") from e
        return collector.finish()

    # -- lifecycle -------------------------------------------------------------

    def pause(self) -> SandboxInfo:
        """Freezes every process of the sandbox until ``resume()``."""
        return self._update(self._call("POST", "/pause"))

    def resume(self) -> SandboxInfo:
        return self._update(self._call("POST", "/resume"))

    def hibernate(self) -> SandboxInfo:
        """Snapshots, then stops compute; ``wake()`` brings it back, same id."""
        return self._update(self._call("POST", "/hibernate"))

    def wake(self) -> SandboxInfo:
        return self._update(self._call("POST", "/wake"))

    def port_endpoint(self, port: int) -> PortEndpoint:
        """The proxy URL of ``port`` inside the sandbox and its port token
        (send it in ``header``, or open ``browser_url`` in a browser)."""
        return PortEndpoint.from_json(self._client._json("GET", sandbox_path(self.id, f"/endpoints/{int(port)}")))

    def port_url(self, port: int) -> str:
        """The URL through which the server proxies HTTP (and WebSockets) to
        ``port`` inside the sandbox; it takes this client's API key."""
        return self.port_endpoint(port).url

    def set_ttl(self, ttl_s: int) -> SandboxInfo:
        """The sandbox now expires ``ttl_s`` seconds from now."""
        return self._update(self._call("POST", "/ttl", json={"ttl_s": ttl_s}))

    def reset(self, level: int = 1) -> SandboxInfo:
        """Recycling: 1 soft reset, 2 back to the clean checkpoint, 3 destroy."""
        info = self._update(self._call("POST", "/reset", params={"level": level}))
        self._forget_lease()
        return info

    def release(self) -> SandboxInfo:
        """Ends a call: the lease is released, the sandbox goes back to Idle
        for its scope (to be reused by a compatible request)."""
        if self._held is not None:
            self._held._stop_renewing()
        info = self._update(self._call("POST", "/release"))
        self._forget_lease()
        return info

    def usage(self) -> SandboxUsage:
        """Live resource usage: memory, CPU time, processes and (when the
        runtime knows it) disk, beside the sandbox's limits. A sandbox that
        holds no compute (hibernated, ended) raises ``InvalidState``."""
        return SandboxUsage.from_json(self._call("GET", "/usage"))

    def manifest(self, *, refresh: bool = False) -> Dict[str, Any]:
        """The environment manifest (what reuse is checked against)."""
        data = self._call("GET", "/manifest", params={"refresh": "true" if refresh else "false"})
        return dict(data)

    def destroy(self) -> SandboxInfo:
        if self._held is not None:
            self._held._stop_renewing()
        info = self._update(self._call("DELETE"))
        self._forget_lease()
        return info

    def _forget_lease(self) -> None:
        if self._held is not None:
            self._held._stop_renewing()
            self._held.lease = None
        self._held = None
        self._token = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.destroy()
        except NotFound:
            pass

    # -- snapshots and forks -----------------------------------------------------

    def snapshot(self, label: Optional[str] = None) -> Snapshot:
        """A checkpoint of the workspace and writable layer (content-addressed
        chunks: unchanged chunks are not stored again). ``label="clean"``
        marks the checkpoint a level-2 reset returns to."""
        params = {"label": label} if label else None
        return Snapshot.from_json(self._call("POST", "/snapshot", params=params))

    def snapshots(self) -> List[Snapshot]:
        return self._client.snapshots(self.id)

    def fork(self, snapshot: Optional[str] = None, *, live: bool = False) -> "Sandbox":
        """A new sandbox from a checkpoint of this one (a fresh checkpoint
        when none is named). ``live=True`` (runsc only; ``Unsupported``
        elsewhere) forks the running sandbox with its processes instead: the
        child runs them with their memory, unleased."""
        body: Dict[str, Any] = {}
        if snapshot is not None:
            body["snapshot"] = snapshot
        if live:
            body["live"] = True
        return Sandbox._from_create(self._client, self._call("POST", "/fork", json=body))

    def events(
        self, *, after: Optional[int] = None, limit: Optional[int] = None, newest: bool = False
    ) -> List[Event]:
        params: Dict[str, Any] = {}
        if after is not None:
            params["after"] = after
        if limit is not None:
            params["limit"] = limit
        if newest:
            params["newest"] = "true"
        data = self._call("GET", "/events", params=params)
        return [Event.from_json(e) for e in data["events"]]


PathLike = Union[str, "os.PathLike[str]"]


class Files:
    """The files of a sandbox (``sbx.files``); paths are absolute in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def _send(self, method: str, tail: str, **kw: Any) -> httpx.Response:
        return self._sbx._client._send(
            method, sandbox_path(self._sbx.id, tail), token=self._sbx._token, **kw
        )

    def read(self, path: str) -> bytes:
        r = self._send("GET", "/files", params={"path": path})
        _wire.raise_for(r)
        return r.content

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def write(self, path: str, data: Union[bytes, str]) -> int:
        """Writes a whole file, making its missing parent directories;
        returns the bytes written."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        r = self._send("PUT", "/files", params={"path": path}, content=raw)
        if r.status_code == 404 and posixpath.dirname(path) not in ("", "/"):
            self.mkdir(posixpath.dirname(path))
            r = self._send("PUT", "/files", params={"path": path}, content=raw)
        return int(_wire.json_of(r)["bytes"])

    def list(self, path: str, *, recursive: bool = False) -> List[FileInfo]:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        data = _wire.json_of(self._send("GET", "/files/list", params=params))
        return [FileInfo.from_json(e) for e in data["entries"]]

    def stat(self, path: str) -> FileInfo:
        return FileInfo.from_json(_wire.json_of(self._send("GET", "/files/stat", params={"path": path})))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def mkdir(self, path: str) -> None:
        _wire.raise_for(self._send("POST", "/files/mkdir", json={"path": path}))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        _wire.raise_for(self._send("DELETE", "/files", params=params))

    def upload(self, local: PathLike, remote: str) -> int:
        with open(local, "rb") as f:
            return self.write(remote, f.read())

    def download(self, remote: str, local: PathLike) -> int:
        """Streams a file to a local path; returns its size."""
        n = 0
        with self._sbx._client._http.stream(
            "GET",
            sandbox_path(self._sbx.id, "/files"),
            params={"path": remote},
            headers=token_headers(self._sbx._token),
        ) as r:
            if not r.is_success:
                _wire.raise_for(r, r.read())
            with open(local, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
                    n += len(chunk)
        return n

    def upload_dir(self, local: PathLike, remote: str) -> int:
        """Copies a local directory's tree into ``remote``; returns the number
        of files. Symlinks are skipped."""
        self.mkdir(remote)
        count = 0
        for path, rel, is_dir in _wire.local_tree(local):
            target = _wire.remote_join(remote, rel)
            if is_dir:
                self.mkdir(target)
            else:
                self.upload(path, target)
                count += 1
        return count

    def download_dir(self, remote: str, local: PathLike) -> int:
        """Copies a sandbox directory's tree into ``local``; returns the number
        of files. Only plain files and directories below ``remote`` are
        taken: an entry whose name would land outside ``local`` is refused."""
        os.makedirs(local, exist_ok=True)
        count = 0
        for entry in sorted(self.list(remote, recursive=True), key=lambda e: e.path):
            rel = _wire.safe_relative(remote, entry)
            if rel is None:
                raise AviaryError(f"the sandbox listed an entry outside {remote}: {entry.path!r}")
            target = os.path.join(local, rel)
            if entry.kind == "dir":
                os.makedirs(target, exist_ok=True)
            elif entry.kind == "file":
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.islink(target):
                    os.unlink(target)
                self.download(entry.path, target)
                count += 1
        return count


__all__: List[str] = ["Client", "Sandbox", "Files", "LeaseHandle"]
