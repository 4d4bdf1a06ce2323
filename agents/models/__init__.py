"""Models: the resident vision-language backbone, tenant action modules, grouped execution."""
