"""No tenant can harm another: the attack catalogue against a live secured deployment.

One deployment for the module (``joynexus.ops.isolation.SecuredDeployment``: an
embedded nats-server with authorization on, the agents in this process as the
service identity). Tenant ``acme`` attacks with its own credentials through
the SDK and raw nats-py; tenant ``bolt`` trains and calls the service all the
while. Each test runs one attack of the shared catalogue (the same one
``joynexus bench isolation`` reports) and asserts both that it failed (the
attack checks its own effect) and that bolt went on: every call answered, its
policy version advanced, nothing filed under it, and its p99 latency during
the attack at most ``P99_RATIO_BOUND`` (5x) its baseline's or under
``P99_ABS_BOUND_S`` (1.5 s): generous, for a noisy 2-core machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from joynexus.ops.isolation import (
    BY_NAME,
    CATALOGUE,
    SecuredDeployment,
    Victim,
    prepare,
    run_attack,
)

pytestmark = [pytest.mark.adversarial, pytest.mark.timeout(240)]


@dataclass
class Live:
    dep: SecuredDeployment
    victim: Victim


@pytest.fixture(scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Live]:
    async with SecuredDeployment(tmp_path_factory.mktemp("adversarial")) as dep:
        victim = await prepare(dep)
        try:
            yield Live(dep, victim)
        finally:
            await victim.stop()


@pytest.mark.parametrize("name", [a.name for a in CATALOGUE])
async def test_attack_fails_and_the_victim_goes_on(live: Live, name: str) -> None:
    attack = BY_NAME[name]
    if attack.in_process and live.dep.external:
        pytest.skip("needs the agents in this process")
    out = await run_attack(live.dep, live.victim, attack)
    print(f"{name}: held={out.held} {out.detail}\n  {out.victim_detail()}")
    assert out.held, f"{name} ({attack.klass}) was not stopped: {out.detail}"
    assert out.victim_ok, f"{name}: the victim was harmed: {out.victim_detail()}"
