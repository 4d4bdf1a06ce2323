"""Tenant action modules (heads): the only trainable part of a tenant's policy.

One module per head family, and the registry they share; importing this
package (or any module in it) registers every family, so ``HEADS`` and
``build_head`` know every action module in every process:

    base      HeadConfig, ActionHead, the registry (register, build_head, HEADS)
    ppo       PPOBatch, ppo_objective (heads with a tractable likelihood)
    gaussian  GaussianPolicy; ``oft_mlp`` (OFTMLPHead)
    flow      ``flow_matching`` (FlowMatchingHead), ``value`` (ValueHead)
    token     heads reading token features: ``oft_attn``, ``gr00t_flow``
    expert    CacheExpertHead: flow matching over a base's prefix cache (SmolVLA's expert)
    pi05      ``pi05_expert``: π0.5's action expert over the π0.5 base's prefix cache
    smolvla   ``smolvla_expert``: SmolVLA's action expert over the SmolVLA base's prefix cache
    tenant    TenantModule: one tenant's head, AdamW and version

See docs/ARCHITECTURE.md, "Policies that learn".
"""

# The families register themselves with ``base.register`` when imported.
from joynexus.agents.models.heads import flow, gaussian, pi05, smolvla, token  # noqa: F401
