"""A million tokens over every visible GPU (issue #56): `omniattn.distributed.attention`
forward and forward+backward, one process per GPU (torch.multiprocessing, NCCL, NVLink
multicast off), zigzag layout.

B1 H32 Hk8 (GQA) D128 bf16 at --seqlen (default 1,048,576), two cases: causal, and causal with
a key bias (B, Hk, 1, S) and top-k (--topk, default 4096; the bias is the top-k scores);
methods ring, ulysses and auto. A method the API refuses for a case (the ring takes no top-k)
is recorded with the refusal's message; auto is recorded with its choice, and with the
timings of that method where it ran in the same case (the same calls). For each (case,
method):

- time per step, forward and forward+backward (gradients of q, k, v and the bias): the
  median over calls of the slowest rank's CUDA-event time, the ranks at a barrier before
  every call;
- TFLOP/s per GPU: 4 x D FLOPs per (query, key) pair of each head forward, 3.5x that forward +
  backward (FlashAttention's convention, as `omniattn bench`), divided by the GPUs and the
  time. `*_tflops_per_gpu_causal_pairs` counts the causal pairs S (S + 1) / 2 per head (the
  causal kernels' 128-wide diagonal tiles add about 128 / S: 0.1% at 128k, 0.01% at 1M);
  top-k's kernels walk fewer of them (the tiles no row keeps skipped) at more cost per tile,
  so for bias_topk this is an upper bound of the work, and `*_tflops_per_gpu_topk_pairs`
  (each row's min(row + 1, K) kept keys) the work that counts; the API does not expose the
  tiles a top-k call walks;
- beside them the single-GPU figure of a causal call at --baseline-seqlen (default 131072),
  alone on GPU 0 before the rest, the ratio of each per-GPU figure to it on causal pairs, and
  (causal case) whether forward+backward reaches 80% of it;
- peak memory per GPU: torch.cuda.max_memory_allocated of each rank, reset before each mode's
  calls (the rank's inputs included);
- the communication share not hidden under compute: 1 - (time of the same calls with every
  collective replaced by a local copy) / time (cp_common.local_collectives);
- the check: --check-rows query rows (the first and last, either side of every zigzag chunk
  boundary and of the K-th key, the rest spread evenly), their output, lse and dq gathered
  from the ranks that own them, against the float64 reference of those rows alone (each row
  against the keys it sees, `omniattn.reference.attention_reference`, top-k by its rule):
  error <= 2 x the error of plain PyTorch in bf16 for the same rows + atol. A row's dq
  depends on its own forward only; dout is a fixed random tensor. No (S, S) tensor is built:
  one row's reference is (H, S).

    python benchmarks/cp_million.py --json benchmarks/results/nvidia-h100-x8-cp-million.json

Written without a GPU; only its --cpu-smoke mode has run (gloo, 2 processes, tiny sizes, the
reference path: tests/distributed/test_cp_million.py). At 1M on 8 GPUs a forward+backward
step should take seconds, and each method's is run (warmup + reps) x 2 times and once more
for the check: several minutes in all, besides compiling. Each rank first builds the whole
sequence's inputs (about 20 GiB in bf16 at these shapes) and keeps its shards. The processes,
timing, the communication's stand-ins and the record are cp_common.py's, shared with
cp_scaling.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tempfile

import torch
import torch.distributed as dist

from cp_common import (ATOL, add_run_arguments, comm_share, defaults, environment, every_rank,
                       init_group, local_collectives, max_error, median_ms, rank_device, recorded,
                       run_and_report, shard_inputs, shared_settings, spawned, steps)

CASES = ("causal", "bias_topk")
METHODS = ("ring", "ulysses", "auto")
CHECKED = ("out", "lse", "dq")
# backward = 2.5x forward FLOPs (FlashAttention's convention, omniattn/bench/pairs.py's)
FWD_BWD_FLOP_FACTOR = 3.5
# the bound: per-GPU TFLOP/s at least this share of the single-GPU causal call's
TFLOPS_TARGET = 0.8
MODES = ("fwd", "fwd_bwd")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run: where (device type, world size), the shapes and dtype, the length timed and the
    single-GPU baseline's, top-k's K, the rows checked, the cases and methods, the timing's
    calls."""

    device: str
    world: int
    batch: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: str
    seqlen: int
    baseline_seqlen: int
    topk: int
    check_rows: int
    cases: tuple[str, ...]
    methods: tuple[str, ...]
    warmup: int
    reps: int
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# ---- inputs and the rows checked ----

