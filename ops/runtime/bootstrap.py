"""The service's identities on an embedded server: generated once, rendered into ``auth.conf``.

:func:`bootstrap` makes the admin, service, control, responder and system
credentials of a data dir (owner-only files under ``<data-dir>/credentials/``)
the first time and writes an ``auth.conf`` holding at least them;
:func:`write_auth` renders the bootstrap users and every tenant user (with its
deployment's permissions) into it, the system account's user first (it reads
the server's connections: :mod:`.conncap`); :func:`secured_server` is an
embedded server that includes that file. The auth sync (:mod:`.authsync`)
rewrites it as tenants come and go. See docs/ARCHITECTURE.md, "Tenants fenced
by the broker".
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from joynexus.broker.credentials import Credentials
from joynexus.broker.permissions import (
    User,
    hash_password,
    new_password,
    render_authorization,
    responder_permissions,
    service_permissions,
    tenant_permissions,
)
from joynexus.broker.subjects import Names
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.identities import TenantIdentity

AUTH_FILE = "auth.conf"
CREDS_DIR = "credentials"


def credentials_path(data_dir: str | os.PathLike[str], kind: str) -> Path:
    return Path(data_dir) / CREDS_DIR / f"{kind}.json"


def bootstrap(
    data_dir: str | os.PathLike[str], names: Names, *, ca_file: str | None = None
) -> tuple[Credentials, Credentials]:
    """The (admin, service) credentials of this data dir, generated on first use
    (with the control plane's ``control.json`` and the responder identity that
    the service and control files carry), and an ``auth.conf`` holding at least them."""
    creds = {
        kind: load_or_make(data_dir, kind, user, names, ca_file)
        for kind, user in (
            ("admin", names.admin_user),
            ("responder", names.responder_user),
            ("service", names.service_user),
            ("control", names.control_user),
            ("system", system_user(names)),
        )
    }
    admin, service = creds["admin"], creds["service"]
    conf = Path(data_dir) / AUTH_FILE
    if not conf.exists() or not has_all(conf, creds.values()):
        write_auth(conf, names, admin, service, [])
    return admin, service


def system_user(names: Names) -> str:
    """The server's system-account user (reads its connections: :mod:`.conncap`)."""
    return f"{names.namespace}-system"


def has_all(conf: Path, creds: Any) -> bool:
    """An auth.conf written before an identity existed (an older data dir) is rewritten."""
    text = conf.read_text()
    return all(f'"{c.user}"' in text for c in creds)


def load_or_make(
    data_dir: str | os.PathLike[str], kind: str, user: str, names: Names, ca_file: str | None
) -> Credentials:
    path = credentials_path(data_dir, kind)
    responder = None
    if kind in ("service", "control"):
        responder = load_or_make(data_dir, "responder", names.responder_user, names, ca_file)
    if path.exists():
        creds = Credentials.load(path)
        changed = creds
        if ca_file and creds.ca_file != ca_file:  # TLS turned on since: trust its CA
            changed = dataclasses.replace(changed, ca_file=ca_file)
        if responder is not None and creds.responder_user != responder.user:
            changed = dataclasses.replace(changed, responder_user=responder.user,
                                          responder_password=responder.password)
        if changed != creds:
            changed.save(path)
        return changed
    creds = Credentials(
        kind=kind,  # type: ignore[arg-type]
        user=user,
        password=new_password(),
        namespace=names.namespace,
        ca_file=ca_file,
        responder_user=responder.user if responder else None,
        responder_password=responder.password if responder else None,
    )
    creds.save(path)
    return creds


def bootstrap_users(names: Names, admin: Credentials, service: Credentials,
                     namespaces: list[str], creds_dir: Path) -> list[User]:
    assert admin.user and admin.password and service.user and service.password
    users = [
        User(admin.user, hash_cached(admin.password)),
        User(service.user, hash_cached(service.password), service_permissions(namespaces)),
    ]
    for kind, perms in (
        ("control", service_permissions(namespaces, control=True)),
        ("responder", responder_permissions()),
    ):
        path = creds_dir / f"{kind}.json"
        if path.exists():
            c = Credentials.load(path)
            assert c.user and c.password
            users.append(User(c.user, hash_cached(c.password), perms))
    return users


hashes_seen: dict[str, str] = {}


def hash_cached(password: str) -> str:
    if password not in hashes_seen:
        hashes_seen[password] = hash_password(password)
    return hashes_seen[password]


def write_auth(
    path: Path,
    names: Names,
    admin: Credentials,
    service: Credentials,
    tenants: list[tuple[TenantIdentity, Names]],
    namespaces: list[str] | None = None,
) -> None:
    """auth.conf: the bootstrap users, then each tenant user with the permissions
    of its deployment's namespace."""
    spaces = sorted({names.namespace, *(ns.namespace for _, ns in tenants), *(namespaces or [])})
    users = bootstrap_users(names, admin, service, spaces, path.parent / CREDS_DIR) + [
        User(t.user, t.password_hash, tenant_permissions(ns, t.tenant_id))
        for t, ns in sorted(tenants, key=lambda x: x[0].user)
    ]
    system = None
    sys_path = path.parent / CREDS_DIR / "system.json"
    if sys_path.exists():
        c = Credentials.load(sys_path)
        assert c.user and c.password
        system = User(c.user, hash_cached(c.password))
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render_authorization(users, system))
    os.replace(tmp, path)


def secured_server(
    data_dir: str | os.PathLike[str], names: Names, **server_kw: Any
) -> tuple[EmbeddedNats, Credentials, Credentials]:
    """An embedded server (not started yet) with authorization on, and the
    (admin, service) credentials to reach it."""
    tls = server_kw.get("tls")
    admin, service = bootstrap(data_dir, names, ca_file=getattr(tls, "ca_file", None))
    server = EmbeddedNats(data_dir, auth_include=AUTH_FILE, **server_kw)
    return server, admin, service


__all__ = ["AUTH_FILE", "CREDS_DIR", "bootstrap", "bootstrap_users", "credentials_path", "has_all",
           "hash_cached", "load_or_make", "secured_server", "system_user", "write_auth"]
