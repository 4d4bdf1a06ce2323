"""The `joynexus` command as a user runs it: help, demo, benchmarks, status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from joynexus.ops.cli import build_parser

JNX = [sys.executable, "-m", "joynexus.ops.cli"]


def nats_servers(under: Path) -> set[int]:
    """The nats-server processes whose command line names a path below ``under``
    (other test sessions' servers on the machine come and go meanwhile)."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "nats-server":
                    continue
                if str(under) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    out.add(int(pid))
            except OSError:
                pass
    return out


def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*JNX, *args], capture_output=True, text=True, timeout=timeout)


def subcommands() -> list[list[str]]:
    parser = build_parser()
    out = []
    for name, sp in parser._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        out.append([name])
        for action in sp._actions:
            if getattr(action, "choices", None) and isinstance(action.choices, dict):
                out += [[name, sub] for sub in action.choices]
    return out


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Walked in-process (one parser, no interpreter per command)."""
    from joynexus.ops.cli import main

    cmds = subcommands()
    assert len(cmds) > 10
    for cmd in cmds:
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0, cmd
        assert f"usage: joynexus {' '.join(cmd)}" in out and len(out) > 80, (cmd, out)


def test_the_installed_command_prints_help() -> None:
    r = run("--help", timeout=60)
    assert r.returncode == 0 and "usage: joynexus" in r.stdout and "demo" in r.stdout


def test_demo_runs_and_reports_every_job_terminal(tmp_path: Path) -> None:
    r = run(
        "demo", "--synthetic", "--seconds", "3", "--json", "--data-dir", str(tmp_path),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["tq_bytes_left"] == 0
    for tenant in ("acme", "bolt", "cora"):
        t = summary["tenants"][tenant]
        assert t.get("completed", 0) > 0
        assert not {k for k in t if k not in ("task", "version", "completed", "dropped", "failed")}
    assert summary["tenants"]["acme"]["version"] == summary["tenants"]["acme"]["completed"]
    assert summary["example_trail"][0].startswith("reserved")
    assert (tmp_path / "nats-server.conf").exists()  # the server was started with this store
    assert not nats_servers(tmp_path)  # the embedded server is gone


def test_bench_scheduler_prints_the_figures() -> None:
    r = run("bench", "scheduler", "--seconds", "2", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["lifecycles_per_s"] > 0 and out["lifecycles"] > 0
    assert 0 < out["transition_p50_ms"] <= out["transition_p99_ms"]


def test_bench_tq_prints_the_figures() -> None:
    r = run("bench", "tq", "--seconds", "2", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["put_mb_s"] > 0 and out["get_mb_s"] > 0 and out["sizes_mb"] == [1, 2, 4, 8]


def test_status_says_clearly_when_no_scheduler_runs(nats_server) -> None:
    r = run("status", "--nats", nats_server.url, "--namespace", "nobody", timeout=60)
    assert r.returncode == 1
    assert "scheduler: UNAVAILABLE" in r.stdout and "joynexus agent scheduler" in r.stdout


def test_agent_without_server_fails_with_a_clear_error() -> None:
    r = run("agent", "scheduler", "--nats", "nats://127.0.0.1:1", timeout=60)
    assert r.returncode == 2
    assert "cannot connect to NATS at nats://127.0.0.1:1" in r.stderr