def full_inputs(settings: Settings, seqlen: int, case: str, device: torch.device):
    """(q, k, v, dout, options) of a case over the whole sequence, the same in every process
    (a seeded generator on the device): q and dout (B, S, H, D), k and v (B, S, Hk, D);
    options are omniattn.attention's keywords, causal, and for bias_topk the key bias
    (B, Hk, 1, S) and topk."""
    generator = torch.Generator(device=device).manual_seed(
        settings.seed + seqlen + CASES.index(case))
    batch, heads, heads_k, head_dim = (settings.batch, settings.heads, settings.heads_k,
                                       settings.head_dim)

    def randn(*size):
        return torch.randn(size, generator=generator, device=device,
                           dtype=settings.torch_dtype)

    q, k, v = (randn(batch, seqlen, heads, head_dim), randn(batch, seqlen, heads_k, head_dim),
               randn(batch, seqlen, heads_k, head_dim))
    dout = randn(batch, seqlen, heads, head_dim)
    options = {"causal": True}
    if case == "bias_topk":
        options.update(attn_bias=randn(batch, heads_k, 1, seqlen), topk=settings.topk)
    return q, k, v, dout, options


def sample_rows(seqlen: int, world: int, count: int, topk: int) -> list[int]:
    """The query rows checked, sorted: the first and the last two, either side of every zigzag
    chunk boundary (where the ranks' shards meet) and of the K-th key (where top-k starts
    leaving keys out), and evenly spaced rows (each moved on to the next row not yet taken)
    up to `count` rows in all (only the fixed ones where they are more, at most S)."""
    chunk = seqlen // (2 * world)
    taken = {0, seqlen - 2, seqlen - 1}
    taken.update(row for boundary in range(chunk, seqlen, chunk) for row in (boundary - 1, boundary))
    taken.update(row for row in (topk - 1, topk) if row < seqlen)
    spread = max(min(count, seqlen) - len(taken), 0)
    for i in range(spread):
        row = int((i + 0.5) * seqlen / spread)
        while row in taken:
            row = (row + 1) % seqlen
        taken.add(row)
    return sorted(taken)


def owner(row: int, world: int, seqlen: int) -> tuple[int, int]:
    """(rank, index in its shard) of a global row under the zigzag layout."""
    from omniattn.distributed.layout import chunks

    for rank in range(world):
        for chunk in chunks("zigzag", rank, world, seqlen):
            if chunk.start <= row < chunk.stop:
                return rank, chunk.local + row - chunk.start
    raise ValueError(f"row must lie in [0, {seqlen}), got {row}")


def gathered_rows(local: torch.Tensor, rows: list[int], dim: int, group,
                  seqlen: int) -> torch.Tensor:
    """The global `rows` of a sharded tensor (this rank's shard `local`, positions along
    `dim`), on every rank, from the ranks that own them: (.., R, ..) along dim."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = [owner(row, world, seqlen) for row in rows]
    index = torch.tensor([i if r == rank else 0 for r, i in where], device=local.device)
    mine = local.detach().index_select(dim, index).contiguous()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return torch.stack([parts[r].select(dim, j) for j, (r, _) in enumerate(where)], dim)


def reference_rows(rows: list[int], q_rows, k, v, dout_rows, options: dict,
                   dtype: torch.dtype) -> dict:
    """{'out' (B, R, H, D), 'lse' (B, H, R), 'dq' (B, R, H, D)} of the sampled rows by
    omniattn.reference in `dtype` (float64: the exact result; the inputs' dtype: plain
    PyTorch), each row alone against the keys it sees: q_rows / dout_rows (B, R, H, D), those
    rows of q and dout; k, v (B, S, Hk, D) and the options of the whole sequence."""
    from omniattn.reference import attention_reference

    found = {name: [] for name in CHECKED}
    for j, row in enumerate(rows):
        seen = row + 1  # causal: keys [0, row]; a single row sees every key it is given
        query = q_rows[:, j:j + 1].detach().to(dtype).requires_grad_()
        selection = {}
        if "attn_bias" in options:  # the key bias is also top-k's scores (its default)
            selection = {"attn_bias": options["attn_bias"][..., :seen].to(dtype),
                         "topk": options["topk"]}
        # upcast=False: the arithmetic in `dtype`, float64 included
        out, lse = attention_reference(query, k[:, :seen].to(dtype), v[:, :seen].to(dtype),
                                       return_lse=True, upcast=False, **selection)
        (dq,) = torch.autograd.grad(out, query, dout_rows[:, j:j + 1].to(dtype))
        for name, value in zip(CHECKED, (out, lse, dq)):
            found[name].append(value.detach())
    return {"out": torch.cat(found["out"], 1), "lse": torch.cat(found["lse"], 2),
            "dq": torch.cat(found["dq"], 1)}


def rows_check(got: dict, exact: dict, plain: dict, dtype: torch.dtype) -> dict:
    """The 2x rule on the sampled rows: each quantity's max error against float64 within
    twice plain PyTorch's + atol."""
    errors, ok = {}, True
    for name in CHECKED:
        atol = ATOL[torch.float32 if name == "lse" else dtype]
        errors[name] = {"cp": max_error(got[name], exact[name]),
                        "plain": max_error(plain[name], exact[name]), "atol": atol}
        ok = ok and errors[name]["cp"] <= 2 * errors[name]["plain"] + atol
    return {"ok": ok, "errors": errors}


