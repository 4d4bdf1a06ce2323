"""Models: the resident vision-language backbone, tenant action modules, grouped execution.

Importing the package registers every head (it imports ``token_heads``). See
docs/ARCHITECTURE.md, "Policies that learn".
"""

# Register the token-reading heads (oft_attn, gr00t_flow) wherever any model module is
# imported, so HEADS / build_head know every action module in every process.
from joynexus.agents.models import token_heads as _token_heads  # noqa: F401
