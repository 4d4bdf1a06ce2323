"""What each identity may do on the broker, as nats-server authorization.

Three kinds of identity (see :mod:`joynexus.broker.credentials`):

- a **tenant** ``<ns>.<tenant>`` may publish only to its own API subjects
  (``<ns>.api.<tenant>.*``) and its own inference subject
  (``<ns>.infer.*.<tenant>``), and subscribe only to its own inbox
  (``_INBOX.<ns>.<tenant>.>``, where its replies arrive). No JetStream API,
  no job event subject, no Training Queue, policy or weights subject: the
  control plane reads and writes those for it, taking the tenant from the
  subject the server let it publish on.
- the **service** identity (every agent) may do anything except call the
  operator API (``<ns>.admin.*``) of any namespace.
- the **admin** identity (operators, the ``nats`` CLI) may do anything.

The server's refusals are in its log; :func:`parse_refusal` turns such a line
into a security event (the auth sync publishes it on the metrics stream).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from joynexus.broker.subjects import API, INFER, Names

#: bcrypt cost: each connection's password check costs ~2^cost hash rounds on the server.
BCRYPT_ROUNDS = 10


def tenant_permissions(names: Names, tenant_id: str) -> dict[str, Any]:
    ns = names.namespace
    return {
        "publish": {"allow": [f"{ns}.{API}.{tenant_id}.*", f"{ns}.{INFER}.*.{tenant_id}"]},
        "subscribe": {"allow": [f"{names.inbox_prefix(tenant_id)}.>"]},
    }


def service_permissions() -> dict[str, Any]:
    """Everything but the operator API of any deployment namespace on the server."""
    return {
        "publish": {"allow": [">"], "deny": ["*.admin.>"]},
        "subscribe": {"allow": [">"]},
    }


def new_password() -> str:
    return secrets.token_urlsafe(24)


def hash_password(password: str) -> str:
    """bcrypt hash, as nats-server accepts in place of a password (service extra)."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()


@dataclass(frozen=True)
class User:
    user: str
    password_hash: str
    permissions: dict[str, Any] | None = None


def render_authorization(users: list[User]) -> str:
    """An ``authorization`` block for nats-server's config (its format accepts JSON values)."""
    lines = []
    for u in users:
        entry: dict[str, Any] = {"user": u.user, "password": u.password_hash}
        if u.permissions is not None:
            entry["permissions"] = u.permissions
        lines.append("    " + json.dumps(entry))
    return (
        "# Written by joynexus (the auth sync of the server's owner); do not edit:\n"
        "# `joynexus tenant add/rm` change it through the control plane.\n"
        "authorization {\n  users = [\n" + "\n".join(lines) + "\n  ]\n}\n"
    )


# nats-server 2.15 log lines, e.g.
#   [ERR] 127.0.0.1:52604 - cid:6 - "v2.16.0:python3" - "$G/user:jnx.acme" - Publish Violation - Subject "jnx.api.bob.x"
#   [ERR] ... - "$G/user:jnx.acme" - Subscription Violation - Subject "jnx.job.bob.>", SID 2
#   [ERR] 127.0.0.1:52612 - cid:7 - authentication error - User "jnx.acme"
_VIOLATION = re.compile(r'/user:([^"\s]+)" - (Publish|Subscription) Violation - Subject "([^"]*)"')
_AUTH_ERROR = re.compile(r'authentication error - User "([^"]*)"')


@dataclass(frozen=True)
class Refusal:
    user: str
    #: publish, subscribe or connect
    action: str
    subject: str
    reason: str

    def tenant(self, names: Names) -> str:
        """The tenant behind the user, or ``_`` for a non-tenant user."""
        prefix = f"{names.namespace}."
        return self.user[len(prefix) :] if self.user.startswith(prefix) else "_"


def parse_refusal(line: str) -> Refusal | None:
    m = _VIOLATION.search(line)
    if m:
        user, kind, subject = m.groups()
        action = "publish" if kind == "Publish" else "subscribe"
        return Refusal(user, action, subject, f"{kind.lower()} permission violation")
    m = _AUTH_ERROR.search(line)
    if m:
        return Refusal(m.group(1), "connect", "", "authentication failed (wrong or revoked credentials)")
    return None
