"""Children started through :func:`dying_with_parent` die with their parent, both
through setpriv (no preexec_fn: vfork) and through the preexec_fn fallback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from joynexus.agents.procs import _SETPRIV, dying_with_parent

# The parent: starts `sleep 60` the way the agents do, prints its pid, and waits.
PARENT = """
import subprocess, sys, time
from joynexus.agents.procs import dying_with_parent
argv, pre = dying_with_parent(["sleep", "60"], setpriv={setpriv!r})
assert (pre is None) == ({setpriv!r} is not None)
p = subprocess.Popen(argv, preexec_fn=pre)
print(p.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("setpriv", [_SETPRIV, None], ids=["setpriv", "preexec_fn"])
def test_the_child_dies_with_its_parent(setpriv: str | None) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(setpriv=setpriv)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # The child is the command itself (setpriv exec'd it: same pid, no wrapper left).
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, "the child never became `sleep`"
            time.sleep(0.02)
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)  # no cleanup code of the parent's runs
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, f"child {child} outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_without_setpriv_the_command_is_unchanged() -> None:
    argv, pre = dying_with_parent(["a", "b"], setpriv=None)
    assert argv == ["a", "b"] and pre is not None
    argv, pre = dying_with_parent(["a", "b"], setpriv="/usr/bin/setpriv")
    assert argv == ["/usr/bin/setpriv", "--pdeathsig", "TERM", "--", "a", "b"] and pre is None
