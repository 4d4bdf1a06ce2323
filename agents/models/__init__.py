"""Models: the resident vision-language backbone, tenant action modules, grouped execution.

The heads live in ``agents.models.heads`` (one module per family; importing any
of them registers every head). See docs/ARCHITECTURE.md, "Policies that learn".
"""
