"""Figures of measured runs, shared by the benchmarks, the main job and the planner:
``stats`` (interleaved arms, ratios with intervals, the one percentile) and ``plots``
(the report's and the planner's figures)."""
