"""The isolation bench's deployment options reach the agent processes it starts."""

from __future__ import annotations

from pathlib import Path

from joynexus.broker.credentials import Credentials
from joynexus.ops.cli.app import build_parser
from joynexus.ops.isolation.processes import AgentProcesses
from joynexus.schemas.inference import DEFAULT_MAX_ROWS


def procs(tmp_path: Path, **kw: int) -> AgentProcesses:
    who = Credentials(user="svc", password="pw")
    return AgentProcesses("nats://127.0.0.1:4222", "jnx", tmp_path, service=who, control=who,
                          datasets_root=tmp_path / "datasets", **kw)


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_inference_engine_gets_the_benchs_batch_rows(tmp_path: Path) -> None:
    assert option(procs(tmp_path).command("inference"), "--max-rows") == str(DEFAULT_MAX_ROWS)
    assert option(procs(tmp_path, max_rows=8).command("inference"), "--max-rows") == "8"
    assert "--max-rows" not in procs(tmp_path, max_rows=8).command("control")
    args = build_parser().parse_args(["bench", "isolation", "--max-rows", "8", "--json"])
    assert args.max_rows == 8
    assert build_parser().parse_args(["bench", "isolation"]).max_rows == DEFAULT_MAX_ROWS
