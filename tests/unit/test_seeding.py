"""Seeded head builds give the same weights whatever other threads build meanwhile
(``agents/models/seeding.py``: one re-entrant lock around torch's one generator)."""

from __future__ import annotations

import threading

import torch

from joynexus.agents.models.heads.base import HeadConfig, build_head
from joynexus.agents.models.seeding import seeded


def _weights(seed: int) -> torch.Tensor:
    head = build_head("oft_mlp", HeadConfig(feature_dim=16, state_dim=4, hidden=16, seed=seed))
    return torch.cat([p.detach().reshape(-1) for p in head.parameters()])


def test_many_builds_on_several_threads_match_the_serial_builds() -> None:
    seeds = [0, 1, 2, 3]
    want = {s: _weights(s) for s in seeds}
    got: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def build(t: int) -> None:
        try:
            start.wait()
            for i in range(12):
                s = seeds[(t + i) % len(seeds)]
                got[(t, i)] = _weights(s)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(t,)) for t in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(got) == 60
    for (t, i), w in got.items():
        assert torch.equal(w, want[seeds[(t + i) % len(seeds)]]), (t, i)


def test_seeded_is_reentrant_and_restores_the_generator() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    with seeded(5):
        a = torch.rand(3)
        with seeded(5):
            b = torch.rand(3)
    assert torch.equal(a, b)
    assert torch.equal(torch.random.get_rng_state(), before)
