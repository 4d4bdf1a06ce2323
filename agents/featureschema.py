"""What one tenant's policy consumes and produces (:class:`FeatureSchema`), each
hosted base model's feature width, and the schema of a published policy record:
pure, and light (no torch: the control plane, the producers' supervisors and the
SDK's side of the service check schemas without a model).

:mod:`joynexus.agents.models.features` re-exports :class:`FeatureSchema` beside the
tensors it describes; :mod:`joynexus.agents.models.policyio` re-exports
:func:`feature_schema_of` and :func:`schema_spec`. See docs/ARCHITECTURE.md
("Light roles").
"""

from __future__ import annotations

from dataclasses import dataclass

from joynexus.schemas.catalog import BASE_MODELS, PI05_BASE_MODELS, SMOLVLA_BASE_MODELS
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.inference import FeatureSchemaSpec, PolicyRecord

__all__ = [
    "FEATURE_DIMS",
    "PI05_KV",
    "SMOLVLA_KV",
    "FeatureSchema",
    "feature_dim",
    "feature_schema_of",
    "kv_layers",
    "schema_from_spec",
    "schema_spec",
]

#: The width of the features each backbone size gives a head (its language model's
#: hidden size: ``agents.models.backbone_config.SIZES[size]["text"]["hidden_size"]``, which
#: a test checks against this table).
FEATURE_DIMS: dict[str, int] = {"tiny": 64, "bench": 384}
#: A π0.5 base's cache per size: (layers, key/value heads x head dim), as
#: ``agents.models.pi05_config.GEMMA_VARIANTS`` builds it (a test checks both agree).
PI05_KV: dict[str, tuple[int, int]] = {"tiny": (2, 8), "gemma_300m": (18, 256), "gemma_2b": (18, 256)}
#: A SmolVLA base's cache per size: (kept VLM layers, key/value heads x head dim), as
#: ``agents.models.smolvla_config.SMOLVLM_SIZES`` builds it (a test checks both agree).
SMOLVLA_KV: dict[str, tuple[int, int]] = {"tiny": (4, 32), "smolvlm2_500m": (16, 320)}
#: The expert heads and the cache table of the base family each attends to.
_EXPERT_KV: dict[str, tuple[dict[str, str], dict[str, tuple[int, int]]]] = {
    "pi05_expert": (PI05_BASE_MODELS, PI05_KV), "smolvla_expert": (SMOLVLA_BASE_MODELS, SMOLVLA_KV),
}


def feature_dim(base_model: str) -> int:
    """The feature width of a hosted base model (``schemas.catalog.BASE_MODELS``; a π0.5 or
    SmolVLA base's is its cache's, every layer's keys and values: ``PI05_BASE_MODELS``,
    ``SMOLVLA_BASE_MODELS``)."""
    for models, table in _EXPERT_KV.values():
        if base_model in models:
            layers, width = table[models[base_model]]
            return layers * 2 * width
    return FEATURE_DIMS[BASE_MODELS[base_model]]


def kv_layers(base_model: str, action_module: str) -> int:
    """``HeadConfig.kv_layers`` of a head on this base: the π0.5 base's depth for its
    ``pi05_expert``, the SmolVLA base's kept layers for its ``smolvla_expert``, 0 otherwise."""
    models, table = _EXPERT_KV.get(action_module, ({}, {}))
    if base_model not in models:
        return 0
    return table[models[base_model]][0]


