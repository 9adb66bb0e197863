"""Typed views of the API's JSON objects (the schemas of ``/openapi.json``).

Each dataclass names the OpenAPI schema it mirrors in ``SCHEMA``; the test
suite checks every field against the schema a live server publishes. Parsing
ignores fields a newer server adds and fails with a ``ProtocolError`` when a
documented field is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Type, TypeVar

from .errors import ProtocolError

_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def _rfc3339_seconds(text: str) -> float:
    """An RFC 3339 time (the server writes up to nanoseconds) as Unix seconds."""
    m = _RFC3339.match(text)
    if m is None:
        raise ProtocolError(f"not an RFC 3339 time: {text!r}")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    whole = datetime.fromisoformat(m.group(1) + zone).timestamp()
    return whole + (float(m.group(2)) if m.group(2) else 0.0)

T = TypeVar("T", bound="Model")


class Model:
    """Common parsing for the API models."""

    SCHEMA: ClassVar[str] = ""
    #: Fields holding another model (or a list of them).
    _NESTED: ClassVar[Dict[str, Type["Model"]]] = {}

    @classmethod
    def from_json(cls: Type[T], data: Any) -> T:
        if not isinstance(data, Mapping):
            raise ProtocolError(f"expected a {cls.__name__} object, got {type(data).__name__}")
        kwargs: Dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                continue
            value = data[f.name]
            nested = cls._NESTED.get(f.name)
            if nested is not None and value is not None:
                if isinstance(value, list):
                    value = [nested.from_json(v) for v in value]
                else:
                    value = nested.from_json(value)
            kwargs[f.name] = value
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ProtocolError(f"bad {cls.__name__} from the server: {e}") from None


@dataclass
class ResourceLimits(Model):
    SCHEMA: ClassVar[str] = "ResourceLimits"
    cpu: float
    memory_mb: int
    disk_mb: int
    pids: int


@dataclass
class SandboxInfo(Model):
    """A sandbox as the server shows it (``GET /v1/sandboxes/{id}``)."""

    SCHEMA: ClassVar[str] = "Sandbox"
    _NESTED: ClassVar[Dict[str, Type[Model]]] = {"resources": ResourceLimits}
    id: str
    state: str
    tenant: str
    scope: str
    resource_class: str
    resources: ResourceLimits
    template: str
    template_digest: str
    runtime: str
    node: str
    network_profile: str
    created_at: str
    tainted: bool
    version: int
    user_id: Optional[str] = None
    session_id: Optional[str] = None
    agent: Optional[str] = None
    expires_at: Optional[str] = None
    user_managed: bool = False
    paused: bool = False
    metadata: Dict[str, str] = field(default_factory=dict)
    lease_owner: Optional[str] = None


@dataclass
class Decision(Model):
    """Why the control plane chose what it chose at create (or fork)."""

    SCHEMA: ClassVar[str] = "Decision"
    action: str
    branch: str
    reason: str
    score: float


@dataclass
class Lease(Model):
    SCHEMA: ClassVar[str] = "Lease"
    sandbox_id: str
    owner: str
    token: str
    acquired_at: str
    expires_at: str


@dataclass
class ExecResult(Model):
    SCHEMA: ClassVar[str] = "ExecResult"
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float
    timed_out: bool
    oom_killed: bool
    truncated: bool = False


@dataclass
class FileInfo(Model):
    SCHEMA: ClassVar[str] = "FileInfo"
    name: str
    path: str
    kind: str
    size: int
    mode: int
    modified_unix: int


@dataclass
class Event(Model):
    SCHEMA: ClassVar[str] = "Event"
    id: int
    tenant: str
    event_type: str
    timestamp: str
    metadata: Any
    sandbox_id: Optional[str] = None
    old_state: Optional[str] = None
    new_state: Optional[str] = None
    request_id: Optional[str] = None


@dataclass
class Snapshot(Model):
    """A checkpoint of a sandbox (workspace + writable layer, chunked)."""

    SCHEMA: ClassVar[str] = "SandboxSnapshot"
    id: str
    tenant: str
    sandbox_id: str
    workspace_manifest: str
    upper_manifest: str
    template: str
    template_digest: str
    resource_class: str
    created_at: str
    total_bytes: int
    new_bytes: int
    label: str
    parent: Optional[str] = None


@dataclass
class PolicyView(Model):
    """What the policy guard would do with the planner's recommendation."""

    SCHEMA: ClassVar[str] = "PolicyView"
    approved: bool
    clamped: bool
    reasons: List[str]
    class_: Optional[str] = None
    denial_code: Optional[str] = None

    @classmethod
    def from_json(cls, data: Any) -> "PolicyView":
        if isinstance(data, Mapping) and "class" in data:
            data = {**data, "class_": data["class"]}
        return super().from_json(data)


@dataclass
class ResourceIntent(Model):
    """The planner's recommendation (DESIGN §3)."""

    SCHEMA: ClassVar[str] = "ResourceIntent"
    resource_class: str
    cpu: float
    memory_mb: int
    disk_mb: int
    runtime: str
    template: str
    network_profile: str
    ttl_s: int
    confidence: float
    reason: str
    source: str
    needs_gpu: bool = False


@dataclass
class Plan(Model):
    """``POST /v1/plan``: the intent, how the planner got there, and the policy's view."""

    SCHEMA: ClassVar[str] = "PlanResponse"
    _NESTED: ClassVar[Dict[str, Type[Model]]] = {"intent": ResourceIntent, "policy": PolicyView}
    intent: ResourceIntent
    trace: Any
    policy: PolicyView


@dataclass
class Template(Model):
    SCHEMA: ClassVar[str] = "Template"
    name: str
    digest: str
    size_bytes: int
    source: str
    created_at: str


@dataclass
class PortEndpoint(Model):
    """How to reach one port of a sandbox through the server's proxy."""

    SCHEMA: ClassVar[str] = "PortEndpoint"
    port: int
    url: str
    browser_url: str
    header: str
    token: str


@dataclass
class SandboxUsage(Model):
    """Live resource usage of a sandbox (``GET /v1/sandboxes/{id}/usage``):
    its runtime's counters at ``sampled_at`` beside its class's limits.
    ``cpu_seconds`` is cumulative: a CPU percentage is its change between
    two samples over the seconds between them (``cpu_percent_since``)."""

    SCHEMA: ClassVar[str] = "SandboxUsage"
    sandbox_id: str
    state: str
    paused: bool
    cpu_seconds: float
    cpu_limit: float
    memory_bytes: int
    memory_peak_bytes: int
    memory_limit_bytes: int
    pids: int
    pids_limit: int
    oom_kills: int
    disk_limit_bytes: int
    sampled_at: str
    disk_free_bytes: Optional[int] = None
    disk_used_bytes: Optional[int] = None

    def cpu_percent_since(self, earlier: "SandboxUsage") -> Optional[float]:
        """CPU use between ``earlier`` and this sample, in percent of one core
        (``None`` when no time passed between them)."""
        seconds = _rfc3339_seconds(self.sampled_at) - _rfc3339_seconds(earlier.sampled_at)
        if seconds <= 0:
            return None
        return (self.cpu_seconds - earlier.cpu_seconds) * 100.0 / seconds


#: Every model, for the schema check.
MODELS: List[Type[Model]] = [
    ResourceLimits,
    SandboxInfo,
    Decision,
    Lease,
    ExecResult,
    FileInfo,
    Event,
    Snapshot,
    PolicyView,
    ResourceIntent,
    Plan,
    Template,
    PortEndpoint,
    SandboxUsage,
]
