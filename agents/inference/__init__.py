"""The Inference Queue: batched, multi-tenant action serving on NATS request-reply;
one module per job:

- :mod:`.policies`: :class:`LoadedPolicy` and the cache of resident tenant policy
  versions (loading, the policy KV watch, eviction);
- :mod:`.admission`: the pure checks a request passes before it joins a batch
  (the subject's tenant, quotas, schema, shapes);
- :mod:`.batcher`: the pending queue's entries and :func:`.batcher.choose`, the
  pure "which prefix now", tested alone in tests/unit/test_batcher.py;
- :mod:`.intake`: the door: a request decoded, checked and queued as a
  ``Pending``, or answered with its error; the replies;
- :mod:`.compute`: the shared backbone forward, each tenant's head, the
  per-request fallback, the replies' payloads (torch only, no connection);
- :mod:`.engine`: :class:`InferenceEngine`, the lifecycle and the loop around
  those, wired to the rpc Server (the forward on the loop or the forward thread);
- :mod:`.pool`: :class:`EnginePool` and ``run_inference_agent``.

The client is torch-free and lives in the broker layer
(:mod:`joynexus.broker.inference_client`; re-exported here). See
docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

from joynexus.agents.inference.engine import InferenceEngine
from joynexus.agents.inference.intake import EngineStats
from joynexus.agents.inference.policies import LoadedPolicy
from joynexus.agents.inference.pool import EnginePool, run_inference_agent, serving_threads
from joynexus.agents.inference.runs import INLINE_FORWARD_MS
from joynexus.broker.inference_client import InferenceClient

__all__ = [
    "INLINE_FORWARD_MS",
    "EnginePool",
    "EngineStats",
    "InferenceClient",
    "InferenceEngine",
    "LoadedPolicy",
    "run_inference_agent",
    "serving_threads",
]