def case_inputs(settings: Settings, case: str, rows: list[int], device: torch.device, group):
    """(leaves, dout, options, reference): this rank's shards of a case's inputs (leaves q, k,
    v and the bias's shard); on rank 0 {'exact', 'plain'}, reference_rows of the sampled rows,
    or {'error'} where computing them failed (None elsewhere). The full-sequence tensors are
    freed before returning."""
    q, k, v, dout, options = full_inputs(settings, settings.seqlen, case, device)
    leaves, dout_local, local_options = shard_inputs(q, k, v, dout, options, group)
    index = torch.tensor(rows, device=device)
    q_rows, dout_rows = q.index_select(1, index), dout.index_select(1, index)
    del q, dout  # before the reference's float64 keys
    reference = None
    if dist.get_rank(group) == 0:
        reference = {}
        recorded(reference, lambda reference: reference.update(
            exact=reference_rows(rows, q_rows, k, v, dout_rows, options, torch.float64),
            plain=reference_rows(rows, q_rows, k, v, dout_rows, options,
                                 settings.torch_dtype)))
        if device.type == "cuda":  # the float64 keys' blocks back, before the timed calls
            torch.cuda.empty_cache()
    dist.barrier(group)  # the other ranks wait for rank 0's reference, or its failure
    return leaves, dout_local, local_options, reference


# ---- the processes ----

