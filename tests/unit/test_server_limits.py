"""The embedded server's per-client bounds: defaults, environment overrides, and
what reaches its config file (no server is started: the text is what it reads)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from joynexus.ops.runtime.natsconfig import ServerLimits
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.errors import JoyNexusError

MiB = 1024 * 1024


def test_max_payload_defaults_to_2_mib_and_reaches_the_config(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path, limits=ServerLimits())
    assert server.max_payload == 2 * MiB
    assert f"max_payload: {2 * MiB}\n" in server.render_config()


def test_max_payload_from_the_environment() -> None:
    limits = ServerLimits.from_env({"JOYNEXUS_NATS_MAX_PAYLOAD": str(8 * MiB)})
    assert limits.max_payload == 8 * MiB
    assert limits.max_connections == ServerLimits().max_connections  # the rest untouched
    with pytest.raises(JoyNexusError, match="JOYNEXUS_NATS_MAX_PAYLOAD"):
        ServerLimits.from_env({"JOYNEXUS_NATS_MAX_PAYLOAD": "eight"})


@pytest.mark.parametrize(("given", "limit", "line"), [
    (4 * MiB, 2 * MiB, f"max_payload: {4 * MiB}\n"),  # the argument wins over the limits
    (None, 8 * MiB, f"max_payload: {8 * MiB}\n"),
    (0, 2 * MiB, None),  # 0: left out, the server's own default
])
def test_an_explicit_max_payload_overrides_the_limits(
    tmp_path: Path, given: int | None, limit: int, line: str | None
) -> None:
    server = EmbeddedNats(tmp_path, max_payload=given, limits=ServerLimits(max_payload=limit))
    text = server.render_config()
    if line is None:
        assert not re.search(r"^max_payload:", text, re.M)  # (tmp_path names the test)
    else:
        assert line in text


def test_max_pending_is_raised_to_max_payload(tmp_path: Path) -> None:
    """nats-server refuses a max_payload above max_pending."""
    server = EmbeddedNats(tmp_path, limits=ServerLimits(max_payload=8 * MiB, max_pending=MiB))
    assert f"max_pending: {8 * MiB}\n" in server.render_config()
