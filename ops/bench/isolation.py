"""``joynexus bench isolation``: the attack catalogue against a live deployment (JSON).

Runs every attack of :data:`joynexus.ops.isolation.CATALOGUE` (the one the
adversarial suite asserts) against a fresh secured embedded deployment (its
agents one process per role, as `joynexus up` runs them, unless ``--agents
in-process``), or
against ``--nats URL`` with the admin credentials (the service's agents must
be running, and ``--datasets-root`` is their datasets root on this machine).
Each attack follows a baseline window of the victim tenant's probe in the
same run, so its latency ratios compare like with like. Per attack:
``name``, ``held``, ``victim_ok``, ``victim_p50_ratio``/``victim_p99_ratio``
(during / baseline), ``detail``; then ``attacks_tried``, ``attacks_held``,
``victim_ok`` and the bound the victim is held to. Nothing is left running.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from joynexus.ops.isolation import (
    CATALOGUE,
    P50_TARGET,
    P99_ABS_BOUND_S,
    P99_RATIO_BOUND,
    P99_TARGET,
    TRAIN_RATE_TARGET,
    SecuredDeployment,
    prepare,
    run_attack,
)
from joynexus.ops.runtime.heap import freeze_heap
from joynexus.schemas.inference import DEFAULT_MAX_ROWS


async def bench_isolation(
    url: str | None = None,
    *,
    creds: str | Path | None = None,
    service_creds: str | Path | None = None,
    datasets_root: str | Path | None = None,
    namespace: str = "jnx",
    only: list[str] | None = None,
    progress: bool = False,
    baseline_s: float = 2.0,
    processes: bool = True,
    gateway_url: str = "",
    max_rows: int = DEFAULT_MAX_ROWS,
) -> dict[str, Any]:
    if url and creds is None:
        from joynexus.broker.credentials import from_env_or_file

        creds = from_env_or_file(None)  # type: ignore[assignment]
    if url and service_creds is None and isinstance(creds, str | Path):
        beside = Path(creds).with_name("service.json")  # <data-dir>/credentials/
        service_creds = beside if beside.exists() else None
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    async with SecuredDeployment(
        namespace=namespace, url=url, admin_creds=creds, service_creds=service_creds,
        datasets_root=datasets_root, processes=processes, gateway_url=gateway_url,
        max_rows=max_rows,
    ) as dep:
        victim = await prepare(dep)
        # The probe runs in this process: its start-up heap (the deployment, the datasets,
        # torch) out of later collections, as every role's (ops/runtime/heap.py). A full
        # collection here stopped the probe for 240-250 ms during the attacks (up to 730 ms
        # while the deployment started), measured as the victim's latency.
        freeze_heap()
        try:
            for attack in CATALOGUE:
                if only and attack.name not in only:
                    continue
                if attack.in_process and dep.external:
                    rows.append({"name": attack.name, "class": attack.klass, "held": None,
                                 "detail": "skipped: needs the agents in this process"})
                    continue
                if attack.name.startswith("gateway") and not dep.gateway_url:
                    rows.append({"name": attack.name, "class": attack.klass, "held": None,
                                 "detail": "skipped: no policy gateway (--gateway-url)"})
                    continue
                if progress:
                    print(f"attack {attack.name} ...", file=sys.stderr, flush=True)
                out = await run_attack(dep, victim, attack, baseline_s=baseline_s)
                rows.append(out.row())
                if progress:
                    print(f"  held={out.held} victim_ok={out.victim_ok} "
                          f"p99 x{out.p99_ratio}: {out.detail[:160]}", file=sys.stderr,
                          flush=True)
        finally:
            await victim.stop()
    tried = [r for r in rows if r["held"] is not None]
    return {
        "attacks": rows,
        "attacks_tried": len(tried),
        "attacks_held": sum(1 for r in tried if r["held"]),
        "victim_ok": sum(1 for r in tried if r.get("victim_ok")),
        "victim_bound": {"p99_ratio": P99_RATIO_BOUND, "p99_abs_s": P99_ABS_BOUND_S},
        # Issue 24's targets for every attack within quota (the victim's p50 and p99
        # against its baseline in the same run, and its training rate).
        "victim_target": {"p50_ratio": P50_TARGET, "p99_ratio": P99_TARGET,
                          "train_rate_ratio": TRAIN_RATE_TARGET},
        "attacks_within_target": sum(1 for r in tried if r.get("within_target")),
        "deployment": "external" if url else (
            "embedded (fresh, secured), "
            + ("one process per role" if processes else "agents in the bench's process")),
        # The fresh deployment's engine batch rows (an external deployment's are its own).
        "max_rows": None if url else max_rows,
        "seconds": round(time.monotonic() - t0, 1),
    }
