"""`joynexus up` starts the policy gateway by default: its port is bind-checked before
anything starts (a clear error when taken), 0 picks a free one, and the role's
process gets it through ``$JOYNEXUS_GATEWAY_*``."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from joynexus.ops.cli.up import UP_ROLES, gateway_port
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES


def test_up_starts_the_gateway_by_default() -> None:
    assert UP_ROLES[-1] == "gateway" and "gateway" not in DEPLOYMENT_ROLES
    assert set(DEPLOYMENT_ROLES) < set(UP_ROLES)


def test_a_taken_port_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOYNEXUS_GATEWAY_PORT", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not gateway_port(argparse.Namespace(host="127.0.0.1", gateway_port=port))
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--gateway-port" in err and "--no-gateway" in err
    assert "JOYNEXUS_GATEWAY_PORT" not in os.environ


def test_port_zero_picks_a_free_one_for_the_role(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOYNEXUS_GATEWAY_PORT", "1")
    monkeypatch.setenv("JOYNEXUS_GATEWAY_HOST", "0.0.0.0")
    assert gateway_port(argparse.Namespace(host="127.0.0.1", gateway_port=0))
    port = int(os.environ["JOYNEXUS_GATEWAY_PORT"])
    assert port > 1024 and os.environ["JOYNEXUS_GATEWAY_HOST"] == "127.0.0.1"
    assert f"ws://127.0.0.1:{port}" in capsys.readouterr().out
    with socket.socket() as s:  # and it is free for the role to take
        s.bind(("127.0.0.1", port))


def test_status_shows_where_the_gateway_serves() -> None:
    import msgspec

    from joynexus.ops.admin.status import render
    from joynexus.schemas.health import Heartbeat

    beat = Heartbeat(role="gateway", instance="gateway-0", pid=1, host="h", started_at=0.0,
                     at=0.0, beats=1, interval_s=1.0, address="ws://127.0.0.1:8000")
    other = Heartbeat(role="control", instance="control-0", pid=2, host="h", started_at=0.0,
                      at=0.0, beats=1, interval_s=1.0)
    rows = [{**msgspec.to_builtins(b), "age_s": 0.1} for b in (beat, other)]
    text = render({"namespace": "jnx", "streams": {}, "consumers": {}, "agents": {"heartbeats": rows, "managers": []}})
    assert "gateway gateway-0 serves at ws://127.0.0.1:8000" in text
    assert "control-0 serves" not in text
    # an older beat, without the field, still decodes
    old = msgspec.json.encode({k: v for k, v in msgspec.to_builtins(other).items()
                               if k != "address"})
    assert msgspec.json.decode(old, type=Heartbeat).address == ""
