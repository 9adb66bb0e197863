"""Aviary's Python SDK: sandboxes with plans, leases with fencing, scopes,
reuse decisions, snapshots and forks, over the v1 HTTP API.

    from aviary import Sandbox
    with Sandbox.create(intent={"task": "run the tests", "languages": ["python"]}) as sbx:
        print(sbx.decision.reason)
        print(sbx.run("python3 -c 'print(6*7)'").stdout)
"""

from .aio import AsyncClient, AsyncFiles, AsyncLeaseHandle, AsyncSandbox
from .client import Client, Files, LeaseHandle, Sandbox
from .errors import (  # one class per stable error code
    InvalidRequest,
    PayloadTooLarge,
    Unauthorized,
    Forbidden,
    NotFound,
    LeaseRequired,
    StaleToken,
    LeaseHeld,
    InvalidState,
    InvalidPath,
    Conflict,
    InvalidArchive,
    Unavailable,
    RateLimited,
    CapacityExhausted,
    Busy,
    SandboxLost,
    PermissionDenied,
    Internal,
    PortUnreachable,
    Unsupported,
)
from .errors import ERRORS_BY_CODE, AviaryError, ApiError, ProtocolError, TransportError
from .models import (
    Decision,
    Event,
    ExecResult,
    FileInfo,
    Lease,
    Plan,
    PortEndpoint,
    PolicyView,
    ResourceIntent,
    ResourceLimits,
    SandboxInfo,
    SandboxUsage,
    Snapshot,
    Template,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncLeaseHandle",
    "AsyncSandbox",
    "Client",
    "Files",
    "LeaseHandle",
    "Sandbox",
    "AviaryError",
    "ApiError",
    "ProtocolError",
    "TransportError",
    "ERRORS_BY_CODE",
    "PortEndpoint",
    "PortUnreachable",
    "Unsupported",
    "Decision",
    "Event",
    "ExecResult",
    "FileInfo",
    "Lease",
    "Plan",
    "PolicyView",
    "ResourceIntent",
    "ResourceLimits",
    "SandboxInfo",
    "SandboxUsage",
    "Snapshot",
    "Template",
    "InvalidRequest",
    "PayloadTooLarge",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "LeaseRequired",
    "StaleToken",
    "LeaseHeld",
    "InvalidState",
    "InvalidPath",
    "Conflict",
    "InvalidArchive",
    "Unavailable",
    "RateLimited",
    "CapacityExhausted",
    "Busy",
    "SandboxLost",
    "PermissionDenied",
    "Internal",
]
