"""Benchmark suite behind `omniattn bench`: omniattn against SDPA backends and FlexAttention.

Every provider takes q (B, Sq, H, D), k/v (B, Sk, Hk, D) in omniattn's layout and returns
out (B, Sq, H, D). FLOPs are counted on the tiles omniattn's forward kernel actually computes
(`computed_pairs`), so TFLOP/s compares providers on equal work; the exact visible-pair count is
recorded beside it as `flops_exact`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton

import omniattn
from omniattn.kernels.configs import forward_config, interpreting

MODES = ("fwd", "fwd+bwd")
# backward = 2.5x forward FLOPs (FlashAttention's convention: 5 matmuls against 2)
_FWD_BWD_FLOP_FACTOR = 3.5

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    causal: bool
    dtype: torch.dtype


def default_workloads(device: str | torch.device) -> list[Workload]:
    """GPU: the FlashAttention-style 4k/16k suite in bf16. CPU: a small fp32 suite that runs in
    seconds (it checks the plumbing; its numbers say nothing about the GPU kernels)."""
    if torch.device(device).type == "cuda":
        shapes = [(2, 4096), (1, 16384)]
        heads, head_dim, dtype = 16, 128, torch.bfloat16
    else:
        shapes = [(1, 256), (1, 512)]
        heads, head_dim, dtype = 4, 64, torch.float32
    return [
        Workload(f"{'causal' if causal else 'dense'}-b{batch}-s{seqlen}", batch, seqlen, seqlen,
                 heads, heads, head_dim, causal, dtype)
        for batch, seqlen in shapes
        for causal in (False, True)
    ]


def _to_sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, S, H, D) <-> (B, H, S, D), a view


def _omniattn(workload: Workload, device: torch.device) -> AttentionFn:
    return lambda q, k, v: omniattn.attention(q, k, v, causal=workload.causal)


def _sdpa(backend, cuda_only: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def build(workload: Workload, device: torch.device) -> AttentionFn:
        if cuda_only and device.type != "cuda":
            raise RuntimeError("benchmarked on CUDA only")
        # SDPA's is_causal is top-left aligned; it equals omniattn's bottom-right causal only here
        if workload.causal and workload.seqlen_q != workload.seqlen_k:
            raise ValueError(f"SDPA is_causal differs from omniattn's causal when Sq != Sk "
                             f"({workload.seqlen_q} != {workload.seqlen_k})")
        enable_gqa = workload.heads != workload.heads_k

        def run(q, k, v):
            with sdpa_kernel(backend):
                out = scaled_dot_product_attention(
                    _to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                    is_causal=workload.causal, enable_gqa=enable_gqa)
            return _to_sdpa_layout(out)

        return run

    return build


def _flex(workload: Workload, device: torch.device) -> AttentionFn:
    if device.type != "cuda":
        raise RuntimeError("benchmarked on CUDA only")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if workload.causal:
        diag_offset = workload.seqlen_k - workload.seqlen_q

        def bottom_right_causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + diag_offset

        block_mask = create_block_mask(bottom_right_causal, None, None, workload.seqlen_q,
                                       workload.seqlen_k, device=device)
    # static shapes, and a fresh compile cache per workload, so the suite never reaches dynamo's
    # recompile limit nor falls back to a slower dynamic-shape kernel
    torch.compiler.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    enable_gqa = workload.heads != workload.heads_k

    def run(q, k, v):
        out = compiled(_to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                       block_mask=block_mask, enable_gqa=enable_gqa)
        return _to_sdpa_layout(out)

    return run


def _providers() -> dict[str, Callable[[Workload, torch.device], AttentionFn]]:
    from torch.nn.attention import SDPBackend

    return {
        "omniattn": _omniattn,
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, cuda_only=True),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, cuda_only=True),
        "sdpa-math": _sdpa(SDPBackend.MATH, cuda_only=False),
        "flex": _flex,
    }


PROVIDERS = tuple(_providers())


def default_providers(device: str | torch.device) -> tuple[str, ...]:
    if torch.device(device).type == "cuda":
        return ("omniattn", "sdpa-cudnn", "sdpa-flash", "flex")
    return ("omniattn", "sdpa-math")


def computed_pairs(seqlen_q: int, seqlen_k: int, causal: bool, block_m: int, block_n: int) -> int:
    """(query, key) pairs inside the key tiles the forward kernel visits, rows clipped to Sq and
    keys to Sk. Causal is bottom-right aligned: query tile m visits key tile n iff
    n * block_n <= min((m + 1) * block_m, Sq) - 1 + Sk - Sq."""
    pairs = 0
    for start_m in range(0, seqlen_q, block_m):
        end_m = min(start_m + block_m, seqlen_q)
        keys = seqlen_k
        if causal:
            key_hi = min(max(end_m + seqlen_k - seqlen_q, 0), seqlen_k)  # keys seen by the last row
            keys = min(triton.cdiv(key_hi, block_n) * block_n, seqlen_k)
        pairs += (end_m - start_m) * keys
    return pairs


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """(query, key) pairs the mask lets through: Sq * Sk dense, the bottom-right triangle causal."""
    if not causal:
        return seqlen_q * seqlen_k
    return sum(min(max(i + 1 + seqlen_k - seqlen_q, 0), seqlen_k) for i in range(seqlen_q))


def _flops(workload: Workload, pairs: int, mode: str) -> float:
    # 2 matmuls (QK^T, PV) of 2 FLOPs per multiply-add
    fwd = 4 * workload.batch * workload.heads * workload.head_dim * pairs
    return fwd * (_FWD_BWD_FLOP_FACTOR if mode == "fwd+bwd" else 1.0)


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    from torch.utils.benchmark import Timer

    # Timer defaults to one thread; measure with the threads the process would really use
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.2).median * 1e3


def _make_inputs(workload: Workload, device: torch.device, requires_grad: bool):
    """q (B, Sq, H, D), k, v (B, Sk, Hk, D) and dout like q; random normal, seeded."""
    generator = torch.Generator(device).manual_seed(0)

    def randn(seqlen, heads, grad):
        shape = (workload.batch, seqlen, heads, workload.head_dim)
        t = torch.randn(shape, generator=generator, device=device, dtype=workload.dtype)
        return t.requires_grad_(grad)

    q = randn(workload.seqlen_q, workload.heads, requires_grad)
    k = randn(workload.seqlen_k, workload.heads_k, requires_grad)
    v = randn(workload.seqlen_k, workload.heads_k, requires_grad)
    dout = randn(workload.seqlen_q, workload.heads, False)
    return q, k, v, dout


def _step(attn: AttentionFn, mode: str, q, k, v, dout) -> Callable[[], object]:
    if mode == "fwd":
        return lambda: attn(q, k, v)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)


def _measure(build, workload: Workload, mode: str, device: torch.device, inputs) -> float:
    step = _step(build(workload, device), mode, *inputs)
    step()  # compiles kernels and surfaces an unavailable backend before timing starts
    return _time_ms(step, device)


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
    flops (tile count), flops_exact, ms, tflops, error. A provider that raises is recorded with
    its error (ms and tflops None) and the suite goes on."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    providers = tuple(providers or default_providers(device))
    builders = _providers()
    unknown = [p for p in providers if p not in builders]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; choose from {list(builders)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")

    bar = _progress_bar(len(workloads) * len(modes) * len(providers), progress)
    results = []
    for workload in workloads:
        tile = forward_config(workload.head_dim, workload.dtype, masked=workload.causal)
        pairs = computed_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal,
                               tile.block_m, tile.block_n)
        exact = visible_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal)
        for mode in modes:
            inputs = _make_inputs(workload, device, requires_grad=mode == "fwd+bwd")
            flops = _flops(workload, pairs, mode)
            for provider in providers:
                if bar is not None:
                    bar.set_description(f"{workload.name} {mode} {provider}")
                ms, error = None, None
                try:
                    ms = _measure(builders[provider], workload, mode, device, inputs)
                except Exception as exc:  # a backend that is unavailable here, or out of memory
                    error = _describe_error(exc)
                results.append({
                    **_workload_fields(workload), "device": device.type, "provider": provider,
                    "mode": mode, "flops": flops, "flops_exact": _flops(workload, exact, mode),
                    "ms": ms, "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12,
                    "error": error,
                })
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return results


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


def _git_commit() -> str | None:
    """HEAD of the checkout the package is imported from; None if it is not a git checkout."""
    checkout = Path(__file__).resolve().parent.parent
    try:
        lines = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=checkout,
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    # an installed copy inside some other repository (a venv in a project) is not this checkout
    return lines[1] if Path(lines[0]).resolve() == checkout else None


def device_name() -> str:
    """The GPU's name, or the CPU's architecture where there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def environment_info() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "triton_interpret": interpreting(),
        "omniattn": omniattn.__version__,
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _header(results: list[dict]) -> str:
    if any(r["device"] == "cpu" for r in results):
        path = "Triton interpreter" if interpreting() else "reference path"
        return f"CPU: omniattn {path} vs SDPA math; not a GPU benchmark"
    return "GPU: TFLOP/s = FLOPs of the tiles omniattn computes / time, for every provider"


