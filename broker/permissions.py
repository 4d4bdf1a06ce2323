"""What each identity may do on the broker, as nats-server authorization.

The broker, not the agents' good manners, fences tenants: a tenant may
publish only to its own API and inference subjects and read only its own
inbox; the service, control, responder and admin identities get exactly the
rights their job needs (the responder only inboxes, so a reply subject a
tenant names reaches nothing else even if a check in the code were missed).
:func:`parse_refusal` turns a refusal line of the server's log into a
security event.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker" (every identity's rights).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from joynexus.broker.natsapi import (
    ALL_ADMIN_INBOXES,
    ALL_INBOXES,
    ALL_JS_ACKS,
    ALL_JS_API,
    ALL_JS_FLOW_CONTROL,
    ALL_KV,
    ALL_OBJECTS,
    ALL_SERVICES,
    kv_stream,
    kv_subject,
    stream_api,
)
from joynexus.broker.subjects import (
    ADMIN,
    API,
    APIKEY_KEYS,
    INFER,
    JOB,
    LEASE,
    METRICS,
    SCHED,
    SVC_INFER,
    TQ,
    Names,
    any_namespace,
)

#: bcrypt cost: each connection's password check costs ~2^cost hash rounds on the
#: server. The minimum (4): every password is 144 random bits (new_password), which
#: no key stretching makes harder to guess, while cost 10 let 300 wrong-password
#: logins take 32 s of the server's CPU.
BCRYPT_ROUNDS = 4


def tenant_permissions(names: Names, tenant_id: str) -> dict[str, Any]:
    return {
        "publish": {"allow": [names.api(tenant_id, "*"), names.tenant_infer(tenant_id)]},
        "subscribe": {"allow": [f"{names.inbox_prefix(tenant_id)}.>"]},
    }


#: Subject tokens after a namespace that the service publishes on.
_SERVICE_TOKENS = (JOB, TQ, SCHED, METRICS, INFER, SVC_INFER, API, LEASE)


def service_permissions(namespaces: list[str] | tuple[str, ...] = ("jnx",), *,
                        control: bool = False) -> dict[str, Any]:
    """What the agents may publish: a list, not "everything but admin". With
    ``control`` (the control plane's identity) also the identities buckets."""
    allow = [
        ALL_JS_API,  # JetStream: streams, consumers, KV and object store management
        ALL_JS_ACKS,  # acks (nats-py publishes them to the message's reply subject)
        ALL_JS_FLOW_CONTROL,  # flow-control replies of push consumers
        ALL_KV,
        ALL_OBJECTS,
        ALL_INBOXES,
        ALL_SERVICES,
        *(any_namespace(tok) for tok in _SERVICE_TOKENS),
    ]
    deny = [any_namespace(ADMIN), stream_api("DELETE", ">")]
    for ns in sorted(set(namespaces)):
        n = Names(ns)
        deny += [stream_api("PURGE", n.jobs_stream), stream_api("MSG.DELETE", n.jobs_stream)]
        if not control:
            ids = n.identities_bucket
            deny += [kv_subject(ids, ">"), stream_api("PURGE", kv_stream(ids)),
                     stream_api("MSG.DELETE", kv_stream(ids))]
            keys = n.apikeys_bucket  # the gateway writes last use only, never a key
            deny += [kv_subject(keys, APIKEY_KEYS + ">"), stream_api("PURGE", kv_stream(keys)),
                     stream_api("MSG.DELETE", kv_stream(keys))]
    return {
        "publish": {"allow": allow, "deny": deny},
        "subscribe": {"allow": [">"], "deny": [ALL_ADMIN_INBOXES]},
    }


def responder_permissions() -> dict[str, Any]:
    """The request servers' answering connection: inboxes only."""
    return {
        "publish": {"allow": [ALL_INBOXES]},
        "subscribe": {
            "allow": [any_namespace(API, "*.*"), any_namespace(ADMIN, "*"),
                      any_namespace(INFER, "*.*"), any_namespace(SVC_INFER, "*.*"),
                      ALL_SERVICES, ALL_INBOXES],
            "deny": [ALL_ADMIN_INBOXES],
        },
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


def render_authorization(users: list[User], system: User | None = None) -> str:
    """An ``authorization`` block for nats-server's config (its format accepts JSON
    values); with ``system``, first the system account ``SYS`` holding that one user
    (it reads the server's connections and closes those over a tenant's cap)."""
    lines = []
    for u in users:
        entry: dict[str, Any] = {"user": u.user, "password": u.password_hash}
        if u.permissions is not None:
            entry["permissions"] = u.permissions
        lines.append("    " + json.dumps(entry))
    sys_block = ""
    if system is not None:
        sys_user = json.dumps({"user": system.user, "password": system.password_hash})
        sys_block = (f"accounts {{\n  SYS {{\n    users = [\n      {sys_user}\n    ]\n  }}\n}}\n"
                     "system_account: SYS\n")
    return (
        "# Written by joynexus (the auth sync of the server's owner); do not edit:\n"
        "# `joynexus tenant add/rm` change it through the control plane.\n"
        + sys_block
        + "authorization {\n  users = [\n" + "\n".join(lines) + "\n  ]\n}\n"
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
        prefix = names.tenant_user("")
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
