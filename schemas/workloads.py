"""Workloads: what a tenant asks the service to run, and the control plane's API.

A workload is one tenant's task: SFT on a LeRobot dataset, RL in a simulator
(ManiSkill or LIBERO, by env name), or evaluation. Its ``name`` is the policy
key of the action module it trains (``<tenant>.<name>`` in the policy bucket).
Specs validate themselves on construction and on decode, torch-free, so a bad
spec is refused before any simulator or model is imported, with a message that
names the field and says what would be accepted.

What a spec may name (base models, action modules, envs, image sizes) is in
schemas/catalog.py. See docs/ARCHITECTURE.md, "Workloads, from the SDK to a new
policy version".
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import msgspec

from joynexus.schemas.base import WIRE_VERSION, Wire
from joynexus.schemas.catalog import (
    ACTION_MODULES,
    BASE_FAMILY_HEADS,
    BASE_IMAGE_SIDE,
    FAMILY_MODELS,
    MAX_IMAGE_SIZE,
    MIN_IMAGE_SIZE,
    RL_ENVS,
    base_family,
    check_head_options,
    describe_envs,
    hosted_models,
    image_size_hint,
    libero_task,
    resized_side,
)
from joynexus.schemas.checkpoints import check_init_from_checkpoint
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.inference import PolicyRecord, TensorBytes
from joynexus.schemas.jobs import TASK_TYPES, Admission, TaskType, TrainingJob, check_name
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.training import HEAD_FAMILIES

#: The smallest learning rate the actor applies (``agents.actor.agent``: a job's rate
#: outside [MIN_LEARNING_RATE, 1] is ignored, and the actor's own is used instead).
MIN_LEARNING_RATE = 1e-9
#: The smallest discount the advantage stage applies (``agents.advantage``: below it
#: the stage's default, 0.99, is used instead).
MIN_GAMMA = 1e-3


#: The largest seed a workload may give: the episode and batch seeds derived from it
#: (seed + episode index, seed * 1000 + ...) stay within numpy's and ManiSkill's 32 bits.
MAX_SEED = 2**20


class Scheduling(Admission, kw_only=True, omit_defaults=True):
    """A spec's admission and ordering (the scheduler's :class:`WorkloadPolicy` of
    each generation of the workload takes them)."""

    def __post_init__(self) -> None:
        self.check_bounds("scheduling.")


class WorkloadSpec(Wire, kw_only=True, omit_defaults=True):
    v: int = WIRE_VERSION
    name: str
    task_type: TaskType
    base_model: str = "qwen2.5-vl-tiny"
    action_module: str = "oft_mlp"
    #: Simulator task (rl, eval): a ManiSkill task id or ``LIBERO-<suite>-<i>``.
    env: str = ""
    #: LeRobot dataset root on the service's machines (sft).
    dataset: str = ""
    #: Start from this version of ``init_from_workload`` (same tenant); None = fresh weights.
    init_from: int | None = None
    init_from_workload: str = ""
    #: sft, rl: start from a head exported by ``Client.export`` (a directory holding
    #: ``head.safetensors`` and ``manifest.json``), named by its path inside the
    #: tenant's dataset space like ``dataset``; the head type, width and sample
    #: layout must be this workload's. Not with ``init_from_workload``.
    init_from_export: str = ""
    #: sft, rl with ``pi05_expert``: start from the action expert of a LeRobot ``PI05Policy``
    #: checkpoint (``config.json`` + ``model.safetensors``), named by its path inside the
    #: tenant's dataset space like ``dataset``; its expert's width must be ``head_hidden``.
    init_from_checkpoint: str | None = None
    #: RL: parallel envs and steps per rollout job; SFT: samples per job.
    num_envs: int = 2
    horizon: int = 16
    #: Action chunk the head predicts; camera image size (RL/eval render size).
    action_horizon: int = 4
    image_size: int = 64
    #: The state the policy conditions on (rl, eval; sft: checked against the dataset's):
    #: ManiSkill keys ("agent/qpos", "extra/obj_pose", "extra/tcp_to_obj_pos",
    #: "extra/goal_pos"...) or presets "proprio" (the task's default) and "privileged"
    #: (adds the simulator's object and goal state). Empty: the task's default, or for
    #: sft the dataset's own; eval: the evaluated policy's.
    state: list[str] = []
    #: Camera slots to render (rl, eval; sft: the dataset's); empty: the task's default.
    cameras: list[str] = []
    #: Width of the action module's hidden layers.
    head_hidden: int = 256
    #: pi05_expert: the state as the prompt's digits only ("prompt", π0.5), or also as a
    #: continuous suffix token before the actions ("token", π0's layout; no LeRobot export).
    expert_state: Literal["prompt", "token"] = "prompt"
    batch_size: int = 32
    learning_rate: float = 1e-3
    #: eval: episodes to run (the version evaluated is init_from of init_from_workload).
    episodes: int = 10
    #: sft, rl: evaluate every ``eval_every``-th published version (K, 2K, ...) during
    #: training, ``eval_episodes`` episodes each in ``env`` (the evaluator runs them,
    #: pinned to that version, no training work; the SDK's ``eval_history``). 0: off.
    eval_every: int = 0
    eval_episodes: int = 10
    #: eval and periodic evaluations: the first ``eval_videos`` episodes are saved as
    #: video (MP4), at most ``video_frames`` frames each and ``video_size`` pixels a
    #: side (0: the policy camera's own size); the tenant's quota bounds all three.
    eval_videos: int = 0
    #: eval and periodic evaluations: act with the policy's mean action ("mean"), or
    #: sample it as RL rollouts do ("sampled": a Gaussian head's mean plus its own std
    #: times seeded normal noise, clipped to the action bounds), the score of the
    #: stochastic policy a policy-gradient method trains. Flow heads always sample.
    eval_policy: Literal["mean", "sampled"] = "mean"
    video_frames: int = 50
    video_size: int = 0
    #: rl: "gae" (per-step, bootstrapped) or "grpo" (trajectory return relative to the job's group).
    advantage: Literal["gae", "grpo"] = "gae"
    #: rl: exploration, in the env's action units. Heads with a learned std (oft_mlp, a
    #: Gaussian policy) sample from their own std, and this is a floor under it; other
    #: heads add Gaussian noise of this std to the policy's chunk. None: no floor /
    #: noise 0.1. At most 1.0 (actions are in [-1, 1]).
    exploration_std: float | None = None
    #: rl with PPO (Gaussian heads): the first ``critic_warmup`` updates train only the
    #: critic (the policy is held while the value estimates it starts without are
    #: learnt). None: 10 when the workload starts from a trained policy
    #: (``init_from_workload`` or ``init_from_export``), else 0.
    critic_warmup: int | None = None
    #: rl with PPO: the adaptive step's target KL per update (the policy's learning rate
    #: shrinks when an update moves it more than twice this far from the behaviour
    #: policy and grows below half of it, within 1e-3x..10x ``learning_rate``). 0: fixed.
    target_kl: float = 0.01
    #: rl with GAE: the discount and the GAE lambda (the advantage stage's).
    gamma: float = 0.99
    gae_lambda: float = 0.95
    #: "service": the service's producers make the jobs (rollouts in ManiSkill, batches
    #: from the dataset); "tenant": the tenant submits rollouts / batches through the SDK.
    source: Literal["service", "tenant"] = "service"
    #: The language instruction given to the policy (default: the task's or dataset's own).
    instruction: str = ""
    seed: int = 0
    scheduling: Scheduling = msgspec.field(default_factory=Scheduling)

    def __post_init__(self) -> None:
        check_name("workload name", self.name)
        if self.task_type not in TASK_TYPES:
            raise InvalidSpec(f"task_type {self.task_type!r} is not one of {list(TASK_TYPES)}")
        family = base_family(self.base_model)
        if family is None:
            raise InvalidSpec(
                f"base_model {self.base_model!r} is not hosted here; choose one of "
                f"{hosted_models()}"
            )
        if self.action_module not in ACTION_MODULES:
            raise InvalidSpec(
                f"action_module {self.action_module!r} is unknown; choose one of {list(ACTION_MODULES)}"
            )
        needs = BASE_FAMILY_HEADS.get(self.action_module)
        if needs is not None and needs != family:
            raise InvalidSpec(
                f"action_module {self.action_module!r} attends to a {needs} base's prefix cache; "
                f"base_model {self.base_model!r} is {family}: choose one of {sorted(FAMILY_MODELS[needs])}"
            )
        check_head_options(self.action_module, self.head_hidden, self.expert_state)
        if self.eval_policy == "sampled" and HEAD_FAMILIES.get(self.action_module) != "gaussian":
            raise InvalidSpec(
                f"eval_policy 'sampled' needs a Gaussian head (its std): one of "
                f"{sorted(k for k, v in HEAD_FAMILIES.items() if v == 'gaussian')}; "
                f"{self.action_module!r} acts from noise already (use 'mean')"
            )
        if self.task_type in ("rl", "eval"):
            if self.env not in RL_ENVS and libero_task(self.env) is None:
                raise InvalidSpec(
                    f"{self.task_type} workload {self.name!r} needs env set to one of: "
                    f"{describe_envs()} (got {self.env!r:.80}; other ManiSkill tasks need "
                    "asset downloads)"
                )
        if self.init_from_workload:
            check_name("init_from_workload", self.init_from_workload)
        if self.task_type == "eval" and not self.init_from_workload:
            raise InvalidSpec(
                f"eval workload {self.name!r} needs init_from_workload: the workload whose policy "
                "to evaluate (and init_from: its version; None = latest)"
            )
        if self.episodes < 1:
            raise InvalidSpec(f"episodes must be >= 1, got {self.episodes}")
        self._check_eval_fields()
        if self.task_type == "custom" and not (self.env in RL_ENVS or libero_task(self.env) or not self.env):
            raise InvalidSpec(f"custom workload {self.name!r}: env must be one of: {describe_envs()}")
        if self.task_type == "custom" and not (self.env or self.dataset):
            raise InvalidSpec(f"custom workload {self.name!r} needs env or dataset: its sample layout")
        if self.task_type == "sft" and not self.dataset:
            raise InvalidSpec(
                f"sft workload {self.name!r} needs dataset: the root directory of a LeRobot dataset"
            )
        for field, names, most in (("state", self.state, 32), ("cameras", self.cameras, 4)):
            if len(names) > most or len(set(names)) != len(names):
                raise InvalidSpec(f"{field} must name at most {most} distinct entries, got {len(names)}")
            for n in names:
                if not isinstance(n, str) or not 0 < len(n) <= 64 or not all(
                    c.isalnum() or c in "_-./" for c in n
                ):
                    raise InvalidSpec(
                        f"{field} entries are plain names (letters, digits, '_-./', at most 64), got {n!r}"
                    )
        if not 8 <= self.head_hidden <= 512:
            raise InvalidSpec(f"head_hidden must be 8..512, got {self.head_hidden}")
        if not MIN_IMAGE_SIZE <= self.image_size <= MAX_IMAGE_SIZE:
            raise InvalidSpec(
                f"image_size must be {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE} pixels, got {self.image_size}"
            )
        if resized_side(self.image_size) != BASE_IMAGE_SIDE:
            raise InvalidSpec(
                f"image_size {self.image_size} is resized by the base model's image processor to "
                f"{resized_side(self.image_size)} pixels a side, not the {BASE_IMAGE_SIDE} it reads "
                f"(its rounding), so no forward would run; choose {image_size_hint(self.image_size)} "
                "(any multiple of 28 works)"
            )
        for field in ("num_envs", "horizon", "batch_size", "action_horizon"):
            if getattr(self, field) < 1:
                raise InvalidSpec(f"{field} must be >= 1, got {getattr(self, field)}")
        lr = self.learning_rate
        if isinstance(lr, bool) or not MIN_LEARNING_RATE <= lr < 1:  # NaN compares False
            raise InvalidSpec(
                f"learning_rate must be in [{MIN_LEARNING_RATE:g}, 1) (the actor applies no smaller "
                f"rate), got {lr!r}"
            )
        if isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise InvalidSpec(
                f"seed must be an integer in 0..{MAX_SEED} (numpy's and the simulators' "
                f"generators take no negative seed), got {self.seed!r}"
            )
        if self.init_from is not None and self.init_from < 0:
            raise InvalidSpec(f"init_from must be a version >= 0, got {self.init_from}")
        if self.init_from_export:
            if self.task_type not in ("sft", "rl", "custom"):
                raise InvalidSpec(
                    f"init_from_export applies to sft, rl and custom workloads (the heads they train), "
                    f"not {self.task_type}"
                )
            if self.init_from_workload:
                raise InvalidSpec(
                    "give init_from_workload (a version of one of your workloads) or "
                    "init_from_export (an exported head in your dataset space), not both"
                )
            if len(self.init_from_export) > 1024 or "\x00" in self.init_from_export:
                raise InvalidSpec("init_from_export must be a path of at most 1024 characters")
        check_init_from_checkpoint(self)
        if self.exploration_std is not None and not (
            isinstance(self.exploration_std, (int, float))
            and math.isfinite(self.exploration_std)
            and 0.0 <= self.exploration_std <= 1.0
        ):
            raise InvalidSpec(
                f"exploration_std must be a number in [0, 1] (env action units), got {self.exploration_std!r}"
            )
        if self.critic_warmup is not None and (
            isinstance(self.critic_warmup, bool) or not 0 <= self.critic_warmup <= 100_000
        ):
            raise InvalidSpec(f"critic_warmup must be an integer in 0..100000 (updates), got {self.critic_warmup!r}")
        for field, lo in (("gamma", MIN_GAMMA), ("gae_lambda", 0.0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and lo <= v <= 1.0):
                raise InvalidSpec(f"{field} must be a number in [{lo:g}, 1], got {v!r}")
        if (
            self.advantage == "grpo" and self.task_type == "rl" and self.source == "service"
            and self.num_envs < 2
        ):
            raise InvalidSpec(
                f"advantage 'grpo' weighs each env's return against the others of its rollout: "
                f"with num_envs = {self.num_envs} every advantage is 0 and nothing is learnt; "
                "give num_envs >= 2, or advantage 'gae'"
            )
        if isinstance(self.target_kl, bool) or not (
            isinstance(self.target_kl, (int, float)) and math.isfinite(self.target_kl) and 0.0 <= self.target_kl <= 1.0
        ):
            raise InvalidSpec(f"target_kl must be a number in [0, 1] (0: a fixed learning rate), got {self.target_kl!r}")

    def warmup_updates(self) -> int:
        """``critic_warmup`` resolved (None: 10 from a trained policy, another
        workload's or an exported one, else 0)."""
        if self.critic_warmup is not None:
            return self.critic_warmup
        return 10 if self.init_from_workload or self.init_from_export or self.init_from_checkpoint else 0

    def _check_eval_fields(self) -> None:
        for field, lo, hi in (
            ("eval_every", 0, 1_000_000), ("eval_episodes", 1, 1_000_000),
            ("eval_videos", 0, MAX_EVAL_VIDEOS), ("video_frames", 1, 10_000),
            ("video_size", 0, 256),
        ):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidSpec(f"{field} must be an integer in {lo}..{hi}, got {v!r}")
        if self.eval_every:
            if self.task_type not in ("sft", "rl"):
                raise InvalidSpec(
                    f"eval_every applies to sft and rl workloads (the versions they train), "
                    f"not {self.task_type}"
                )
            if self.env not in RL_ENVS and libero_task(self.env) is None:
                raise InvalidSpec(
                    f"eval_every needs env: the task to evaluate in, one of {describe_envs()} "
                    f"(got {self.env!r:.80})"
                )
        episodes = self.episodes if self.task_type == "eval" else self.eval_episodes
        if self.eval_videos > episodes:
            raise InvalidSpec(
                f"eval_videos = {self.eval_videos} is more than the {episodes} episodes evaluated"
            )
        if self.video_size and self.video_size < 16:
            raise InvalidSpec(f"video_size must be 0 (the camera's size) or 16..256, got {self.video_size}")


#: Videos of one evaluation at most (the tenant's quota may allow fewer).
MAX_EVAL_VIDEOS = 8


def periodic_eval_name(workload: str, version: int) -> str:
    """The name of the evaluation of ``version`` that ``eval_every`` asks for:
    ``<workload>-v<version>``, the workload's name shortened (plus a hash of it)
    where that would pass 32 characters. One name per (workload, version): the
    evaluator creates it once, whoever restarts."""
    suffix = f"-v{version}"
    if len(workload) + len(suffix) <= 32:
        return workload + suffix
    h = hashlib.sha256(workload.encode()).hexdigest()[:6]
    return f"{workload[: 32 - len(suffix) - 7]}-{h}{suffix}"


def video_object_name(tenant: str, evaluation: str, file: str) -> str:
    """Where an evaluation's video lies in the weights object store (the evaluator
    writes it, the control plane reads it for the tenant: ``get_video``)."""
    return f"videos/{tenant}/{evaluation}/{file}"


#: ``done``: its completion target of jobs completed (an evaluation: its episodes
#: ran); ``failed``: as many of its jobs failed as it was to complete;
#: ``cancelled``: by its tenant. Only ``active`` workloads run.
WorkloadState = Literal["active", "cancelled", "done", "failed"]


class WorkloadRecord(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    spec: WorkloadSpec
    state: WorkloadState = "active"
    #: Which creation of this name the record is: 1, then one more each time the
    #: name is created again after its workload ended. Its jobs carry it.
    generation: int = 1
    created_at: float = 0.0
    #: The sample layout its jobs carry (from the env or the dataset).
    schema_signature: str = ""
    #: eval: success_rate, mean_return, episodes, version...; rl, sft once ended: its
    #: jobs completed, failed and dropped, and the last policy version (last_version).
    result: dict[str, float] = {}
    finished_at: float = 0.0
    #: Why it ended (done, failed), in words.
    reason: str = ""
    #: eval: made by the evaluator for a workload's ``eval_every`` (not by the tenant;
    #: not counted against the tenant's workload quota).
    periodic: bool = False
    #: eval: the saved episode videos, file names (``get_video`` fetches them by index).
    videos: list[str] = []
    #: The instruction its policy is trained and evaluated with: the spec's, else the
    #: task's or the dataset's own (what ``act`` and the gateway send by default).
    instruction: str = ""

    def policy_instruction(self) -> str:
        """The instruction its policy is conditioned on ("" only in records written
        before the control plane resolved it: then the spec's)."""
        return self.instruction or self.spec.instruction


class CreateWorkload(Wire, kw_only=True):
    spec: WorkloadSpec


class NamedWorkload(Wire, kw_only=True):
    name: str = ""


class OpenJob(Wire, kw_only=True):
    """A tenant-sourced workload asks for a job to put its own batch or rollout into."""

    workload: str
    sample_count: int
    behavior_policy_version: int = 0
    #: If admission refuses it for a limit that will lift, wait up to this long
    #: (seconds, at most 10) in the scheduler's admission queue (0: answer at once).
    wait_s: float = 0.0


class CloseJob(Wire, kw_only=True, omit_defaults=True):
    """close_job: the batch or rollout is in the job's partition, hand it to
    training. abort_job: give the job up (it is failed with ``reason``)."""

    job_id: str
    reason: str = ""


#: Header of an API request whose body is msgpack (put_data: tensors stay raw bytes)
#: instead of JSON.
CONTENT_TYPE = "Content-Type"
MSGPACK = "application/msgpack"


class ReadEvents(Wire, kw_only=True, omit_defaults=True):
    """Page through the tenant's own job events (the SDK's ``events()``): those
    after stream sequence ``after_seq`` (``-1``: only events from now on), at
    most ``limit``, waiting up to ``wait_s`` for the first one."""

    after_seq: int = 0
    limit: int = 256
    wait_s: float = 0.0


class PutData(Wire, kw_only=True):
    """Rows for the Training Queue partition of one of the tenant's open jobs
    (``open_job``); the control plane writes them, the tenant has no JetStream access."""

    job_id: str
    fields: dict[str, TensorBytes]
    #: The first row's index among the job's rows (the rows put before it): a put
    #: repeated after a lost reply then adds nothing (None: appended wherever).
    offset: int | None = None

    def __post_init__(self) -> None:
        if self.offset is not None and (isinstance(self.offset, bool) or not 0 <= self.offset < 1 << 40):
            raise InvalidSpec(f"offset must be an integer in 0..2**40, got {self.offset!r:.40}")


class PolicyQuery(Wire, kw_only=True, omit_defaults=True):
    """A version (default: latest) of a workload's policy; with ``limit`` > 0 also
    ``limit`` bytes of its weights from ``offset`` (``export``)."""

    workload: str
    version: int | None = None
    offset: int = 0
    limit: int = 0


class VideoQuery(Wire, kw_only=True, omit_defaults=True):
    """``limit`` bytes from ``offset`` of video ``index`` of one of the tenant's own
    evaluations (``WorkloadRecord.videos``); the object is named by the control
    plane from the tenant and the record, never by the request."""

    workload: str
    index: int = 0
    offset: int = 0
    limit: int = 0


class EventEntry(Wire, kw_only=True):
    seq: int
    event: msgspec.Raw


class ApiReply(Wire, kw_only=True, omit_defaults=True):
    workload: WorkloadRecord | None = None
    workloads: list[WorkloadRecord] = []
    job: TrainingJob | None = None
    #: read_events: the page, and the stream sequence to continue after.
    events: list[EventEntry] = []
    last_seq: int = 0
    #: train_result's start: the new training client's epoch (``TrainCall.client``).
    client: int = 0
    #: get_policy: the version's record and a slice of its weights.
    policy: PolicyRecord | None = None
    data: bytes = b""
    #: put_data: rows now in the partition.
    rows: int = 0
    #: Why open_job got no job (admission: limits reached; retry later), in words
    #: and as the scheduler's refusal code; ``position``: its place in the admission
    #: queue when its wait ended (1: next; 0: it did not queue), ``waited_s``: how long.
    refused: str = ""
    refusal: str = ""
    position: int = 0
    waited_s: float = 0.0
    error: ErrorBody | None = None
