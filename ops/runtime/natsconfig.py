"""What the embedded nats-server is configured with: TLS files (:class:`TlsFiles`), a
cluster (:class:`ClusterOptions`) and the bounds it puts on each client
(:class:`ServerLimits`, overridable from the environment), and how a value is
written into its config file. :mod:`.natsserver` renders and runs it.

See docs/ARCHITECTURE.md, "Processes".
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from joynexus.schemas.errors import JoyNexusError


def conf_quote(value: str) -> str:
    """A double-quoted string for the nats-server config (JSON escapes are accepted)."""
    return json.dumps(value)


def abs_path(path: str) -> str:
    return os.path.abspath(os.fspath(path))


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS listener.

    Relative paths are taken against the current directory of this process
    (they are made absolute in the config). ``ca_file`` verifies peers'
    certificates; ``verify_clients`` makes the client listener demand one.
    """

    cert_file: str
    key_file: str
    ca_file: str | None = None
    verify_clients: bool = False


@dataclass(frozen=True)
class ClusterOptions:
    """A ``cluster {}`` block: the route listener and the routes to other nodes.

    ``routes`` are URLs such as another node's :attr:`EmbeddedNats.route_url`
    (``nats-route://host:port``; nats-server uses that scheme with and without
    TLS on routes). With ``tls`` the routes use TLS; when it has a ``ca_file``
    the nodes also verify each other's certificates against it (``verify: true``).
    """

    name: str
    host: str = "127.0.0.1"
    port: int = -1
    routes: tuple[str, ...] = ()
    tls: TlsFiles | None = None


#: Environment overrides of :class:`ServerLimits` (``JOYNEXUS_NATS_MAX_CONNECTIONS=...``).
LIMITS_ENV_PREFIX = "JOYNEXUS_NATS_"


@dataclass(frozen=True)
class ServerLimits:
    """Bounds nats-server puts on each client, so that one tenant (or anyone who
    reaches the port) cannot exhaust the server. The defaults leave room for a
    deployment of a few dozen agents and tenants many times over; each can be
    overridden per server (``EmbeddedNats(limits=...)``) or by the environment
    (``JOYNEXUS_NATS_<FIELD>``, e.g. ``JOYNEXUS_NATS_MAX_CONNECTIONS=10000``, read
    by :meth:`from_env`, which is what an ``EmbeddedNats`` without ``limits``
    uses). ``0`` leaves a bound out of the config (the server's default).

    Not here: the authentication timeout, which nats-server takes only inside the
    ``authorization {}`` block (``timeout``, default 2 s; the included
    ``auth.conf`` writes that block), and the cost of a wrong password (bcrypt's
    cost factor of the hashes, ``broker.permissions.BCRYPT_ROUNDS``).
    """

    #: The largest message a client may publish (server default 1 MiB). It is the unit
    #: of head-of-line blocking on every shared connection: an engine or the control
    #: plane reads a message whole, in order, before the next tenant's request behind
    #: it, even one it then refuses. At 8 MiB three refused requests of one tenant held
    #: another's 1-row ``act`` up by 13-60 ms on a 2-core machine (``bench isolation``,
    #: attack ``quotas``). Everything larger travels in parts (Training Queue chunks,
    #: ``put_data``, weights and video slices), so 2 MiB only costs more messages.
    max_payload: int = 2 * 1024 * 1024
    #: Client connections the server accepts at once (server default 65536).
    #: Every agent, SDK client and CLI call holds one or a few; 4096 is two
    #: orders of magnitude above a few dozen agents and tenants, and well under
    #: the file descriptors a server gets.
    max_connections: int = 4096
    #: Subscriptions one connection may hold (server default: unlimited). A
    #: client needs a handful (its inbox, KV watchers, consumers, service
    #: endpoints; the control and inference planes one per endpoint and tenant);
    #: an unbounded number costs the server memory and interest propagation.
    max_subscriptions: int = 16384
    #: Bytes the server buffers for one slow client before it cuts it off as a
    #: slow consumer (server default 64 MiB). At least a few ``max_payload``
    #: messages (Training Queue chunks are up to ``max_payload``) must fit, and so must a
    #: burst of requests one tenant sends to the shared request servers while
    #: their (Python) reader is busy: 190 requests of 1 MiB cut the control
    #: plane's responder off at 64 MiB on a loaded 2-core machine. It is only
    #: memory while a client lags; a tenant that sends more in one burst still
    #: gets the request servers cut off and reconnected (the full fix is a NATS
    #: account per tenant with its own max_payload; see ARCHITECTURE).
    max_pending: int = 256 * 1024 * 1024
    #: The longest protocol line (``PUB <subject> <reply> <size>``, ``CONNECT
    #: {...}``) a client may send (server default 4096 bytes): bounds subjects
    #: and the connect JSON (a user name, a password) an attacker can send.
    max_control_line: int = 4096
    #: Seconds a write to a client may block before the server drops it (server
    #: default 10 s): a client that stops reading cannot hold server memory.
    write_deadline_s: float = 10.0
    #: Seconds between the server's pings, and unanswered pings before it closes
    #: a connection (server defaults 2 min, 2): dead peers are reclaimed.
    ping_interval_s: float = 120.0
    ping_max: int = 2
    #: Bytes of file storage JetStream may reserve and use (``max_file_store``; 0:
    #: the server's default, 75% of the store disk's free space when it starts).
    #: Streams reserve their ``max_bytes`` when made (the Training Queue 8 GiB, the
    #: metrics 1 GiB: ``broker.layout.LayoutOptions``), so a store too small for a
    #: deployment's layout is refused with "insufficient storage resources".
    max_file_store: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerLimits:
        """The defaults, each overridden by ``JOYNEXUS_NATS_<FIELD>`` when set."""
        env = os.environ if environ is None else environ
        kw: dict[str, int | float] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(LIMITS_ENV_PREFIX + f.name.upper())
            if raw is None or raw.strip() == "":
                continue
            try:
                kw[f.name] = float(raw) if f.name.endswith("_s") else int(raw)
            except ValueError as e:
                raise JoyNexusError(
                    f"{LIMITS_ENV_PREFIX}{f.name.upper()}={raw!r} is not a number"
                ) from e
            if kw[f.name] < 0:
                raise JoyNexusError(f"{LIMITS_ENV_PREFIX}{f.name.upper()} must be >= 0")
        return cls(**kw)  # type: ignore[arg-type]

    def render(self) -> str:
        """The top-level config lines of the bounds (those not 0; ``max_file_store``
        goes in the ``jetstream`` block, and ``max_payload`` is written by
        ``EmbeddedNats``, which may be given another)."""
        lines = []
        for key, value in (
            ("max_connections", self.max_connections),
            ("max_subscriptions", self.max_subscriptions),
            ("max_pending", self.max_pending),
            ("max_control_line", self.max_control_line),
            ("ping_max", self.ping_max),
        ):
            if value:
                lines.append(f"{key}: {int(value)}")
        for key, secs in (("write_deadline", self.write_deadline_s),
                          ("ping_interval", self.ping_interval_s)):
            if secs:
                lines.append(f"{key}: {conf_quote(f'{secs:g}s')}")
        return "".join(line + "\n" for line in lines)


__all__ = ["LIMITS_ENV_PREFIX", "ClusterOptions", "ServerLimits", "TlsFiles", "abs_path", "conf_quote"]
