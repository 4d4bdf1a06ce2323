"""A workload's policy, for the tenant: :class:`PolicyCalls`, the verbs of
:class:`joynexus.sdk.Client` that read its versions, evaluate one (an ``eval``
workload pinned to it), list the periodic evaluations and fetch their videos,
export a version's action module, and report the tenant's metered usage.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from joynexus.schemas.api import UsageQuery
from joynexus.schemas.errors import InvalidSpec, JoyNexusError, Timeout
from joynexus.schemas.jobs import check_name
from joynexus.schemas.workloads import CreateWorkload, NamedWorkload, VideoQuery, WorkloadSpec
from joynexus.sdk.base import ClientBase


class PolicyCalls(ClientBase):
    """Policies, evaluations, export and usage (the verbs of :class:`joynexus.sdk.Client`)."""

    def latest_version(self, workload: str) -> asyncio.Future[int]:
        """The newest published version of a workload's policy."""

        async def go() -> int:
            return (await self._policy(workload)).version

        return self._future(go())

    def usage(self, since: float = 0.0) -> asyncio.Future[dict[str, Any]]:
        """This tenant's metered usage (the control plane's meter, ``broker.usage``):
        ``{"tenants": {<me>: {"train_s", "infer_s", "env_s", "tq_byte_s",
        "infer_requests", ...}}, "as_of", "since_effective", "trainer_share": {"share",
        "fair_share", "weight", "trainer_s", "queued"}}``: ``since``: epoch seconds
        (counted from the hour holding it); ``trainer_share``: its share of the
        trainer's work over the last minutes against its weighted fair share, and its
        reserves waiting for admission (empty when it has had no work lately)."""

        async def go() -> dict[str, Any]:
            reply = await self._api("usage", UsageQuery(since=float(since)))
            out: dict[str, Any] = json.loads(reply.data or b"{}")
            return out

        return self._future(go())

    def evaluate(
        self,
        workload: str,
        *,
        version: int | None = None,
        episodes: int = 10,
        env: str | None = None,
        num_envs: int = 1,
        seed: int = 0,
        timeout_s: float = 900.0,
        videos: int = 0,
        name: str | None = None,
        policy: Literal["mean", "sampled"] = "mean",
    ) -> asyncio.Future[dict[str, float]]:
        """Evaluate one version (default: the latest) of a workload's policy for
        ``episodes`` episodes in ``env`` (default: the workload's own task).
        The version is pinned for the whole run; nothing is trained. ``videos``:
        the first episodes saved as video (fetch them with ``fetch_video(name)``;
        ``name`` names the evaluation, default ``eval-<random>``). ``policy``: act
        with the mean action, or ``"sampled"``: from the policy's own Gaussian (its
        mean plus its std times seeded noise), as its RL rollouts do."""

        async def go() -> dict[str, float]:
            src = (await self._record("get_workload", NamedWorkload(name=workload))).spec
            task_env = env or src.env
            if not task_env:
                raise InvalidSpec(f"workload {workload!r} has no env of its own; pass env=")
            record = await self._policy(workload, version)
            pinned = record.version
            fs = record.feature_schema
            spec = WorkloadSpec(
                name=name or f"eval-{secrets.token_hex(4)}",
                task_type="eval",
                env=task_env,
                base_model=src.base_model,
                action_module=src.action_module,
                # The observation the policy was trained on: its cameras, image size and state.
                image_size=int(fs.image_hw[0]),
                cameras=list(fs.camera_slots),
                state=list(fs.state_keys),
                action_horizon=src.action_horizon,
                init_from_workload=workload,
                init_from=pinned,
                episodes=episodes,
                num_envs=num_envs,
                seed=seed,
                eval_videos=videos,
                eval_policy=policy,
            )
            rec = await self._record("create_workload", CreateWorkload(spec=spec))
            deadline = asyncio.get_running_loop().time() + timeout_s
            while rec.state == "active":
                if asyncio.get_running_loop().time() > deadline:
                    raise Timeout(f"evaluation {spec.name} did not finish within {timeout_s:.0f}s")
                await asyncio.sleep(0.5)
                rec = await self._record("get_workload", NamedWorkload(name=spec.name))
            if rec.state != "done":
                why = rec.reason or "no reason recorded; see the evaluator's log"
                raise JoyNexusError(f"evaluation {spec.name} {rec.state}: {why}")
            return dict(rec.result)

        return self._future(go())

    def eval_history(self, workload: str) -> asyncio.Future[list[dict[str, Any]]]:
        """The periodic evaluations of a workload (its spec's ``eval_every``), oldest
        version first: ``{"version", "evaluation" (its name), "state", "success_rate",
        "mean_return", "episodes", "videos" (file names: ``fetch_video``)}`` each; the
        figures appear once the evaluation is done."""

        async def go() -> list[dict[str, Any]]:
            check_name("workload", workload)
            reply = await self._api("list_workloads", NamedWorkload())
            out = []
            for r in reply.workloads:
                if not (r.periodic and r.spec.init_from_workload == workload):
                    continue
                row: dict[str, Any] = {
                    "version": r.spec.init_from,
                    "evaluation": r.spec.name,
                    "state": r.state,
                    "videos": list(r.videos),
                }
                for k in ("success_rate", "mean_return", "episodes"):
                    if k in r.result:
                        row[k] = r.result[k]
                out.append(row)
            return sorted(out, key=lambda row: row["version"] or 0)

        return self._future(go())

    def fetch_video(
        self, evaluation: str, index: int = 0, path: str | Path | None = None
    ) -> asyncio.Future[bytes]:
        """Video ``index`` of one of your evaluations (MP4, or GIF where the service
        has no PyAV), through the control plane; also written to ``path`` if given."""

        async def go() -> bytes:
            out = bytearray()
            while True:
                reply = await self._api(
                    "get_video",
                    VideoQuery(workload=evaluation, index=index, offset=len(out),
                               limit=self._b.max_payload // 2),
                )
                out += reply.data
                if len(reply.data) < self._b.max_payload // 2:
                    break
            data = bytes(out)
            if path is not None:
                await asyncio.to_thread(Path(path).write_bytes, data)
            return data

        return self._future(go())

    def export(
        self, workload: str, path: str | Path, *, version: int | None = None
    ) -> asyncio.Future[Path]:
        """Write a version (default: latest) of the action module to ``path``:
        ``head.safetensors`` plus ``manifest.json`` (base model, schema, version, type)."""

        async def go() -> Path:
            rec = await self._policy(workload, version)
            data = await self._weights(rec)
            manifest = {
                "tenant_id": rec.tenant_id,
                "workload": rec.workload,
                "version": rec.version,
                "action_module": rec.head_type,
                "head_config": rec.head_config,
                "base_model": rec.base_model,
                "schema_signature": rec.schema_signature,
                "feature_schema": msgspec.to_builtins(rec.feature_schema),
                # The head applies these itself (buffers in head.safetensors); here for readers.
                "normalization": _normalization(data),
                "weights": "head.safetensors",
            }
            return await asyncio.to_thread(_write_export, Path(path), data, manifest)

        return self._future(go())


def _normalization(weights: bytes) -> dict[str, dict[str, list[float]]]:
    """The normalisation statistics a head's safetensors carry (state and action
    mean/std), read from its header with numpy (the SDK imports no torch)."""
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8 : 8 + n])
    body = memoryview(weights)[8 + n :]

    def tensor(name: str) -> list[float] | None:
        t = header.get(name)
        if not isinstance(t, dict) or t.get("dtype") not in ("F32", "F64"):
            return None
        a, b = t["data_offsets"]
        dtype = np.float32 if t["dtype"] == "F32" else np.float64
        return [float(x) for x in np.frombuffer(body[a:b], dtype=dtype)]

    out: dict[str, dict[str, list[float]]] = {}
    for key, prefix in (("observation.state", "state"), ("action", "action")):
        mean, std = tensor(f"{prefix}_mean"), tensor(f"{prefix}_std")
        if mean is not None and std is not None:
            out[key] = {"mean": mean, "std": std}
    return out


def _write_export(out: Path, weights: bytes, manifest: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "head.safetensors").write_bytes(weights)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out
