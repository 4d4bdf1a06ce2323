"""The SFT producer's pure decisions (``agents/producers/sft.py``) in tables: no server."""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch

from joynexus.agents.producers.sft import BACKOFF, batch_indices, job_extra, sft_columns
from joynexus.agents.scheduler_client import ends_run
from joynexus.schemas import samples
from joynexus.schemas.scheduler import Refusal


@pytest.mark.parametrize(
    ("order", "cursor", "size", "rows"),
    [
        ([3, 1, 0, 2], 0, 2, [3, 1]),
        ([3, 1, 0, 2], 2, 2, [0, 2]),
        ([3, 1, 0, 2], 3, 2, [2, 3]),  # wraps around the end of the order
        ([3, 1, 0, 2], 4, 3, [3, 1, 0]),  # a second pass restarts the same order
        ([3, 1, 0, 2], 1, 6, [1, 0, 2, 3, 1, 0]),  # a batch larger than the dataset
        ([0], 7, 3, [0, 0, 0]),
        ([5, 4], 10**9, 1, [5]),  # a cursor saved after many restarts
    ],
)
def test_batch_indices(order: list[int], cursor: int, size: int, rows: list[int]) -> None:
    got = batch_indices(np.array(order), cursor, size)
    assert got == rows and all(type(i) is int for i in got)


def test_backoff_doubles_to_its_cap() -> None:
    seen = [BACKOFF.first_s]
    for _ in range(6):
        seen.append(BACKOFF.next(seen[-1]))
    assert seen[:5] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5])
    assert max(seen) == BACKOFF.max_s and seen[-1] == BACKOFF.max_s


@pytest.mark.parametrize("code", [*typing.get_args(Refusal), ""])
def test_which_refusal_ends_the_run(code: str) -> None:
    """Every code the scheduler can refuse with (and none): only an ended or replaced
    generation ends the run; the last jobs of the target in flight (one may fail) and
    the limits on jobs at once are waited out."""
    assert ends_run(code) is (code in ("ended", "superseded"))


def test_job_extra_carries_what_the_actor_reads() -> None:
    extra = job_extra("pick the cube", 48, "00-abc-def-01", 3e-4)
    assert extra == {
        "instruction": "pick the cube",
        "cursor": "48",
        "traceparent": "00-abc-def-01",
        "learning_rate": "0.0003",
    }
    assert float(job_extra("", 0, "", 1)["learning_rate"]) == 1.0


@pytest.mark.parametrize("as_tensor", [True, False])
@pytest.mark.parametrize(("cams", "horizon", "adim"), [((), 1, 3), (("front",), 2, 3), (("a", "b"), 4, 2)])
def test_sft_columns_shapes_and_dtypes(as_tensor: bool, cams: tuple[str, ...], horizon: int, adim: int) -> None:
    rng = np.random.default_rng(0)
    m, sdim = 5, 7

    def arr(x: np.ndarray) -> torch.Tensor | np.ndarray:
        return torch.from_numpy(x) if as_tensor else x

    items = [
        {
            samples.OBS_STATE: arr(rng.normal(size=sdim)),  # float64 in: float32 out
            samples.ACTION: arr(rng.normal(size=horizon * adim)),  # flat chunk: reshaped [H, A]
            **{f"{samples.OBS_IMAGES}.{c}": arr(rng.integers(0, 255, (3, 8, 8), dtype=np.uint8)) for c in cams},
        }
        for _ in range(m)
    ]
    cols = sft_columns(items, cams, horizon)
    assert set(cols) == {samples.STATE_FIELD, samples.ACTIONS_FIELD, *[samples.image_field(c) for c in cams]}
    assert cols[samples.STATE_FIELD].shape == (m, sdim) and cols[samples.STATE_FIELD].dtype == np.float32
    assert cols[samples.ACTIONS_FIELD].shape == (m, horizon, adim) and cols[samples.ACTIONS_FIELD].dtype == np.float32
    first = np.asarray(items[0][samples.ACTION], dtype=np.float32).reshape(horizon, adim)
    assert np.array_equal(cols[samples.ACTIONS_FIELD][0], first)
    for c in cams:
        assert cols[samples.image_field(c)].shape == (m, 3, 8, 8) and cols[samples.image_field(c)].dtype == np.uint8


def test_sft_columns_refuse_a_chunk_of_the_wrong_size() -> None:
    items = [{samples.OBS_STATE: np.zeros(2), samples.ACTION: np.zeros(5)}]
    with pytest.raises(ValueError, match="reshape"):
        sft_columns(items, (), 2)
