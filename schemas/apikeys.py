"""API keys of the policy gateway (``joynexus tenant key add|rm|ls``), as records.

A key is ``jnxk_<id>_<secret>``: the id names its record, the secret is 32 random
bytes the operator's client made. Only ``sha256(secret)`` travels and is stored
(:class:`ApiKeyRecord`, ``key.<id>`` in the API keys bucket); the secret's
entropy makes a slow hash unnecessary, and checking one costs microseconds, so a
flood of wrong keys is cheap to refuse. A key is bound to one tenant and
optionally to one workload and one version of its policy.

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from joynexus.schemas.base import Wire
from joynexus.schemas.scheduler import ErrorBody

#: What every key starts with (a reader can tell a gateway key from a password).
KEY_PREFIX = "jnxk_"
_KEY = re.compile(r"^jnxk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_KEY_ID = re.compile(r"^[0-9a-f]{12}$")


def new_key() -> tuple[str, str, str]:
    """A fresh key: ``(key id, the whole key to hand over, sha256 of its secret)``."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return key_id, f"{KEY_PREFIX}{key_id}_{secret}", secret_hash(secret)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(key: str) -> tuple[str, str] | None:
    """``(key id, sha256 of its secret)`` of a well-formed key, else None."""
    m = _KEY.match(key.strip())
    if m is None:
        return None
    return m.group(1), secret_hash(m.group(2))


def hash_matches(stored: str, presented: str) -> bool:
    """Constant-time comparison of two hashes."""
    return hmac.compare_digest(stored.encode(), presented.encode())


def valid_key_id(key_id: str) -> bool:
    return bool(_KEY_ID.match(key_id))


class ApiKeyRecord(Wire, kw_only=True, omit_defaults=True):
    """One key, as stored (``key.<id>``): never the key, only the hash of its secret."""

    key_id: str
    tenant_id: str
    #: sha256 (hex) of the key's secret part.
    secret_sha256: str
    #: The one workload the key may drive ("" any of the tenant's workloads).
    workload: str = ""
    #: The one version it is pinned to (0: the latest, or the one the client names).
    version: int = 0
    created_at: float = 0.0
    label: str = ""


class ApiKeyUse(Wire, kw_only=True):
    """When the gateway last accepted a key (``used.<id>``; written at most once a minute)."""

    at: float
    gateway: str = ""


class ApiKeyInfo(Wire, kw_only=True, omit_defaults=True):
    """What ``joynexus tenant key ls`` shows of a key."""

    key_id: str
    tenant_id: str
    workload: str = ""
    version: int = 0
    created_at: float = 0.0
    last_used_at: float = 0.0
    label: str = ""


class KeyRequest(Wire, kw_only=True, omit_defaults=True):
    """The operator API's key verbs (``key_add``, ``key_rm``, ``key_ls``)."""

    tenant: str = ""
    key_id: str = ""
    secret_sha256: str = ""
    workload: str = ""
    version: int = 0
    label: str = ""


class KeyReply(Wire, kw_only=True, omit_defaults=True):
    key: ApiKeyInfo | None = None
    keys: list[ApiKeyInfo] = []
    error: ErrorBody | None = None


#: The operator API's key verbs, each taking a :class:`KeyRequest`.
KEY_VERBS = ("key_add", "key_rm", "key_ls")
