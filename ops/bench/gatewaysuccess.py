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
   and ``examples/openpi_maniskill.py`` runs in openpi's virtualenv: openpi's
   ``Runtime(PolicyAgent(ActionChunkBroker(WebsocketClientPolicy(...))))`` drives
   the episodes, each observation through the gateway and the Inference Queue.

The default policy is deliberately half-trained (10 demonstrations, 20 updates:
about 0.4 success), so that the comparison can fail: a policy that always succeeds
agrees with anything. The proxy counts the client's outcomes. ``agree`` says whether the client's rate
lies in the Wilson 95% interval of the evaluator's (the issue's target).
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

from joynexus.ops.bench.learning import Plan, make_dataset, train_sft
from joynexus.ops.bench.learnservice import TENANT, Service
from joynexus.ops.measure.stats import load, wilson

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "examples" / "openpi_maniskill.py"


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


async def bench_success(
    *, task: str = "PushCube-v1", episodes: int = 30, seed: int = 2027, demos: int = 10,
    updates: int = 20, budget_s: float = 240.0, data_dir: str | Path | None = None,
    log: Any = None,
) -> dict[str, Any]:
    from joynexus.agents.gateway import GatewayOptions, PolicyGateway
    from joynexus.broker.policy import PolicyRecords
    from joynexus.ops.admin.apikeys import add_key
    from joynexus.ops.bench.envproxy import EnvProxy

    log = log or (lambda msg: None)
    py = openpi_python()
    if py is None:
        raise RuntimeError("no .venv-openpi: run `bash ops/setup.sh` (it makes it), or set "
                           "$JOYNEXUS_OPENPI_PYTHON to a python with openpi-client")
    plan = Plan(task, demos=demos, updates=updates, budget_s=budget_s, episodes=episodes)
    with tempfile.TemporaryDirectory(prefix="jnx-openpi-") as tmp:
        data = Path(data_dir) if data_dir else Path(tmp)
        async with Service(data) as svc:
            client = await svc.tenant()
            root = svc.datasets / TENANT / "demos"
            shutil.rmtree(root, ignore_errors=True)
            t0 = time.perf_counter()
            info = await asyncio.to_thread(make_dataset, plan, root)
            log(f"{task}: {info.episodes} demos in {time.perf_counter() - t0:.0f} s")
            res = await train_sft(client, plan, "sft", "demos", log)
            version = res["version"]
            log(f"{task}: {res['updates']} updates in {res['train_s']} s (v{version})")
            t1 = time.perf_counter()
            ev = await client.evaluate("sft", version=version, episodes=episodes, env=task,
                                       num_envs=1, seed=seed)
            eval_s = time.perf_counter() - t1
            n = int(ev.get("episodes", episodes))
            k_eval = round(float(ev["success_rate"]) * n)
            log(f"evaluator: {k_eval}/{n} in {eval_s:.0f} s")

            fs = (await PolicyRecords(svc.service).get(TENANT, "sft", version)).feature_schema
            key, _ = await add_key(svc.admin, TENANT, workload="sft", version=version)
            gw = PolicyGateway(svc.service, GatewayOptions(host="127.0.0.1", port=0))
            await gw.start()
            proxy = EnvProxy(task, episodes, seed, int(fs.image_hw[0]), fs.camera_slots,
                             fs.state_keys)
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
    return {
        "task": task, "seed": seed, "episodes": n, "version": version,
        "updates": res["updates"], "train_s": res["train_s"], "demos": info.episodes,
        "evaluator_success": round(k_eval / n, 4), "evaluator_ci95": list(ci),
        "openpi_success": round(rate, 4), "openpi_ci95": list(wilson(k_openpi, len(done))),
        "openpi_episodes": len(done),
        "agree": len(done) == n and ci[0] <= rate <= ci[1],
        "openpi_steps": got["steps"], "openpi_policy_calls": got["calls"],
        "openpi_numpy": got["numpy"], "openpi_meta": got["meta"],
        "mean_length_evaluator": round(float(ev.get("mean_length", 0.0)), 2),
        "mean_length_openpi": round(sum(e.length for e in done) / max(1, len(done)), 2),
        "eval_s": round(eval_s, 1), "openpi_s": round(openpi_s, 1),
        "python": sys.version.split()[0], **load(),
    }


__all__ = ["DRIVER", "bench_success", "openpi_python", "run_openpi"]
