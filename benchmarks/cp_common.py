"""What the context-parallel benchmarks (cp_scaling.py, cp_million.py) share: one process per
GPU spawned by torch.multiprocessing (NCCL, NVLink multicast off; gloo on the CPU), the timing
(CUDA events, the ranks at a barrier before every call, a call's time its slowest rank's), the
communication share's stand-ins (each collective replaced by a local copy), the inputs' shards,
the 2x rule's errors, and the environment the results are recorded with.

A module of the benchmarks folder, imported by the scripts from their own directory (on
sys.path when run as `python benchmarks/x.py`, and in the processes they spawn).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the 2x rule's absolute slack per dtype (tests/helpers.py); lse is float32 in every dtype
ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
# the timing's own gathering, kept from local_collectives' stand-ins
_all_gather = dist.all_gather


# ---- the command line ----

def add_run_arguments(parser, methods, cases, heads: int, warmup: str, reps: int) -> None:
    """The options both scripts take: the methods and cases, shapes, the timing's calls, the
    processes, the output and the CPU smoke mode (heads / reps: their GPU defaults; warmup:
    its help)."""
    parser.add_argument("--methods", nargs="+", choices=methods, default=list(methods))
    parser.add_argument("--cases", nargs="+", choices=cases, default=list(cases))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help=f"default {heads} (smoke 4)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (smoke 16)")
    parser.add_argument("--warmup", type=int, default=None, help=warmup)
    parser.add_argument("--reps", type=int, default=None, help=f"default {reps} (smoke 2)")
    parser.add_argument("--world", type=int, default=None,
                        help="processes: default every visible GPU (smoke 2)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same code on the CPU at tiny sizes: gloo, the reference path")


def defaults(args):
    """pick(value, gpu, cpu): value where given, else the GPU run's or the smoke run's default;
    a GPU run with no GPU visible stops here."""
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run on GPUs, or pass --cpu-smoke")

    def pick(value, gpu, cpu):
        return value if value is not None else cpu if smoke else gpu

    return pick


def shared_settings(args, pick, heads: int, reps: int) -> dict:
    """The Settings fields both scripts fill alike from add_run_arguments' options."""
    smoke = args.cpu_smoke
    return dict(device="cpu" if smoke else "cuda",
                world=pick(args.world, torch.cuda.device_count() if not smoke else 0, 2),
                batch=args.batch, heads=pick(args.heads, heads, 4),
                head_dim=pick(args.head_dim, 128, 16), dtype="float32" if smoke else "bfloat16",
                cases=tuple(args.cases), methods=tuple(args.methods),
                reps=pick(args.reps, reps, 2))


def run_and_report(settings, json_path: str | None, run, table) -> None:
    """The scripts' main: run(settings) -> results, timed; table(results) printed with the
    failures and the wall time; the JSON written; a failure exits 1."""
    rank_environment(settings.device)
    began = time.perf_counter()
    results = run(settings)
    results["environment"]["wall_s"] = round(time.perf_counter() - began, 1)
    print(table(results))
    for failure in results["failures"]:
        print(f"FAILED, results incomplete: {failure}")
    print(f"{results['environment']['device']} x {settings.world}, "
          f"{results['environment']['wall_s']} s")
    if json_path:
        write_json(json_path, results)
    if results["failures"]:
        raise SystemExit(1)


# ---- the processes ----

def rank_environment(device: str) -> None:
    """What the spawned ranks inherit: no NVLink multicast; on the CPU, the reference path (no
    Triton interpreter)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"


def rank_device(device: str, rank: int) -> torch.device:
    """This rank's device: GPU `rank`, or the CPU (one thread: the ranks share its cores)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def init_group(device: torch.device, rank: int, world: int, init_file: str):
    """The default process group over `world` ranks (NCCL on GPUs, gloo on the CPU), met at
    `init_file`; returns it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=5),
                            device_id=device if backend == "nccl" else None)
    return dist.group.WORLD


def recorded(record: dict, fn) -> None:
    """fn(record), or what it raised in record['error'] (every rank alike, as the ranks make
    the same calls: a length too long for memory fails on each)."""
    try:
        fn(record)
    except Exception:  # noqa: BLE001 - reported in the results, the other configs go on
        record["error"] = traceback.format_exc(limit=4)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def spawned(worker, args: tuple, processes: int, results: pathlib.Path, empty):
    """(what the worker's rank 0 wrote to `results`, or `empty`; None or why a process
    failed): worker(rank, *args, str(results)) in each process; a failure keeps what was
    written before it."""
    failure = None
    try:
        mp.spawn(worker, args=(*args, str(results)), nprocs=processes)
    except Exception as error:  # noqa: BLE001 - a rank died (its traceback is on stderr)
        failure = f"{worker.__name__}: {type(error).__name__}: {str(error)[-2000:]}"
    return (json.loads(results.read_text()) if results.exists() else empty), failure


# ---- inputs ----

def shard_inputs(q, k, v, dout, options, group=None):
    """This rank's shards (zigzag) of full-sequence q, k, v (B, S, H|Hk, D), as leaves, of dout,
    and its keywords: the key bias (B, Hm, 1, S) sharded like k, a leaf too."""
    from omniattn import distributed as cp

    leaves = [cp.shard(t, group).detach().requires_grad_() for t in (q, k, v)]
    local = dict(options)
    if "attn_bias" in options:
        local["attn_bias"] = cp.shard(options["attn_bias"], group, dim=3).detach()
        leaves.append(local["attn_bias"].requires_grad_())
    return leaves, cp.shard(dout, group), local


def steps(attend, leaves, dout) -> dict:
    """The timed calls: 'fwd' records no graph, 'fwd_bwd' is the forward and the gradients of
    every leaf (q, k, v and the bias)."""
    def forward():
        with torch.no_grad():
            return attend(*leaves[:3])

    def forward_backward():
        return torch.autograd.grad(attend(*leaves[:3]), leaves, dout)

    return {"fwd": forward, "fwd_bwd": forward_backward}


# ---- timing ----

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def every_rank(values: list[float], device: torch.device, group=None) -> list[list[float]]:
    """Each rank's `values` (as many on every rank), in rank order; [values] without a group."""
    mine = torch.tensor([values], dtype=torch.float64, device=device)
    if group is None:
        return mine.tolist()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _all_gather(gathered, mine, group=group)
    return torch.cat(gathered).tolist()


