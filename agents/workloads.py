"""The producers' former module, kept importable: everything here now lives in
:mod:`joynexus.agents.producers` (schema, init, sft, supervisor) and the sample
field names in :mod:`joynexus.schemas.samples`; the RL producer in
:mod:`joynexus.agents.envworkers`. See docs/ARCHITECTURE.md ("Layout and import root").
"""

from __future__ import annotations

from typing import Any

from joynexus.agents import producers as _producers
from joynexus.agents.producers import *  # noqa: F403
from joynexus.schemas import samples as _samples
from joynexus.schemas.samples import *  # noqa: F403


def __getattr__(name: str) -> Any:
    if name == "RLProducer":  # imported lazily (envworkers imports this module)
        from joynexus.agents.envworkers import RLProducer

        return RLProducer
    raise AttributeError(name)


__all__ = [*_producers.__all__, *_samples.__all__]
