"""The package's errors.

One base, JoyNexusError; each category also subclasses the stdlib error it
stands for, so callers can catch either. Each error has a stable ``code``
that travels in error replies, so the far side raises the same class.
Whether a failed message is retried is decided from the class in
``joynexus.broker.disposition``, nowhere else.

See docs/ARCHITECTURE.md, "Stage workers and failures".
"""

from __future__ import annotations

import asyncio


class JoyNexusError(Exception):
    """Base of every error this package raises on purpose."""

    code = "error"
    #: Retrying the same input cannot succeed.
    permanent = True


class InvalidMessage(JoyNexusError, ValueError):
    """A payload that does not decode as the message it should be."""

    code = "invalid_message"


class SchemaVersionError(InvalidMessage):
    """A message from a newer, incompatible schema version."""

    code = "schema_version"


class InvalidSpec(JoyNexusError, ValueError):
    """A config or request with a bad value; the message names it."""

    code = "invalid_spec"


class UnknownTenant(JoyNexusError, LookupError):
    code = "unknown_tenant"


class UnknownJob(JoyNexusError, LookupError):
    code = "unknown_job"


class UnknownPartition(JoyNexusError, LookupError):
    code = "unknown_partition"


class IllegalTransition(JoyNexusError, ValueError):
    """A state change the job lifecycle does not allow (e.g. completed -> leased)."""

    code = "illegal_transition"


class StaleLease(JoyNexusError, ValueError):
    """The caller's lease on a job expired and was given to someone else."""

    code = "stale_lease"


class UnknownPolicyVersion(JoyNexusError, LookupError):
    """A pinned policy version that is not published (or no longer retained)."""

    code = "unknown_policy_version"


class IncompatibleSchema(InvalidSpec):
    """A request whose feature schema differs from the one the tenant's policy was trained on."""

    code = "incompatible_schema"


class Conflict(JoyNexusError):
    """Someone else changed the job first; re-read and decide again."""

    code = "conflict"
    permanent = False


class PayloadTooLarge(JoyNexusError, ValueError):
    code = "payload_too_large"


class ShapeMismatch(JoyNexusError, ValueError):
    code = "shape_mismatch"


class PermissionDenied(JoyNexusError, PermissionError):
    """The caller's identity may not do this: another tenant's subject, a payload
    that claims another tenant, revoked credentials. Never retried."""

    code = "permission_denied"


class QuotaExceeded(JoyNexusError):
    """The request would take the tenant past a bound its operator set (its
    quota): workloads, open jobs, Training Queue bytes, episodes, head size,
    rows or instruction bytes per request. The message names the bound and how
    much is in use; ask the operator (``joynexus tenant set --quota``) or free some."""

    code = "quota_exceeded"


class RateLimited(JoyNexusError):
    """Too many of this tenant's requests are being served at once; retry after a
    moment (the SDK does, with backoff)."""

    code = "rate_limited"
    permanent = False


class Unavailable(JoyNexusError, ConnectionError):
    """A service did not answer in time; the call may be retried."""

    code = "unavailable"
    permanent = False


class Timeout(Unavailable, asyncio.TimeoutError):
    code = "timeout"


ERRORS_BY_CODE: dict[str, type[JoyNexusError]] = {
    cls.code: cls
    for cls in (
        JoyNexusError,
        InvalidMessage,
        SchemaVersionError,
        InvalidSpec,
        UnknownTenant,
        UnknownJob,
        UnknownPartition,
        UnknownPolicyVersion,
        IncompatibleSchema,
        IllegalTransition,
        StaleLease,
        Conflict,
        PayloadTooLarge,
        ShapeMismatch,
        PermissionDenied,
        QuotaExceeded,
        RateLimited,
        Unavailable,
        Timeout,
    )
}


def error_from_code(code: str, message: str) -> JoyNexusError:
    """Rebuild an error that crossed the wire as (code, message)."""
    return ERRORS_BY_CODE.get(code, JoyNexusError)(message)
