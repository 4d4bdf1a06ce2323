"""``joynexus up``: one OS process per agent role, supervised by the health manager.

Each role is ``python -m joynexus.ops.cli agent <role> --instance <role>-0``,
exactly what an operator would run on separate machines; which roles, in
what order and with which arguments comes from the registry in
:mod:`joynexus.ops.runtime.roles`. The launcher process is the health manager in
supervise mode: it restarts a failed role in place within its restart budget,
and prints "deployment up" only once every role beats and the request servers
answer. Ctrl-C stops the roles (SIGTERM: they drain and stop; SIGKILL after a
grace period).

See docs/ARCHITECTURE.md, "Processes" and "Health: heartbeats and in-place restarts".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from joynexus.broker.natsapi import service_api
from joynexus.broker.tasks import cancel_and_wait
from joynexus.ops.runtime.roles import REGISTRY, ROLES, by_name
from joynexus.schemas.catalog import FAMILY_SIZES


def role_command(
    name: str,
    url: str,
    namespace: str,
    *,
    instance: str,
    out_dir: Path,
    extra: list[str] | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "joynexus.ops.cli",
        "agent",
        name,
        "--nats",
        url,
        "--namespace",
        namespace,
        "--instance",
        instance,
    ]
    if by_name(name).writes_checkpoints:
        cmd += ["--out", str(out_dir)]
    # Local output (traces, monitor data) beside the checkpoints: <data-dir>/actor.
    cmd += ["--data-dir", str(out_dir.parent)]
    return cmd + list(extra or [])


def role_slots(
    url: str,
    namespace: str,
    roles: list[str],
    *,
    out_dir: Path,
    extra: Mapping[str, list[str]] | None = None,
    env: Mapping[str, str] | None = None,
    host_id: str | None = None,
) -> list[object]:
    """One :class:`RoleSlot` per role, ``extra`` args by role. Instances are
    ``<role>-0`` on a single host; with ``host_id`` (several hosts share the
    deployment) ``<role>-<host_id>``, and the roles get ``JOYNEXUS_HOST_ID``
    (the scheduler's lease names its holder by it)."""
    from joynexus.agents.health import RoleSlot
    from joynexus.ops.runtime.deploy import role_env
    from joynexus.ops.runtime.threads import role_thread_env

    extra = extra or {}
    suffix = host_id or "0"
    host_env = {"JOYNEXUS_HOST_ID": host_id} if host_id else {}
    return [
        RoleSlot(
            role=r,
            instance=f"{r}-{suffix}",
            argv=role_command(
                r, url, namespace, instance=f"{r}-{suffix}", out_dir=out_dir, extra=extra.get(r)
            ),
            env={**role_thread_env(r), **(env or {}), **host_env, **role_env(r)} or None,
        )
        for r in roles
    ]


async def supervise(
    url: str,
    namespace: str,
    roles: list[str],
    *,
    out_dir: Path,
    stop: asyncio.Event,
    host_id: str | None = None,
    extra: Mapping[str, list[str]] | None = None,
) -> None:
    from joynexus.agents.health import HealthManager, RoleSlot
    from joynexus.broker.connection import Broker
    from joynexus.broker.layout import ensure_layout

    manager_name = f"health-{host_id or '0'}"
    b = await Broker.connect(url, name=manager_name, namespace=namespace)
    try:
        await ensure_layout(b)
        from joynexus.ops.runtime.deploy import role_env

        env = role_env()
        slots = [
            s
            for s in role_slots(
                url, namespace, roles, out_dir=out_dir, env=env or None, host_id=host_id, extra=extra
            )
        ]
        manager = HealthManager(
            b,
            [s for s in slots if isinstance(s, RoleSlot)],
            instance=manager_name,
            log_dir=None,
        )
        print(
            f"starting {', '.join(roles)} on {url} (namespace {namespace}) ...",
            file=sys.stderr,
            flush=True,
        )
        run = asyncio.create_task(manager.run(stop))
        ready = asyncio.create_task(wait_answering(b, manager, roles, stop))
        await asyncio.wait({run, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not ready.cancelled() and ready.result() is not None:
            print(
                f"deployment up on {url} (namespace {namespace}) after {ready.result():.0f}s: "
                f"{', '.join(roles)} answering, supervised by the health manager; Ctrl-C stops "
                f"it; `joynexus status --nats {url}` shows it",
                file=sys.stderr,
                flush=True,
            )
        await run
        await cancel_and_wait(ready)
    finally:
        await b.close()


async def wait_answering(
    b: object, manager: object, roles: list[str], stop: asyncio.Event, *, say_every_s: float = 15.0
) -> float | None:
    """Until every role process beats and the request servers among them answer
    (the scheduler, the control plane, an inference engine, the actor's policy
    initialisation); seconds it took, or
    None if stopped first. Says what it still waits for every ``say_every_s``."""
    import time

    from joynexus.agents.scheduler_client import SchedulerClient

    t0 = time.monotonic()
    last_say = t0
    services = {
        "control": b.names.control_service,  # type: ignore[attr-defined]
        "inference": b.names.inference_service,  # type: ignore[attr-defined]
        # The actor serves the first version of every new workload's action module.
        "actor": b.names.policy_init_service,  # type: ignore[attr-defined]
    }
    answered: set[str] = set()
    while not stop.is_set():
        slots = manager.core.slots  # type: ignore[attr-defined]
        pending = [s.role for s in slots.values() if s.owned and s.state != "running"]
        for role in roles:
            if role in answered or role in pending:
                continue
            try:
                if role == "scheduler":
                    await SchedulerClient(
                        b, by="launcher", call_timeout_s=1.0, deadline_s=1.0  # type: ignore[arg-type]
                    ).snapshot()
                elif role in services:
                    await b.nc.request(service_api("PING", services[role]), b"", timeout=1.0)  # type: ignore[attr-defined]
                answered.add(role)
            except Exception:
                pass
        waiting = [r for r in roles if r not in answered]
        if not waiting:
            return time.monotonic() - t0
        now = time.monotonic()
        if now - last_say >= say_every_s:
            last_say = now
            print(
                f"  still starting after {now - t0:.0f}s: waiting for {', '.join(waiting)}",
                file=sys.stderr,
                flush=True,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return None


#: The roles that build the resident base (they take ``--base``/``--backbone``).
BASE_ROLES = ("inference", "actor", "actor-forward")


def base_args(family: str, size: str, path: str | None = None) -> dict[str, list[str]]:
    """The extra arguments of each role that builds the base: this deployment's family and size
    (or the local directory it is loaded from, ``--backbone-path``)."""
    tail = ["--backbone-path", path] if path else []
    return {r: ["--base", family, "--backbone", size, *tail] for r in BASE_ROLES}


def launch(
    url: str, namespace: str, roles: list[str], *, out_dir: Path, host_id: str | None = None,
    base: tuple[str, str] = ("qwen2_5_vl", "tiny"), base_path: str | None = None,
) -> int:
    if base[0] not in FAMILY_SIZES or base[1] not in FAMILY_SIZES[base[0]]:
        print(f"joynexus up: --base {base[0]} --backbone {base[1]}: sizes are {FAMILY_SIZES}", file=sys.stderr)
        return 2
    if base_path:  # a π0.5 checkpoint's config and tensor shapes checked before any role starts
        from joynexus.agents.models.families import check_base
        from joynexus.schemas.errors import InvalidSpec

        try:
            check_base(base[0], base[1], base_path)
        except InvalidSpec as e:
            print(f"joynexus up: --backbone-path: {e}", file=sys.stderr)
            return 2
    bad = [r for r in roles if r not in REGISTRY or not REGISTRY[r].supervised]
    if bad:
        print(f"joynexus up: unknown roles {bad}; roles are {', '.join(ROLES)}", file=sys.stderr)
        return 2
    if host_id is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", host_id):
        print(
            f"joynexus up: --host-id {host_id!r} must be 1-32 lowercase letters, digits or "
            "dashes (it becomes part of instance names)",
            file=sys.stderr,
        )
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await supervise(url, namespace, roles, out_dir=out_dir, stop=stop, host_id=host_id,
                        extra=base_args(*base, base_path))

    asyncio.run(main())
    return 0
