"""``joynexus bench gateway --success``: does a robot-side openpi client see the same
policy the service evaluates? The success rate of openpi's own client against the
evaluator's, on the same seeds and the same policy version (JSON).

On a fresh deployment (``learnservice.Service``: every role in this process, a
secured embedded nats-server) the tenant trains an SFT policy through the SDK on
scripted PushCube demonstrations (``bench learning``'s path), then:

1. the service's evaluator runs ``episodes`` episodes of the final version
   (``Client.evaluate``, one env, seed ``seed``);
2. a :class:`PolicyGateway` serves that version behind an API key, an
   :class:`~joynexus.ops.bench.envproxy.EnvProxy` serves the same task on a unix
   socket (built as the evaluator builds it, episode k reset with the same seed),
   and ``examples/openpi_sim.py`` runs in openpi's virtualenv: openpi's
   ``Runtime(PolicyAgent(ActionChunkBroker(WebsocketClientPolicy(...))))`` drives
   the episodes, each observation through the gateway and the Inference Queue.

The default policy is deliberately half-trained (10 demonstrations, 20 updates:
about 0.4 success), so that the comparison can fail: a policy that always succeeds
agrees with anything. The proxy counts the client's outcomes. ``agree`` says whether the client's rate
lies in the Wilson 95% interval of the evaluator's (the issue's target).

A LIBERO task (``LIBERO-<suite>-<i>``) has no scripted expert and no dataset
here, so its policy is an RL workload's initial version (two cameras,
``agentview`` and ``eye_in_hand``; LeRobot's and openpi's 8-value LIBERO
state), which does not succeed: agreeing at 0/N would prove nothing. So the
episodes themselves are compared: the evaluator saves its episodes as video
(``evaluate(videos=...)``), the proxy keeps the client's frames the same way,
and ``same_episodes`` says whether every pair is byte-identical (the same
frames, hence the same initial states, actions and lengths), besides equal
mean length, return and success. The client sends openpi's LIBERO example's
keys (``observation/image``, ``observation/wrist_image``), mapped by the
gateway. ``$JOYNEXUS_LIBERO_MAX_STEPS`` is ``max_steps`` for the run.
See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.ops.bench.learnservice import TENANT, Service
from joynexus.ops.measure.stats import load, wilson

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "examples" / "openpi_sim.py"
#: The LIBERO policy's cameras: openpi's LIBERO example sends both (image, wrist_image).
LIBERO_CAMERAS = ("agentview", "eye_in_hand")


def openpi_python() -> Path | None:
    """openpi's own virtualenv (``ops/setup.sh`` makes ``.venv-openpi``), or
    ``$JOYNEXUS_OPENPI_PYTHON``."""
    env_py = os.environ.get("JOYNEXUS_OPENPI_PYTHON")
    py = Path(env_py) if env_py else ROOT / ".venv-openpi" / "bin" / "python"
    return py if py.is_file() else None


async def run_openpi(py: Path, url: str, key: str, sock: Path, episodes: int,
                     timeout_s: float) -> dict[str, Any]:
    """The driver in openpi's virtualenv; its JSON line (RuntimeError with its stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(py), str(DRIVER), url, key, str(sock), str(episodes),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"openpi driver exited {proc.returncode}: {err.decode()[-3000:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def sft_policy(svc: Any, client: Any, plan: Any, log: Any) -> tuple[str, int, dict[str, Any]]:
    """ManiSkill: an SFT policy trained through the SDK on scripted demonstrations."""
    from joynexus.ops.bench.learning import make_dataset, train_sft

    root = svc.datasets / TENANT / "demos"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    info = await asyncio.to_thread(make_dataset, plan, root)
    log(f"{plan.task}: {info.episodes} demos in {time.perf_counter() - t0:.0f} s")
    res = await train_sft(client, plan, "sft", "demos", log)
    log(f"{plan.task}: {res['updates']} updates in {res['train_s']} s (v{res['version']})")
    return "sft", int(res["version"]), {"updates": res["updates"], "train_s": res["train_s"],
                                        "demos": info.episodes}


