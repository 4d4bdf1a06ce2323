"""Who connects: a NATS identity plus how to reach the server, in one file.

With authorization on, every connection authenticates with one of these: a
tenant's (the control plane issued it; its connection must use the inbox
prefix ``_INBOX.<ns>.<tenant>``) or a service-side identity generated into
``<data-dir>/credentials/``. A file is JSON, readable by its owner only
(mode 0600)::

    {"kind": "tenant", "tenant": "acme", "namespace": "jnx",
     "url": "nats://127.0.0.1:4222", "user": "jnx.acme", "password": "...",
     "ca_file": null}

It needs only the base install, because the SDK uses it.
See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from joynexus.schemas.errors import InvalidSpec

Kind = Literal["tenant", "service", "control", "responder", "admin", "system"]

#: Environment variable naming a credentials file, used when no --creds is given.
CREDS_ENV = "JOYNEXUS_CREDS"


@dataclass(frozen=True)
class Credentials:
    """How one identity authenticates to NATS (user/password, token or a NATS
    creds file) and, with TLS, which CA it trusts (``ca_file``) and which
    client certificate it shows (``cert_file``/``key_file``)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    #: Filled in from a credentials file: who this is and where to connect.
    kind: Kind | None = None
    tenant: str | None = None
    namespace: str | None = None
    url: str | None = None
    #: Agents that serve requests (control plane, inference engines) answer on a
    #: second connection as the responder identity, which may publish to inboxes only.
    responder_user: str | None = None
    responder_password: str | None = None

    def responder(self) -> Credentials | None:
        """The responder identity carried by a service/control file, if any."""
        if not self.responder_user:
            return None
        return replace(self, kind="responder", user=self.responder_user,
                       password=self.responder_password, responder_user=None,
                       responder_password=None)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (and :meth:`Broker.connect`)."""
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts["user"], opts["password"] = self.user, self.password
        if self.token is not None:
            opts["token"] = self.token
        if self.creds_file is not None:
            opts["user_credentials"] = self.creds_file
        if self.ca_file or self.cert_file:
            opts["tls"] = self.ssl_context()
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    # -- files
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Credentials:
        """Read a credentials file written by ``joynexus tenant add`` or the launcher."""
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise InvalidSpec(f"credentials file {p} does not exist") from e
        except (OSError, ValueError) as e:
            raise InvalidSpec(f"credentials file {p} is not readable JSON: {e}") from e
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if not isinstance(raw, dict) or unknown:
            raise InvalidSpec(f"credentials file {p} has unknown fields {unknown}")
        return cls(**raw)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write owner-only (0600), atomically."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v for k, v in asdict(self).items() if v is not None}, f, indent=2)
            f.write("\n")
        os.replace(tmp, p)
        return p

    def with_url(self, url: str) -> Credentials:
        return replace(self, url=url)


def from_env_or_file(path: str | os.PathLike[str] | None) -> Credentials | None:
    """``path`` if given, else ``$JOYNEXUS_CREDS`` if set, else none (an open server)."""
    chosen = path or os.environ.get(CREDS_ENV)
    return Credentials.load(chosen) if chosen else None
