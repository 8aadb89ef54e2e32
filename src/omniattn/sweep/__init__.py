"""Randomized differential sweep: `omniattn.attention` against the float64 reference on random
configurations of every feature, forward and backward (`omniattn check --sweep N --seed S`).

configs: the draws, each config from its own seed, so any config re-runs by itself with
`omniattn check --config <its seed>` (on the same kind of device); calls: a config's tensors and
its call evaluated; compare: the pass rule; runner: configs run in this process or in worker
processes, and the report.
"""
from .calls import build_call
from .compare import ABSOLUTE_FLOOR, EMPTY_ROWS, RELATIVE_TOLERANCE, check_quantity
from .configs import BLOCK_BUILDERS, GPU_LIMITS, INTERPRETER_LIMITS, config_seed, draw_config
from .runner import detail, kernels_run_here, report, run_config, run_seeds, sweep

__all__ = ["ABSOLUTE_FLOOR", "BLOCK_BUILDERS", "EMPTY_ROWS", "GPU_LIMITS", "INTERPRETER_LIMITS",
           "RELATIVE_TOLERANCE", "build_call", "check_quantity", "config_seed", "detail",
           "draw_config", "kernels_run_here", "report", "run_config", "run_seeds",
           "sweep"]