async def libero_policy(client: Any, task: str, image_size: int, log: Any,
                        wait_s: float = 120.0) -> tuple[str, int, dict[str, Any]]:
    """LIBERO: an RL workload's initial version (no demonstrations needed), two cameras;
    the tenant drives no rollouts (``source="tenant"``), so nothing trains it."""
    from joynexus.schemas.errors import JoyNexusError
    from joynexus.schemas.workloads import WorkloadSpec

    await client.create_workload(WorkloadSpec(
        name="rl", task_type="rl", env=task, source="tenant", action_horizon=4,
        cameras=list(LIBERO_CAMERAS), image_size=image_size))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            version = int(await client.latest_version("rl"))
            break
        except JoyNexusError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    log(f"{task}: RL workload's initial policy v{version}")
    return "rl", version, {"updates": 0, "train_s": 0.0, "demos": 0}


def compare_videos(evaluator: list[bytes], openpi: list[bytes]) -> dict[str, Any]:
    """Episode k of each, byte for byte and frame by frame (decoded)."""
    from joynexus.agents.envs.video import decode_frames

    ev = [decode_frames(v) for v in evaluator]
    op = [decode_frames(v) for v in openpi]
    diff = []  # the largest pixel difference, 255 where the frame counts differ
    for fa, fb in zip(ev, op, strict=False):
        same_n = len(fa) == len(fb) and len(fa) > 0
        diff.append(int(np.abs(np.stack(fa).astype(np.int16) - np.stack(fb)).max()) if same_n
                    else 255)
    return {
        "videos": len(evaluator), "videos_openpi": len(openpi),
        "videos_identical": [a == b for a, b in zip(evaluator, openpi, strict=False)],
        "video_frames_evaluator": [len(f) for f in ev],
        "video_frames_openpi": [len(f) for f in op],
        "video_max_abs_diff": diff,
        # a mix-up of episodes would show: they start from different recorded states
        "evaluator_videos_distinct": len(set(evaluator)) == len(evaluator),
        # the policy moved the robot: an episode's last frame is not its first
        "frames_change": [bool((f[0] != f[-1]).any()) for f in ev],
    }


async def bench_success(
    *, task: str = "PushCube-v1", episodes: int = 30, seed: int = 2027, demos: int = 10,
    updates: int = 20, budget_s: float = 240.0, data_dir: str | Path | None = None,
    max_steps: int = 20, image_size: int = 64, log: Any = None,
) -> dict[str, Any]:
    """See the module. ``task``: a ManiSkill task (an SFT policy: ``demos``, ``updates``,
    ``budget_s``) or a LIBERO one (an RL workload's initial version: ``max_steps``
    caps its episodes, ``image_size`` its cameras)."""
    from joynexus.agents.envs.libero_tasks import MAX_STEPS_ENV

    if not task.startswith("LIBERO-"):
        return await _bench(task=task, episodes=episodes, seed=seed, demos=demos,
                            updates=updates, budget_s=budget_s, data_dir=data_dir,
                            image_size=image_size, log=log)
    before = os.environ.get(MAX_STEPS_ENV)
    os.environ[MAX_STEPS_ENV] = str(max_steps)  # the evaluator and the proxy: this process
    try:
        out = await _bench(task=task, episodes=episodes, seed=seed, demos=0, updates=0,
                           budget_s=budget_s, data_dir=data_dir, image_size=image_size, log=log)
    finally:
        if before is None:
            os.environ.pop(MAX_STEPS_ENV, None)
        else:
            os.environ[MAX_STEPS_ENV] = before
    return {**out, "max_steps": max_steps}