def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    """The peak allocated since _reset_peak, GiB; None on the CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def single_worker(rank: int, settings: Settings, out_file: str) -> None:
    """The single-GPU omniattn.attention of the causal case at baseline_seqlen, alone on GPU 0:
    forward and forward+backward times and peaks."""
    import omniattn

    device = rank_device(settings.device, rank)
    record = {"case": "causal", "seqlen": settings.baseline_seqlen}

    def measure(record):
        q, k, v, dout, options = full_inputs(settings, settings.baseline_seqlen, "causal",
                                             device)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        record["explain"] = str(omniattn.explain(q, k, v, **options))
        for mode, fn in steps(lambda *qkv: omniattn.attention(*qkv, **options), leaves,
                              dout).items():
            _reset_peak(device)
            record[f"{mode}_ms"] = median_ms(fn, settings.warmup, settings.reps, device)["ms"]
            record[f"{mode}_peak_gib"] = _peak_gib(device)

    recorded(record, measure)
    pathlib.Path(out_file).write_text(json.dumps(record))


def measure_method(record: dict, settings: Settings, leaves, dout, options: dict, rows,
                   reference: dict | None, timed: dict, device: torch.device, group) -> None:
    """One (case, method) into record: the refusal's message where the API refuses it; else
    explain's plan, the timings with and without communication, each rank's peaks and (rank
    0) the check of the sampled rows. auto takes the record of its choice where `timed` (the
    case's records by method) has one; a method timed here is added to it."""
    from omniattn import distributed as cp

    method = record["method"]
    try:
        plan = cp.explain(*leaves[:3], method=method, **options)
    except ValueError as refusal:  # validated alike on every rank: all of them refuse
        record["refused"] = str(refusal)
        return
    record["explain"] = str(plan)
    if method == "auto":
        record["chose"] = plan.method
        if plan.method in timed:  # the same calls: not timed twice
            record["timed_as"] = plan.method
            record.update({key: value for key, value in timed[plan.method].items()
                           if key.startswith(MODES) or key == "check"})
            return

    def attend(*qkv, **extra):
        return cp.attention(*qkv, method=method, **options, **extra)

    for mode, fn in steps(attend, leaves, dout).items():
        _reset_peak(device)
        found = median_ms(fn, settings.warmup, settings.reps, device, group)
        record[f"{mode}_ms"], record[f"{mode}_rank_ms"] = found["ms"], found["rank_ms"]
        peak = _peak_gib(device)
        record[f"{mode}_peak_gib_per_rank"] = None if peak is None else [
            ranks[0] for ranks in every_rank([peak], device, group)]
        with local_collectives():
            record[f"{mode}_ms_local"] = median_ms(fn, settings.warmup, settings.reps, device,
                                                   group)["ms"]
    out, lse = attend(*leaves[:3], return_lse=True)
    (dq,) = torch.autograd.grad(out, leaves[0], dout)
    got = {"out": gathered_rows(out, rows, 1, group, settings.seqlen),
           "lse": gathered_rows(lse, rows, 2, group, settings.seqlen),
           "dq": gathered_rows(dq, rows, 1, group, settings.seqlen)}
    if reference is not None and "error" in reference:
        record["check"] = {"ok": False, "error": reference["error"]}
    elif reference is not None:
        record["check"] = rows_check(got, reference["exact"], reference["plain"],
                                     settings.torch_dtype)
    timed[plan.method] = record


def case_records(settings: Settings, case: str, rows: list[int], device: torch.device,
                 group):
    """Each method's record of a case, yielded as it is measured; the case's inputs live as
    long as this generator runs."""
    inputs = {}
    recorded(inputs, lambda inputs: inputs.update(zip(
        ("leaves", "dout", "options", "reference"),
        case_inputs(settings, case, rows, device, group))))
    timed = {}
    for method in settings.methods:
        record = {"case": case, "method": method, "seqlen": settings.seqlen}
        if "error" in inputs:  # every rank alike: the inputs are the same size on each
            record["error"] = inputs["error"]
        else:
            recorded(record, lambda record: measure_method(
                record, settings, rows=rows, timed=timed, device=device, group=group, **inputs))
        yield record


def cp_worker(rank: int, settings: Settings, init_file: str, out_file: str) -> None:
    """A rank of the context-parallel group: every case x method; rank 0 writes the records
    after each (kept if a later call kills the processes)."""
    device = rank_device(settings.device, rank)
    group = init_group(device, rank, settings.world, init_file)
    rows = sample_rows(settings.seqlen, settings.world, settings.check_rows, settings.topk)
    records = []
    for case in settings.cases:
        for record in case_records(settings, case, rows, device, group):
            records.append(record)
            if rank == 0:
                pathlib.Path(out_file).write_text(json.dumps(records))
    dist.destroy_process_group()


# ---- the parent: spawn, derive, report ----

def causal_pairs(seqlen: int) -> int:
    """Visible (query, key) pairs of one head under causal: S (S + 1) / 2."""
    return seqlen * (seqlen + 1) // 2


def topk_pairs(seqlen: int, topk: int) -> int:
    """The pairs top-k keeps of one head under causal: row i keeps min(i + 1, K) keys."""
    if seqlen <= topk:
        return causal_pairs(seqlen)
    return causal_pairs(topk) + (seqlen - topk) * topk


def tflops(pairs: int, mode: str, settings: Settings, ms: float, gpus: int) -> float:
    """TFLOP/s per GPU of `pairs` per (batch, head): 4 x D FLOPs a pair forward, 3.5x forward
    + backward."""
    flops = 4 * settings.head_dim * settings.batch * settings.heads * pairs
    if mode == "fwd_bwd":
        flops *= FWD_BWD_FLOP_FACTOR
    return flops / gpus / (ms * 1e9)


def with_rates(single: dict, settings: Settings) -> dict:
    """The single-GPU record with its TFLOP/s on causal pairs."""
    row = dict(single)
    for mode in MODES:
        if single.get(f"{mode}_ms") is not None:
            row[f"{mode}_tflops_causal_pairs"] = tflops(causal_pairs(single["seqlen"]), mode,
                                                        settings, single[f"{mode}_ms"], 1)
    return row


def merged(single: dict, parallel: list[dict], settings: Settings) -> list[dict]:
    """Each (case, method) record with its status ('ok', 'refused', 'failed'), TFLOP/s per GPU
    (causal pairs; top-k's kept pairs too), their ratio to the single-GPU causal call's, the
    communication share, the peak over ranks, and for the causal case whether forward +
    backward reaches TFLOPS_TARGET of the single GPU."""
    rows = []
    for record in parallel:
        row = dict(record)
        row["status"] = "failed" if "error" in record else "refused" if "refused" in record \
            else "ok"
        counts = {"causal_pairs": causal_pairs(record["seqlen"])}
        if record["case"] == "bias_topk":
            counts["topk_pairs"] = topk_pairs(record["seqlen"], settings.topk)
        for mode in MODES:
            ms = record.get(f"{mode}_ms")
            if ms is None:
                continue
            for name, pairs in counts.items():
                row[f"{mode}_tflops_per_gpu_{name}"] = tflops(pairs, mode, settings, ms,
                                                              settings.world)
            alone = single.get(f"{mode}_tflops_causal_pairs")
            if alone:
                row[f"{mode}_tflops_ratio_to_single"] = \
                    row[f"{mode}_tflops_per_gpu_causal_pairs"] / alone
            row[f"{mode}_comm_share"] = comm_share(ms, record.get(f"{mode}_ms_local"))
            peaks = record.get(f"{mode}_peak_gib_per_rank")
            row[f"{mode}_peak_gib"] = max(peaks) if peaks else None
        if record["case"] == "causal" and "fwd_bwd_tflops_ratio_to_single" in row:
            row["target_met"] = row["fwd_bwd_tflops_ratio_to_single"] >= TFLOPS_TARGET
        rows.append(row)
    return rows


def table(single: dict, rows: list[dict], settings: Settings) -> str:
    def number(value, width, digits=2):
        return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    def share(value):
        return f"{100 * value:5.1f}%" if value is not None else "     -"

    lines = []
    if "error" in single:
        lines.append(f"1 GPU causal S{single['seqlen']}: failed: "
                     f"{single['error'].strip().splitlines()[-1]}")
    else:
        lines.append(
            f"1 GPU causal S{single['seqlen']}: fwd {number(single.get('fwd_ms'), 0)} ms "
            f"({number(single.get('fwd_tflops_causal_pairs'), 0, 1)} TFLOP/s), f+b "
            f"{number(single.get('fwd_bwd_ms'), 0)} ms "
            f"({number(single.get('fwd_bwd_tflops_causal_pairs'), 0, 1)} TFLOP/s)")
    lines.append(f"{settings.world} GPUs, S {settings.seqlen}; TFLOP/s per GPU on causal pairs "
                 f"(bias_topk: K {settings.topk} kept pairs in brackets)")
    lines.append(f"{'case':<10}{'method':<16}| {'fwd ms':>9} {'f+b ms':>9} | {'TF/GPU':>6} "
                 f"{'vs 1':>5} {'comm':>6} {'GiB':>6} | check")
    for r in rows:
        method = r["method"] + (f"->{r['chose']}" if "chose" in r else "")
        name = f"{r['case']:<10}{method:<16}"
        if r["status"] == "refused":
            lines.append(f"{name}| refused: {r['refused']}")
            continue
        if r["status"] == "failed":
            lines.append(f"{name}| failed: {r['error'].strip().splitlines()[-1]}")
            continue
        kept = r.get("fwd_bwd_tflops_per_gpu_topk_pairs")
        check = r.get("check")
        verdict = "-" if check is None else "ok" if check["ok"] else "FAILED"
        if check is not None and "error" in check:
            verdict += f" (reference failed: {check['error'].strip().splitlines()[-1]})"
        elif check is not None:
            worst = max(check["errors"], key=lambda n: check["errors"][n]["cp"] / (
                2 * check["errors"][n]["plain"] + check["errors"][n]["atol"]))
            e = check["errors"][worst]
            verdict += f" (closest: {worst} {e['cp']:.3g}, plain {e['plain']:.3g})"
        target = r.get("target_met")
        lines.append(
            f"{name}| {number(r.get('fwd_ms'), 9)} {number(r.get('fwd_bwd_ms'), 9)} | "
            f"{number(r.get('fwd_bwd_tflops_per_gpu_causal_pairs'), 6, 1)} "
            f"{number(r.get('fwd_bwd_tflops_ratio_to_single'), 5)} "
            f"{share(r.get('fwd_bwd_comm_share'))} {number(r.get('fwd_bwd_peak_gib'), 6)} | "
            f"{verdict}"
            + (f" [{kept:.1f}]" if kept is not None else "")
            + ("" if target is None else f" {'met' if target else 'MISSED'} "
               f"(>= {TFLOPS_TARGET})"))
    return "\n".join(lines)


def run(settings: Settings) -> dict:
    """The single-GPU baseline and the context-parallel run, each in processes of their own;
    the derived results."""
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        single, single_failure = spawned(single_worker, (settings,), 1, folder / "single.json",
                                         {"case": "causal", "seqlen": settings.baseline_seqlen})
        parallel, cp_failure = spawned(cp_worker, (settings, str(folder / "init")),
                                       settings.world, folder / "cp.json", [])
    single = with_rates(single, settings)
    return {"environment": environment(settings.device, settings.world),
            "settings": dataclasses.asdict(settings),
            "check_rows": sample_rows(settings.seqlen, settings.world, settings.check_rows,
                                      settings.topk),
            "single": single, "results": merged(single, parallel, settings),
            "failures": [f for f in (single_failure, cp_failure) if f is not None]}


def check_settings(settings: Settings) -> None:
    """What the layout and the shapes need, before any process starts."""
    if settings.world < 1:
        raise SystemExit(f"--world must be at least 1, got {settings.world}")
    if settings.device == "cuda" and settings.world > torch.cuda.device_count():
        raise SystemExit(f"--world {settings.world} needs as many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    if settings.seqlen % (2 * settings.world):
        raise SystemExit(f"--seqlen {settings.seqlen} must be a multiple of 2 x {settings.world}"
                         f" ranks = {2 * settings.world} (the zigzag layout's chunks)")
    if settings.heads % settings.heads_k:
        raise SystemExit(f"--heads {settings.heads} must be a multiple of --heads-k "
                         f"{settings.heads_k} (GQA groups)")
    for name, value in (("--topk", settings.topk), ("--check-rows", settings.check_rows),
                        ("--reps", settings.reps)):
        if value < 1:
            raise SystemExit(f"{name} must be at least 1, got {value}")


def parse_settings(argv=None) -> tuple[Settings, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=None, help="default 1048576 (smoke 256)")
    parser.add_argument("--baseline-seqlen", type=int, default=None,
                        help="the single-GPU causal call's length (default 131072; smoke 128)")
    parser.add_argument("--topk", type=int, default=None, help="default 4096 (smoke 16)")
    parser.add_argument("--check-rows", type=int, default=None,
                        help="query rows checked (default 64; smoke 16)")
    parser.add_argument("--heads-k", type=int, default=None, help="default 8 (smoke 2)")
    add_run_arguments(parser, METHODS, CASES, heads=32, warmup="default 1", reps=3)
    args = parser.parse_args(argv)
    pick = defaults(args)
    settings = Settings(
        **shared_settings(args, pick, heads=32, reps=3), heads_k=pick(args.heads_k, 8, 2),
        seqlen=pick(args.seqlen, 1048576, 256),
        baseline_seqlen=pick(args.baseline_seqlen, 131072, 128),
        topk=pick(args.topk, 4096, 16), check_rows=pick(args.check_rows, 64, 16),
        warmup=pick(args.warmup, 1, 1))
    return settings, args.json


def main(argv=None) -> None:
    settings, json_path = parse_settings(argv)
    check_settings(settings)
    run_and_report(settings, json_path, run,
                   lambda results: table(results["single"], results["results"], settings))


if __name__ == "__main__":
    main()
