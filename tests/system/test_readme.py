"""The README's tenant snippet, run as written against a real deployment started by
the README's own commands: `joynexus up`, `joynexus tenant add acme`, and a LeRobot
dataset "pick" in acme's dataset space made by `joynexus dataset generate`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A tenant's view"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, env: dict[str, str], timeout: float = 600) -> str:
    r = subprocess.run([sys.executable, "-m", "joynexus.ops.cli", *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"joynexus {' '.join(args)}: {r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Path]:
    """`joynexus up` with acme's credentials in tmp_path/acme.json and its dataset "pick"."""
    env = {**os.environ, "JOYNEXUS_DATASETS": str(tmp_path / "datasets")}
    cli("dataset", "generate", "PickCube-v1", "--episodes", "8", "--json",
        "--out", str(tmp_path / "datasets" / "acme" / "pick"), env=env)
    port = free_port()
    data = tmp_path / "jnx"
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "joynexus.ops.cli", "up", "--data-dir",
                               str(data), "--port", str(port), "--gateway-port", "0"],
                              env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while "deployment up" not in log_path.read_text():
            assert up.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "joynexus up did not come up within 300 s"
            time.sleep(0.5)
        cli("tenant", "add", "acme", "--nats", f"nats://127.0.0.1:{port}", "--data-dir",
            str(data), "--out", str(tmp_path / "acme.json"), env=env)
        yield tmp_path
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


async def test_the_readme_tenant_snippet_runs_as_written(
    deployment: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(deployment)  # the snippet names acme.json, first.mp4, acme_head/
    scope: dict[str, Any] = {}
    exec("async def snippet():\n" + textwrap.indent(readme_snippet(), "    ")
         + "\n    return locals()\n", scope)
    done = await scope["snippet"]()
    try:
        sft, report, history = done["sft"], done["report"], done["history"]
        assert sft.record.state == "done" and sft.record.result["completed"] == 50.0
        assert sft.record.result["last_version"] >= 51.0
        assert report["episodes"] == 20.0 and 0.0 <= report["success_rate"] <= 1.0
        assert isinstance(history, list)  # no eval_every: nothing periodic yet
        assert (deployment / "first.mp4").stat().st_size > 1000
        assert (deployment / "acme_head" / "head.safetensors").exists()
        assert (deployment / "acme_head" / "manifest.json").exists()
    finally:
        await done["client"].close()
