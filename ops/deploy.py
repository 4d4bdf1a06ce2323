"""Where a command's NATS comes from: ``--nats URL``, or an embedded server."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from joynexus.ops.natsserver import EmbeddedNats


@contextlib.contextmanager
def nats_url(
    url: str | None, data_dir: str | Path | None = None, *, quiet: bool = False
) -> Iterator[str]:
    """Yield ``url`` as given, or start an embedded nats-server (JetStream,
    file store under ``data_dir``, a temporary one if None) and stop it after."""
    if url:
        yield url
        return
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jnx-nats-"))
        server = stack.enter_context(EmbeddedNats(data_dir))
        if not quiet:
            import sys

            print(f"embedded nats-server at {server.url} (store: {data_dir})", file=sys.stderr)
        yield server.url