def format_table(results: list[dict]) -> str:
    """Plain-text table: one row per (workload, mode), ms and TFLOP/s columns per provider;
    errors are listed under it."""
    providers = list(dict.fromkeys(r["provider"] for r in results))
    rows = {}
    for r in results:
        rows.setdefault((r["name"], r["mode"]), {})[r["provider"]] = r
    header = ["workload", "mode"]
    for provider in providers:
        header += [f"{provider} ms", f"{provider} TFLOP/s"]
    table = [header]
    for (name, mode), by_provider in rows.items():
        line = [name, mode]
        for provider in providers:
            r = by_provider.get(provider)
            if r is None or r["ms"] is None:
                line += ["error" if r else "-", "-"]
            else:
                line += [f"{r['ms']:.3f}", f"{r['tflops']:.4g}"]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [_header(results), ""]
    for i, row in enumerate(table):
        # names left-aligned, numbers right-aligned
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    # one line per distinct error: an unavailable backend fails every run the same way
    errors = {}
    for r in results:
        if r["error"]:
            errors.setdefault((r["provider"], r["error"]), []).append(f"{r['name']} {r['mode']}")
    if errors:
        lines += ["", "errors:"]
        lines += [f"  {provider} ({', '.join(runs)}): {error}"
                  for (provider, error), runs in errors.items()]
    return "\n".join(lines)


def write_json(path: str | Path, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment_info(), "results": results}, f, indent=2)
        f.write("\n")
