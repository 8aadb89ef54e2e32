"""`run_suite`: every workload x mode x provider of `omniattn bench` timed, one record each."""
from __future__ import annotations

import dataclasses

import torch

from .pairs import flop_count, workload_pairs
from .providers import default_providers, forward_plan, provider_builders, providers_for
from .timing import Timing, measure, timer_fields
from .workloads import ExtraInputs, Workload, make_inputs

MODES = ("fwd", "fwd+bwd")


def _workload_fields(workload: Workload) -> dict:
    fields = dataclasses.asdict(workload)
    fields["dtype"] = str(workload.dtype).removeprefix("torch.")
    return fields


def run_suite(
    workloads: list[Workload],
    providers: list[str] | tuple[str, ...] | None = None,
    modes: tuple[str, ...] = MODES,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> list[dict]:
    """One dict per workload x mode x provider: the workload's fields, device, provider, mode,
    flops (tile count), flops_exact, active_tile_fraction (element masks and row lengths; else
    None), ms (the median per call), tflops, error, and how ms was taken: timer, threads (CPU
    threads; None on the GPU), warmup_runs and timed_runs (calls; None where do_bench picks
    them, see `Timing`). A provider that raises is recorded with its error (ms, tflops and the
    counts None) and the suite goes on. Sparse workloads (density set) run only
    BLOCK_MASK_PROVIDERS, dynamic ones (topk set) and rows ones (row_lengths set) only
    ELEMENT_MASK_PROVIDERS, paged ones only omniattn; forward-only ones (decoding) skip
    fwd+bwd; masks, bias and lengths are built once per workload (`ExtraInputs`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    providers = tuple(providers or default_providers(device))
    builders = provider_builders()
    unknown = [p for p in providers if p not in builders]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; choose from {list(builders)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")

    runs = sum(len(providers_for(workload, providers)) * len(_modes(workload, modes))
               for workload in workloads)
    bar = _progress_bar(runs, progress)
    results = []
    for workload in workloads:
        extra = ExtraInputs(workload, device)
        counts = None
        for mode in _modes(workload, modes):
            inputs = make_inputs(workload, device, requires_grad=mode == "fwd+bwd")
            if counts is None:  # on the tiles omniattn's forward runs (the same in every mode)
                counts = workload_pairs(workload, extra,
                                        forward_plan(workload, extra, *inputs[:3]).tiles)
            pairs, exact, active_tile_fraction = counts
            flops = flop_count(workload, pairs, mode)
            for provider in providers_for(workload, providers):
                if bar is not None:
                    bar.set_description(f"{workload.name} {mode} {provider}")
                try:
                    timing = measure(builders[provider], workload, extra, mode, device, inputs)
                    error = None
                except Exception as exc:  # a backend that is unavailable here, or out of memory
                    timing, error = Timing(None, None, None), _describe_error(exc)
                ms = timing.ms
                results.append({
                    **_workload_fields(workload), "device": device.type, "provider": provider,
                    "mode": mode, "flops": flops, "flops_exact": flop_count(workload, exact, mode),
                    "active_tile_fraction": active_tile_fraction, "ms": ms,
                    "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12, "error": error,
                    **timer_fields(device), "warmup_runs": timing.warmup_runs,
                    "timed_runs": timing.timed_runs,
                })
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return results


def _modes(workload: Workload, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The modes a workload is timed in: a forward-only one (decoding) skips fwd+bwd."""
    return tuple(m for m in modes if m == "fwd" or not workload.forward_only)


def _describe_error(exc: Exception) -> str:
    """Exception type and the first line of its message (backend errors run to many lines)."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="run", leave=False)
