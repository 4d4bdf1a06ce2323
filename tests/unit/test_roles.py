"""The role registry (ops/runtime/roles.py) is the one list of roles: what `joynexus agent`
accepts, what `joynexus up` starts and in which order, what each loads first."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from joynexus.ops.cli import build_parser
from joynexus.ops.runtime.launcher import role_command
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES, REGISTRY, ROLES, by_name


def test_every_role_names_importable_modules_and_a_coroutine_runner() -> None:
    for role in REGISTRY.values():
        assert inspect.iscoroutinefunction(role.run), role.name
        for module in role.imports:
            importlib.import_module(module)


def test_up_starts_the_scheduler_first_and_only_supervised_roles_in_one_order() -> None:
    orders = [r.up_order for r in REGISTRY.values() if r.up_order is not None]
    assert len(orders) == len(set(orders)), "two roles share a place in `joynexus up`"
    assert DEPLOYMENT_ROLES[0] == "scheduler"
    assert all(REGISTRY[r].supervised for r in DEPLOYMENT_ROLES)
    assert "health" not in DEPLOYMENT_ROLES and "env-worker" not in DEPLOYMENT_ROLES
    assert set(DEPLOYMENT_ROLES) <= set(ROLES) and ROLES == tuple(REGISTRY)


def test_an_unknown_role_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError, match="roles are"):
        by_name("sheduler")
    assert by_name("actor") is REGISTRY["actor"]


def test_only_the_checkpoint_writer_gets_out() -> None:
    for name, role in REGISTRY.items():
        cmd = role_command(name, "nats://x", "jnx", instance=f"{name}-0", out_dir=Path("/d/actor"))
        assert ("--out" in cmd) is role.writes_checkpoints, name
        assert cmd[cmd.index("--data-dir") + 1] == "/d"


def test_agent_command_accepts_exactly_the_registry() -> None:
    parser = build_parser()
    for name in ROLES:
        assert parser.parse_args(["agent", name, "--nats", "nats://x"]).role == name
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "nope", "--nats", "nats://x"])
