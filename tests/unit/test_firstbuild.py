"""The first env build of each simulator runs alone (agents/envs/firstbuild.py).

Two first builds in two threads (a LIBERO and a ManiSkill evaluation starting
together) once left matplotlib half imported for the whole process; the lock is
shared between simulators, re-entrant, and taken only until a simulator built once.
"""

from __future__ import annotations

import threading
import time

import pytest

from joynexus.agents.envs import firstbuild
from joynexus.agents.envs.firstbuild import first_build_alone


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(firstbuild, "_built", set())


def _overlap(names: list[str]) -> int:
    """The most first builds of ``names`` seen inside the lock at once."""
    inside = 0
    most = 0
    guard = threading.Lock()

    def build(sim: str) -> None:
        nonlocal inside, most
        with first_build_alone(sim):
            with guard:
                inside += 1
                most = max(most, inside)
            time.sleep(0.05)
            with guard:
                inside -= 1

    threads = [threading.Thread(target=build, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return most


def test_first_builds_of_different_simulators_do_not_overlap() -> None:
    assert _overlap(["libero", "maniskill", "libero", "maniskill"]) == 1


def test_later_builds_of_a_built_simulator_take_no_lock() -> None:
    with first_build_alone("maniskill"):
        pass
    assert _overlap(["maniskill"] * 4) > 1  # built once: they run together


def test_a_failed_first_build_leaves_the_next_one_first() -> None:
    with pytest.raises(RuntimeError), first_build_alone("libero"):
        raise RuntimeError("renderer missing")
    assert "libero" not in firstbuild._built
    assert _overlap(["libero", "libero"]) == 1


def test_a_first_build_inside_another_does_not_deadlock() -> None:
    done = threading.Event()

    def nested() -> None:
        with first_build_alone("libero"), first_build_alone("maniskill"):
            done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(5)
    assert done.is_set()
    assert firstbuild._built == {"libero", "maniskill"}
