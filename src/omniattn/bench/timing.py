"""How `omniattn bench` times a provider's step: on the GPU triton's do_bench, on the CPU the
median process CPU time of one thread (`_time_cpu`)."""
from __future__ import annotations

import statistics
from time import process_time
from typing import Callable, NamedTuple

import torch
import triton

from .providers import BuiltAttention
from .workloads import ExtraInputs, Workload

# CPU timing (`_time_cpu`): untimed calls first (the first call of a pass can run 100x slower),
# then at least CPU_MIN_RUNS timed calls lasting CPU_MIN_TIME_S in all, their median reported.
# On one thread, in process CPU time: on a CPU shared with other work, several threads wait on
# each other and a call's wall time swings 10-100x; CPU time leaves out the waits for a core
# (idle, the two clocks agree)
CPU_WARMUP_RUNS = 3
CPU_MIN_RUNS = 20
CPU_MIN_TIME_S = 0.1
CPU_TIMING_THREADS = 1


class Timing(NamedTuple):
    """A median time per call and the calls behind it: `warmup_runs` untimed, then
    `timed_runs` timed (both None where do_bench picks them from its time budgets; all three None
    for a run that raised)."""

    ms: float | None
    warmup_runs: int | None
    timed_runs: int | None


def timer_fields(device: torch.device) -> dict:
    """How a device's runs are timed, as records carry it: the clock and the CPU threads."""
    if device.type == "cuda":
        return {"timer": "triton.testing.do_bench", "threads": None}
    return {"timer": "time.process_time", "threads": CPU_TIMING_THREADS}


def _time_cpu(fn: Callable[[], object]) -> Timing:
    """Median process CPU time per call of fn on CPU_TIMING_THREADS threads, after
    CPU_WARMUP_RUNS untimed calls, over at least CPU_MIN_RUNS calls and CPU_MIN_TIME_S seconds of
    them; the process's thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_TIMING_THREADS)
    try:
        for _ in range(CPU_WARMUP_RUNS):
            fn()
        seconds = []
        while len(seconds) < CPU_MIN_RUNS or sum(seconds) < CPU_MIN_TIME_S:
            start = process_time()
            fn()
            seconds.append(process_time() - start)
    finally:
        torch.set_num_threads(threads)
    return Timing(statistics.median(seconds) * 1e3, CPU_WARMUP_RUNS, len(seconds))


def _step(attn: BuiltAttention, mode: str, q, k, v, dout) -> Callable[[], object]:
    if mode == "fwd":
        def forward():
            # a bias requires grad in both modes (built once per workload): record no graph
            with torch.no_grad():
                return attn.fn(q, k, v)

        return forward
    leaves = (q, k, v, *attn.learnable)
    return lambda: torch.autograd.grad(attn.fn(q, k, v), leaves, dout)


def measure(build, workload: Workload, extra: ExtraInputs, mode: str, device: torch.device,
            inputs) -> Timing:
    step = _step(build(workload, device, extra), mode, *inputs)
    if device.type != "cuda":
        return _time_cpu(step)
    step()  # compiles kernels and surfaces an unavailable backend before timing starts
    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return Timing(ms, None, None)

