"""A workload that starts from an exported head (``WorkloadSpec.init_from_export``):
the main job's RL tenants start from cached SFT heads this way (issue 31 item 2).

The control role runs in a process of its own (no torch, as deployed); a tenant
exports a version with the SDK into its dataset space and starts a new workload
from it: version 1 holds the same tensors. Hostile names and files are refused at
create time with one sentence each (another tenant's space, a symlink out, a
truncated or forged safetensors, a manifest of another head), and another tenant
creates its workloads meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_light_roles import Probe, _env, _fake_sft_dataset

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec


def test_the_spec_says_where_an_exported_head_applies() -> None:
    with pytest.raises(InvalidSpec, match="applies to sft, rl and custom"):
        WorkloadSpec(name="e", task_type="eval", env="PickCube-v1", init_from_workload="rl",
                     init_from_export="heads/x")
    with pytest.raises(InvalidSpec, match="not both"):
        WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", init_from_workload="rl",
                     init_from_export="heads/x")
    with pytest.raises(InvalidSpec, match="at most 1024"):
        WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", init_from_export="a" * 1025)
    spec = WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", init_from_export="heads/x")
    assert spec.warmup_updates() == 10  # a trained policy: the critic learns first


def test_check_safetensors_refuses_malformed_weights() -> None:
    import numpy as np
    from safetensors.numpy import save

    from joynexus.agents.producers.init import check_safetensors

    good = save({"w": np.zeros((3, 4), np.float32), "b": np.ones(4, np.float32)})
    check_safetensors(good)
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    w0 = header["w"]["data_offsets"][0]
    bad_cases = {
        "truncated": good[:-4],
        "short": good[:6],
        "huge header": (10**12).to_bytes(8, "little") + good[8:],
        "not json": len(b"{nope").to_bytes(8, "little") + b"{nope" + good[8 + n :],
    }
    for name, change in (
        ("dtype", {"w": {**header["w"], "dtype": "X9"}}),
        ("shape", {"w": {**header["w"], "shape": [3, 5]}}),
        ("offsets", {"w": {**header["w"], "data_offsets": [0, 10**9]}}),
        ("overlap", {"b": {**header["b"], "data_offsets": [w0, w0 + 16]}}),
    ):
        raw = json.dumps({**header, **change}).encode()
        bad_cases[name] = len(raw).to_bytes(8, "little") + raw + good[8 + n :]
    for name, data in bad_cases.items():
        with pytest.raises(InvalidSpec, match="not well-formed"):
            check_safetensors(data)
        assert name  # each case refused


async def test_a_workload_starts_from_an_exported_head(nats_server, broker, tmp_path: Path) -> None:
    from safetensors.torch import load

    from joynexus.agents.models.policyio import PolicyStore, module_from_weights
    from joynexus.agents.producers.init import PolicyInitService
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.sdk import Client

    datasets = tmp_path / "datasets"
    _fake_sft_dataset(datasets / "acme" / "demo")
    (datasets / "bolt").mkdir(parents=True)
    sched = SchedulerAgent(broker)
    await sched.start()
    init = PolicyInitService(broker, instance="actor-test")
    await init.start()
    env = {**_env(), "JOYNEXUS_DATASETS": str(datasets)}
    probe = await Probe.start(nats_server.url, broker.names.namespace, "control", env)
    url, ns = nats_server.url, broker.names.namespace
    try:
        assert (await probe.line())["event"] == "ready"
        acme = await Client.connect(url, tenant="acme", namespace=ns)
        bolt = await Client.connect(url, tenant="bolt", namespace=ns)
        async with acme, bolt:
            await acme.create_workload(WorkloadSpec(name="rl", task_type="rl", env="PickCube-v1"))
            await acme.cancel_workload("rl")
            head = await acme.export("rl", datasets / "acme" / "heads" / "pick")
            manifest = json.loads((head / "manifest.json").read_text())
            rl2 = await acme.create_workload(WorkloadSpec(
                name="rl2", task_type="rl", env="PickCube-v1", init_from_export="heads/pick", seed=7))
            assert rl2.record.spec.init_from_export == str(head.resolve())
            await acme.cancel_workload("rl2")

            # Hostile names: another tenant's space, a path out, a symlink out, nothing there.
            (datasets / "bolt" / "heads").mkdir()
            bolt_head = await acme.export("rl", datasets / "bolt" / "heads" / "b")
            (datasets / "acme" / "link").symlink_to(bolt_head)
            for i, name in enumerate(("../bolt/heads/b", str(bolt_head), "link", "heads/none",
                                      "heads", "/etc")):
                with pytest.raises(InvalidSpec, match="has no exported head"):
                    await acme.create_workload(WorkloadSpec(
                        name=f"x{i}", task_type="rl", env="PickCube-v1", init_from_export=name))
            # Hostile files: weights cut short, a forged manifest (another width, base, head).
            bad = datasets / "acme" / "heads"
            for name, weights, change, match in (
                ("cut", (head / "head.safetensors").read_bytes()[:-8], {}, "not well-formed"),
                ("wide", None, {"head_config": {**manifest["head_config"], "hidden": 64}},
                 "is 64 wide"),
                ("base", None, {"base_model": "qwen2.5-vl-bench"}, "was trained on"),
                ("head", None, {"action_module": "flow_matching"}, "differs from this workload"),
                ("none", None, {"head_config": None}, "names no action_module"),
            ):
                d = bad / name
                d.mkdir()
                (d / "head.safetensors").write_bytes(
                    weights or (head / "head.safetensors").read_bytes())
                (d / "manifest.json").write_text(json.dumps({**manifest, **change}))
                with pytest.raises(InvalidSpec, match=match):
                    await acme.create_workload(WorkloadSpec(
                        name=f"bad-{name}", task_type="rl", env="PickCube-v1",
                        init_from_export=f"heads/{name}"))
            # The other tenant went on meanwhile; the attacker's own good work too.
            ok = await bolt.create_workload(WorkloadSpec(name="rl", task_type="rl", env="PushCube-v1"))
            assert ok.record.state == "active"
            assert {w.name for w in await acme.list_workloads()} == {"rl", "rl2"}
        report = await probe.report()
    finally:
        await probe.close()
        await init.stop()
        await sched.stop()
    assert report["heavy"] == [], report  # the import ran in the control process, light
    store = PolicyStore(broker)
    src, dst = await store.get("acme", "rl", 1), await store.get("acme", "rl2", 1)
    a, b = load(await store.load_weights(src)), load(await store.load_weights(dst))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert dst.head_config["seed"] == 7 and dst.schema_signature == src.schema_signature
    module_from_weights(dst, await store.load_weights(dst))  # loads into the head it names
