"""Several tenants' heads of one architecture in one batched call
(agents/models/stacked.py): the same actions as each head's own act, whatever their
rows, weights and normalisation; a head changed in place is read as it is now; heads
that cannot be stacked are refused. Pure torch, no server."""

from __future__ import annotations

import pytest
import torch

from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.stacked import arch_key, stackable, stacked_act


def modules(kind: str, n: int, hidden: int = 48) -> list[TenantModule]:
    out = []
    for i in range(n):
        m = TenantModule(f"t{i}", kind, HeadConfig(32, 6, 5, 4, hidden=hidden, seed=i))
        g = torch.Generator().manual_seed(100 + i)
        h = m.head
        with torch.no_grad():  # normalisation and LayerNorm affine that are not the identity
            h.state_mean.normal_(generator=g)
            h.state_std.uniform_(0.5, 2.0, generator=g)
            h.action_mean.normal_(generator=g)
            h.action_std.uniform_(0.5, 2.0, generator=g)
            h.norm.weight.normal_(generator=g)
            h.norm.bias.normal_(generator=g)
        out.append(m)
    return out


@pytest.mark.parametrize("kind", ["oft_mlp", "flow_matching"])
def test_stacked_equals_each_heads_own_act(kind: str) -> None:
    ms = modules(kind, 3)
    rows = [2, 1, 4]
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(r, 32, generator=g) for r in rows]
    states = [torch.randn(r, 6, generator=g) * 3 for r in rows]
    noises = [torch.randn(r, 4, 5, generator=g) for r in rows] if kind == "flow_matching" else None
    got = stacked_act([m.head for m in ms], feats, states, noises)
    for i, m in enumerate(ms):
        kw = {} if noises is None else {"noise": noises[i]}
        torch.testing.assert_close(got[i], m.act(feats[i], states[i], **kw), rtol=1e-5, atol=1e-5)
        assert got[i].shape == (rows[i], 4, 5)


def test_flow_heads_without_noise_draw_from_their_own_generators() -> None:
    ms, twins = modules("flow_matching", 2), modules("flow_matching", 2)
    feats, states = [torch.randn(2, 32), torch.randn(3, 32)], [torch.randn(2, 6), torch.randn(3, 6)]
    got = stacked_act([m.head for m in ms], feats, states)
    for i, twin in enumerate(twins):  # the same seed: the same draws, as act would make them
        torch.testing.assert_close(got[i], twin.act(feats[i], states[i]), rtol=1e-5, atol=1e-5)


def test_a_head_changed_in_place_is_read_as_it_is_now() -> None:
    ms = modules("oft_mlp", 2)
    feats, states = [torch.randn(2, 32)] * 2, [torch.randn(2, 6)] * 2
    before = stacked_act([m.head for m in ms], feats, states)
    with torch.no_grad():
        ms[1].head.net[0].weight.mul_(-1.0)  # an optimizer step would do the same: in place
    after = stacked_act([m.head for m in ms], feats, states)
    torch.testing.assert_close(after[0], before[0])
    assert not torch.allclose(after[1], before[1])
    torch.testing.assert_close(after[1], ms[1].act(feats[1], states[1]), rtol=1e-5, atol=1e-5)


def test_heads_that_cannot_share_a_call_are_refused() -> None:
    (oft,), (flow,) = modules("oft_mlp", 1), modules("flow_matching", 1)
    wide = TenantModule("w", "oft_mlp", HeadConfig(32, 6, 5, 4, hidden=64))
    assert arch_key(oft.head) != arch_key(wide.head) and stackable(oft.head)
    value = TenantModule("v", "value", HeadConfig(32, 6, 5, 4))
    assert not stackable(value.head)
    f, s = torch.randn(1, 32), torch.randn(1, 6)
    for heads in ([oft.head, flow.head], [oft.head, wide.head], [value.head, value.head], []):
        with pytest.raises(ValueError, match="one stackable architecture"):
            stacked_act(heads, [f] * len(heads), [s] * len(heads))


def test_the_cache_keeps_to_its_byte_budget_and_its_books(monkeypatch: pytest.MonkeyPatch) -> None:
    from joynexus.agents.models import stacked

    monkeypatch.setattr(stacked, "CACHE_BYTES", 64 * 2**10)  # a few stacks of these heads
    f, s = [torch.randn(1, 32)] * 2, [torch.randn(1, 6)] * 2
    for _ in range(6):  # new heads each time: new tensors, new entries
        ms = modules("oft_mlp", 2)
        stacked_act([m.head for m in ms], f, s)
    kept = sum(entry[2].nbytes for entry in stacked._cache.values())
    assert stacked._cache_bytes == kept <= 64 * 2**10 or len(stacked._cache) == 1


def test_engines_of_one_process_share_the_cache_from_their_threads() -> None:
    """An EnginePool's engines decode on forward threads of their own, at once."""
    import threading

    from joynexus.agents.models import stacked

    sets = [modules("flow_matching", 3) for _ in range(2)]
    f = [torch.randn(2, 32) for _ in range(3)]
    s = [torch.randn(2, 6) for _ in range(3)]
    nz = [torch.randn(2, 4, 5) for _ in range(3)]
    want = [[m.act(f[i], s[i], noise=nz[i]) for i, m in enumerate(ms)] for ms in sets]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(30):
                got = stacked_act([m.head for m in sets[k]], f, s, nz)
                for g, w in zip(got, want[k], strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert stacked._cache_bytes == sum(entry[2].nbytes for entry in stacked._cache.values())
