"""Models: the resident vision-language backbone, tenant action modules, grouped execution."""

# Register the token-reading heads (oft_attn, gr00t_flow) wherever any model module is
# imported, so HEADS / build_head know every action module in every process.
from joynexus.agents.models import token_heads as _token_heads  # noqa: F401