@dataclass(frozen=True)
class FeatureSchema:
    """What one tenant's policy consumes and produces.

    ``camera_slots`` are ordered names ("front", "wrist"); ``image_hw`` is the
    camera image size every slot must have; ``action_horizon`` x ``action_dim``
    is the action chunk a head predicts.
    """

    camera_slots: tuple[str, ...]
    image_hw: tuple[int, int]
    state_dim: int
    action_dim: int
    action_horizon: int
    base_model: str = "qwen2.5-vl-tiny"
    history_len: int = 0
    channels: int = 3
    #: What the state vector is made of (e.g. ``("agent/qpos", "extra/obj_pose")``);
    #: empty when unknown (a dataset made elsewhere). Part of the signature when
    #: given, so a policy is only ever fed the state it was trained on.
    state_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_keys", tuple(self.state_keys))
        for k in self.state_keys:
            if not isinstance(k, str) or not k or not all(c.isalnum() or c in "_-./" for c in k):
                raise InvalidSpec(
                    f"FeatureSchema.state_keys entry {k!r} is not a plain name: use letters, digits, '_', '-', '.', '/'"
                )
        slots = tuple(self.camera_slots)
        object.__setattr__(self, "camera_slots", slots)
        object.__setattr__(self, "image_hw", tuple(int(x) for x in self.image_hw))
        if not slots:
            raise InvalidSpec("FeatureSchema.camera_slots is empty: give at least one camera slot name")
        if len(set(slots)) != len(slots):
            raise InvalidSpec(f"FeatureSchema.camera_slots {slots!r} has duplicates: name each camera once")
        for s in slots:
            if not s or not all(c.isalnum() or c in "_-." for c in s):
                raise InvalidSpec(
                    f"camera slot name {s!r} is not a plain name: use letters, digits, '_', '-', '.'"
                )
        if len(self.image_hw) != 2 or min(self.image_hw) < 1:
            raise InvalidSpec(f"FeatureSchema.image_hw={self.image_hw!r}: give (height, width), both >= 1")
        for name in ("state_dim", "action_dim", "action_horizon", "channels"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidSpec(f"FeatureSchema.{name}={v!r}: must be an integer >= 1")
        if not isinstance(self.history_len, int) or self.history_len < 0:
            raise InvalidSpec(f"FeatureSchema.history_len={self.history_len!r}: must be an integer >= 0")
        if self.channels not in (1, 3):
            raise InvalidSpec(f"FeatureSchema.channels={self.channels}: use 3 (RGB) or 1 (grey)")
        if not self.base_model or "|" in self.base_model:
            raise InvalidSpec(f"FeatureSchema.base_model={self.base_model!r}: give a name without '|'")

    def signature(self) -> str:
        """Stable string naming this schema, e.g.
        ``qwen2.5-vl-tiny|cams=front,wrist|img=3x56x56|state=8|act=8x7|hist=0``."""
        h, w = self.image_hw
        sig = (
            f"{self.base_model}|cams={','.join(self.camera_slots)}|img={self.channels}x{h}x{w}"
            f"|state={self.state_dim}|act={self.action_horizon}x{self.action_dim}|hist={self.history_len}"
        )
        return sig + (f"|obs={','.join(self.state_keys)}" if self.state_keys else "")

    def backbone_key(self) -> str:
        """The part of the signature that decides whether a backbone forward can be shared."""
        h, w = self.image_hw
        return f"{self.base_model}|cams={','.join(self.camera_slots)}|img={self.channels}x{h}x{w}"


def schema_spec(schema: FeatureSchema) -> FeatureSchemaSpec:
    return FeatureSchemaSpec(
        camera_slots=list(schema.camera_slots),
        image_hw=list(schema.image_hw),
        state_dim=schema.state_dim,
        action_dim=schema.action_dim,
        action_horizon=schema.action_horizon,
        base_model=schema.base_model,
        history_len=schema.history_len,
        channels=schema.channels,
        state_keys=list(schema.state_keys),
    )


def schema_from_spec(s: FeatureSchemaSpec) -> FeatureSchema:
    """The FeatureSchema a wire spec describes (InvalidSpec if it is not one)."""
    if len(s.image_hw) != 2:
        raise InvalidSpec(f"feature schema image_hw={s.image_hw!r}: give (height, width)")
    return FeatureSchema(
        tuple(s.camera_slots),
        (int(s.image_hw[0]), int(s.image_hw[1])),
        s.state_dim,
        s.action_dim,
        s.action_horizon,
        base_model=s.base_model,
        history_len=s.history_len,
        channels=s.channels,
        state_keys=tuple(s.state_keys),
    )


def feature_schema_of(record: PolicyRecord) -> FeatureSchema:
    """The FeatureSchema a record was published with; checks it against the signature."""
    schema = schema_from_spec(record.feature_schema)
    if schema.signature() != record.schema_signature:
        raise InvalidSpec(
            f"policy {record.tenant_id}.{record.workload} v{record.version}: feature_schema gives "
            f"{schema.signature()!r} but the record says {record.schema_signature!r}; republish it"
        )
    return schema