def every_rank_object(value, group=None) -> list:
    """Each rank's picklable `value`, in rank order; [value] without a group."""
    if group is None:
        return [value]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def median_ms(fn, warmup: int, reps: int, device: torch.device, group=None) -> dict:
    """{'ms': the median over calls of the slowest rank's time, 'rank_ms': each rank's
    median}. Every call starts with the ranks at a barrier and the device idle; CUDA events
    time it on the GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _synchronize(device)
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    per_rank = every_rank(times, device, group)
    slowest = [max(call) for call in zip(*per_rank)]
    return {"ms": statistics.median(slowest),
            "rank_ms": [statistics.median(row) for row in per_rank]}


def profiled(fn, device: torch.device, top: int = 15) -> dict:
    """Where one call of fn spends its time on this rank (torch.profiler, after a warm call):
    'busy_ms' the sum of its kernels' device time (CPU: of its operators' own time), 'wall_ms'
    the call's wall time, 'ops' the `top` largest {name: ms}. Busy much below wall: the device
    waited (for a transfer, or for the host)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _synchronize(device)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    began = time.perf_counter()
    with profile(activities=[activity]) as prof:
        fn()
        _synchronize(device)
    wall_ms = (time.perf_counter() - began) * 1e3
    own = {}
    for event in prof.key_averages():
        ms = (event.self_device_time_total if device.type == "cuda"
              else event.self_cpu_time_total) / 1e3
        if ms > 0:
            own[event.key[:80]] = own.get(event.key[:80], 0.0) + ms
    ranked = sorted(own.items(), key=lambda item: -item[1])
    return {"busy_ms": sum(own.values()), "wall_ms": wall_ms,
            "ops": {name: round(ms, 4) for name, ms in ranked[:top]}}


@contextlib.contextmanager
def local_collectives():
    """The collectives omniattn.distributed calls, each replaced by a local copy of the bytes
    it would move (what it sends lands in what it receives on the same rank): the calls keep
    their shapes, work and copies, without transfers or waiting for other ranks."""
    real = {name: getattr(dist, name) for name in
            ("batch_isend_irecv", "all_to_all", "all_gather", "reduce_scatter")}

    def batch_isend_irecv(ops):
        sends = [op.tensor for op in ops if op.op is dist.isend]
        receives = [op.tensor for op in ops if op.op is dist.irecv]
        for received, sent in zip(receives, sends):
            received.copy_(sent)
        for received in receives[len(sends):]:  # the ring receives without sending at times
            received.zero_()
        return []

    def all_to_all(received, sends, group=None):
        for part, sent in zip(received, sends):
            part.copy_(sent)

    def all_gather(parts, x, group=None):
        for part in parts:
            part.copy_(x)

    def reduce_scatter(out, parts, group=None):
        out.copy_(parts[dist.get_rank(group)])

    for name, stand_in in (("batch_isend_irecv", batch_isend_irecv), ("all_to_all", all_to_all),
                           ("all_gather", all_gather), ("reduce_scatter", reduce_scatter)):
        setattr(dist, name, stand_in)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def comm_share(ms: float | None, ms_local: float | None) -> float | None:
    """The share of a call's time lost to its collectives: 1 - (time with local copies in
    their place) / time, at least 0; None where either time is missing."""
    if ms is None or ms_local is None:
        return None
    return max(0.0, 1 - ms_local / ms)


# ---- the 2x rule ----

def max_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Max abs difference in float64; equal infinities (lse of rows that see no key) count 0."""
    got, exact = got.double(), exact.double()
    same_inf = torch.isinf(got) & (got == exact)
    diff = torch.where(same_inf, 0.0, (got - exact).abs())
    return float("inf") if torch.isnan(diff).any() else float(diff.max()) if diff.numel() else 0.0


# ---- the record ----

def _git_commit() -> str | None:
    here = pathlib.Path(__file__).resolve().parent
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: str, world: int) -> dict:
    """The GPUs (or the CPU) and their count, the backend, the versions, the commit, the date
    and the command line."""
    import triton

    cuda = device == "cuda"
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "devices": world,
        "backend": "nccl" if cuda else "gloo",
        "nccl": str(torch.cuda.nccl.version()) if cuda else None,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def write_json(path: str, results: dict) -> None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(results, indent=1) + "\n")
