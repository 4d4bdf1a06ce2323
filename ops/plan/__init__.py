"""The capacity planner, ``joynexus plan``: ``sim`` (the real scheduler core on a
simulated clock), ``planner`` (a main job's run or a described deployment in,
predicted figures out; the command's options) and ``scale`` (the paper's layout
and the tenant sweep)."""