async def _bench(*, task: str, episodes: int, seed: int, demos: int, updates: int,
                 budget_s: float, data_dir: str | Path | None, image_size: int,
                 log: Any) -> dict[str, Any]:
    from joynexus.agents.gateway import GatewayOptions, PolicyGateway
    from joynexus.broker.policy import PolicyRecords
    from joynexus.ops.admin.apikeys import add_key
    from joynexus.ops.bench.envproxy import EnvProxy
    from joynexus.ops.bench.learning import Plan
    from joynexus.schemas.quotas import Quota

    log = log or (lambda msg: None)
    py = openpi_python()
    if py is None:
        raise RuntimeError("no .venv-openpi: run `bash ops/setup.sh` (it makes it), or set "
                           "$JOYNEXUS_OPENPI_PYTHON to a python with openpi-client")
    libero = task.startswith("LIBERO-")
    n_videos = 0
    with tempfile.TemporaryDirectory(prefix="jnx-openpi-") as tmp:
        data = Path(data_dir) if data_dir else Path(tmp)
        async with Service(data) as svc:
            client = await svc.tenant()
            if libero:
                wl, version, trained = await libero_policy(client, task, image_size, log)
                n_videos = min(episodes, Quota().max_eval_videos)  # a tenant's default
            else:
                plan = Plan(task, demos=demos, updates=updates, budget_s=budget_s,
                            episodes=episodes)
                wl, version, trained = await sft_policy(svc, client, plan, log)
            t1 = time.perf_counter()
            ev = await client.evaluate(wl, version=version, episodes=episodes, env=task,
                                       num_envs=1, seed=seed, videos=n_videos,
                                       name="eval-openpi", timeout_s=60.0 * episodes + 120)
            eval_s = time.perf_counter() - t1
            ev_videos = [await client.fetch_video("eval-openpi", i) for i in range(n_videos)]
            n = int(ev.get("episodes", episodes))
            k_eval = round(float(ev["success_rate"]) * n)
            log(f"evaluator: {k_eval}/{n} in {eval_s:.0f} s")

            fs = (await PolicyRecords(svc.service).get(TENANT, wl, version)).feature_schema
            key, _ = await add_key(svc.admin, TENANT, workload=wl, version=version)
            gw = PolicyGateway(svc.service, GatewayOptions(host="127.0.0.1", port=0))
            await gw.start()
            proxy = EnvProxy(task, episodes, seed, int(fs.image_hw[0]), fs.camera_slots,
                             fs.state_keys, keys="libero" if libero else "openpi",
                             videos=n_videos)
            sock = Path(tempfile.mkdtemp(prefix="jnx-envproxy-")) / "env-socket"
            try:
                async with proxy.serving(sock):
                    t2 = time.perf_counter()
                    got = await run_openpi(py, f"ws://127.0.0.1:{gw.port}", key, sock,
                                           episodes, timeout_s=60.0 * episodes)
                    openpi_s = time.perf_counter() - t2
            finally:
                await gw.stop()
                shutil.rmtree(sock.parent, ignore_errors=True)
            done = proxy.finished()
            k_openpi = sum(e.success for e in done)
            log(f"openpi client: {k_openpi}/{len(done)} in {openpi_s:.0f} s")
    ci = wilson(k_eval, n)
    rate = k_openpi / len(done) if done else 0.0
    out: dict[str, Any] = {
        "task": task, "seed": seed, "episodes": n, "workload": wl, "version": version,
        **trained,
        "evaluator_success": round(k_eval / n, 4), "evaluator_ci95": list(ci),
        "openpi_success": round(rate, 4), "openpi_ci95": list(wilson(k_openpi, len(done))),
        "openpi_episodes": len(done),
        "agree": len(done) == n and ci[0] <= rate <= ci[1],
        "openpi_steps": got["steps"], "openpi_policy_calls": got["calls"],
        "openpi_numpy": got["numpy"], "openpi_meta": got["meta"],
        "mean_length_evaluator": round(float(ev.get("mean_length", 0.0)), 2),
        "mean_length_openpi": round(sum(e.length for e in done) / max(1, len(done)), 2),
        "mean_return_evaluator": round(float(ev.get("mean_return", 0.0)), 4),
        "mean_return_openpi": round(sum(e.ret for e in done) / max(1, len(done)), 4),
        "lengths_openpi": [e.length for e in done],
        "eval_s": round(eval_s, 1), "openpi_s": round(openpi_s, 1),
        "python": sys.version.split()[0], **load(),
    }
    if n_videos:
        cmp = compare_videos(ev_videos, proxy.videos_encoded())
        out.update(cmp)
        out["same_episodes"] = (
            out["agree"] and all(cmp["videos_identical"]) and cmp["videos"] == n_videos
            and out["mean_length_openpi"] == out["mean_length_evaluator"]
            and out["mean_return_openpi"] == out["mean_return_evaluator"])
    return out


__all__ = ["DRIVER", "LIBERO_CAMERAS", "bench_success", "compare_videos", "libero_policy",
           "openpi_python", "run_openpi", "sft_policy"]
