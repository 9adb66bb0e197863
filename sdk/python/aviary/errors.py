"""Errors: one exception class per stable error code of the Aviary API.

The server answers every failure with ``{"error": {"code", "message",
"request_id"}}``; the code is stable (``crates/aviary-core/src/error_code.rs``)
and picks the class raised here, so callers branch on classes, never on
message text.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


class AviaryError(Exception):
    """Base of every error the SDK raises."""

    #: The stable error code (``not_found``, ``stale_token``, ...); ``None``
    #: for failures the server did not answer (transport, protocol).
    code: Optional[str] = None

    def __init__(
        self,
        message: str,
        *,
        status: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id

    def __str__(self) -> str:
        head = f"{self.code} ({self.status}): " if self.code else ""
        return f"{head}{self.message}"


class TransportError(AviaryError):
    """The server could not be reached, or the connection broke."""


class ProtocolError(AviaryError):
    """The server's answer was not what the API documents."""


class ApiError(AviaryError):
    """An error answer of the server; subclasses name its code."""

    code = "internal"


class InvalidRequest(ApiError):
    """The request is malformed (bad JSON, unknown fields, wrong types)."""

    code = "invalid_request"


class PayloadTooLarge(ApiError):
    """The body is larger than the route allows."""

    code = "payload_too_large"


class Unauthorized(ApiError):
    """No API key, or a key the server does not know."""

    code = "unauthorized"


class Forbidden(ApiError):
    """The key may not do this (admin-only route, or a policy denial)."""

    code = "forbidden"


class NotFound(ApiError):
    """No such object for this tenant (other tenants' objects are not found either)."""

    code = "not_found"


class LeaseRequired(ApiError):
    """The sandbox is leased and the call carried no lease token."""

    code = "lease_required"


class StaleToken(ApiError):
    """The call carried a lease token that is not the current lease's."""

    code = "stale_token"


class LeaseHeld(ApiError):
    """The sandbox already has a live lease."""

    code = "lease_held"


class InvalidState(ApiError):
    """The sandbox's state does not allow the call (terminated, paused...)."""

    code = "invalid_state"


class InvalidPath(ApiError):
    """A path escapes the sandbox or is not absolute."""

    code = "invalid_path"


class Conflict(ApiError):
    """Concurrent modification; retry."""

    code = "conflict"


class InvalidArchive(ApiError):
    """A template archive could not be imported."""

    code = "invalid_archive"


class Unavailable(ApiError):
    """The runtime or a dependency is unavailable right now."""

    code = "unavailable"


class RateLimited(ApiError):
    """Too many requests for this key; retry later."""

    code = "rate_limited"


class CapacityExhausted(ApiError):
    """No node has room for the sandbox."""

    code = "capacity_exhausted"


class Busy(ApiError):
    """The sandbox's daemon is busy; retry later."""

    code = "busy"


class SandboxLost(ApiError):
    """The sandbox's runtime or in-sandbox daemon is gone."""

    code = "sandbox_lost"


class PermissionDenied(ApiError):
    """The sandbox refused the operation on that path."""

    code = "permission_denied"


class Internal(ApiError):
    """A server error; the details are in the server's log."""

    code = "internal"


class PortUnreachable(ApiError):
    """Nothing listens on the sandbox port a proxied request asked for (502)."""

    code = "port_unreachable"


class Unsupported(ApiError):
    """The sandbox's runtime cannot do this (e.g. pause a Pod on Kubernetes);
    nothing was changed (409)."""

    code = "unsupported"


#: Every stable error code and its class.
ERRORS_BY_CODE: Dict[str, Type[ApiError]] = {
    cls.code: cls
    for cls in (
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
}


def error_for(
    code: str, message: str, *, status: Optional[int] = None, request_id: Optional[str] = None
) -> ApiError:
    """The exception for an error answer (an unknown code is an ``ApiError``
    carrying that code, so a newer server's codes still reach the caller)."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        err = ApiError(message, status=status, request_id=request_id)
        err.code = code
        return err
    return cls(message, status=status, request_id=request_id)
