"""Benchmark suites behind `omniattn bench`: omniattn against SDPA backends and FlexAttention.

workloads: the shapes and masks of each suite, and what a workload adds to q, k, v (block mask,
element mask, bias, per-row key lengths, packed documents), built once and shared by every
provider and mode; providers: omniattn, SDPA's backends and FlexAttention, and which of them run
which workload; pairs: the FLOPs, counted on the tiles omniattn's forward kernel computes as
`omniattn.explain` plans the call (so TFLOP/s compares providers on equal work), the exact
visible pairs beside them; timing: do_bench on the GPU, CPU time on the CPU; runner: the suite
run, one record per workload x mode x provider; report: the table and the JSON records; plot:
their PNG.
"""
from .plot import plot_results
from .providers import PROVIDERS
from .report import device_name, format_table, load_records, write_json
from .runner import MODES, run_suite
from .workloads import SUITES, Workload, default_workloads

__all__ = ["MODES", "PROVIDERS", "SUITES", "Workload", "default_workloads", "device_name",
           "format_table", "load_records", "plot_results", "run_suite", "write_json"]
