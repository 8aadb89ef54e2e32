"""Context-parallel scaling (issue #54's acceptance): `omniattn.distributed.attention` on every
visible GPU (NCCL, one process per GPU spawned by torch.multiprocessing, no torchrun) against
the single-GPU `omniattn.attention` of the same full-sequence call, which runs first, alone,
on GPU 0.

B1 H16 D128 bf16 at each --seqlen (default 131072), two cases: causal, and a key bias
(B, H, 1, S) with a causal sliding-window block mask (window --window, default S/4); methods
ring and ulysses, zigzag layout. For each: forward and forward+backward medians (CUDA events;
the ranks meet at a barrier before every call and a call's time is its slowest rank's), the
speedup over the single GPU and the ratio the issue bounds (forward+backward <= 0.6x), and
the communication share: the time lost to the collectives, against the same calls with each
collective replaced by a local copy of the same bytes (no transfer and no waiting for another
rank; the work and shapes unchanged, the results meaningless). At --check-seqlen the outputs,
lse and gradients of every method and case are checked against the float64 reference under
the 2x rule of the single-GPU call's error. --json writes it all with the GPUs, date, commit
and versions. NVLink multicast (NVLS) stays off in the ranks (NCCL_NVLS_ENABLE=0).

    python benchmarks/cp_scaling.py --json benchmarks/results/nvidia-h100-x2-cp-scaling.json

--profile adds each rank's largest kernels (device ms) of one call of each mode to the records.

On 2 H100s at 128k it takes about 140 s, most of it compiling kernels. --cpu-smoke runs
the same code on the CPU at tiny sizes (gloo, 2 processes, the reference path): the test
suite's run (tests/distributed/test_cp_scaling.py).

The processes, the timing, the communication's stand-ins and the record are cp_common.py's,
shared with cp_million.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tempfile

import torch
import torch.distributed as dist

from cp_common import (ATOL, add_run_arguments, comm_share, defaults, environment,
                       every_rank_object, init_group, local_collectives, max_error, median_ms,
                       profiled, rank_device, recorded, run_and_report, shard_inputs,
                       shared_settings, spawned, steps)

CASES = ("causal", "bias_window")
METHODS = ("ring", "ulysses")
QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dbias")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run: where (device type, world size), the shapes and dtype, the lengths timed and
    checked, the cases and methods, the timing's calls."""

    device: str
    world: int
    batch: int
    heads: int
    head_dim: int
    dtype: str
    seqlens: tuple[int, ...]
    check_seqlen: int
    window: int | None
    block_size: int
    cases: tuple[str, ...]
    methods: tuple[str, ...]
    warmup: int
    reps: int
    seed: int = 0
    profile: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def window_of(self, seqlen: int) -> int:
        return self.window if self.window is not None else seqlen // 4


# ---- inputs ----

def full_inputs(settings: Settings, seqlen: int, case: str, device: torch.device):
    """(q, k, v, dout, options) of a case over the whole sequence, the same in every process
    (a seeded generator on the device): options are omniattn.attention's keywords, the key
    bias (B, H, 1, S) among them."""
    import omniattn

    generator = torch.Generator(device=device).manual_seed(
        settings.seed + seqlen + CASES.index(case))
    shape = (settings.batch, seqlen, settings.heads, settings.head_dim)

    def randn(*size):
        return torch.randn(size, generator=generator, device=device,
                           dtype=settings.torch_dtype)

    q, k, v, dout = (randn(*shape) for _ in range(4))
    if case == "causal":
        return q, k, v, dout, {"causal": True}
    window = settings.window_of(seqlen)
    mask = omniattn.window_block_mask(seqlen, seqlen, (window, 0), causal=True,
                                      block_size=settings.block_size, device=device)
    return q, k, v, dout, {"block_mask": mask,
                           "attn_bias": randn(settings.batch, settings.heads, 1, seqlen)}


# ---- the processes ----

def single_worker(rank: int, settings: Settings, out_file: str) -> None:
    """The single-GPU omniattn.attention of every case and length, alone on GPU 0."""
    import omniattn

    device = rank_device(settings.device, rank)
    records = []
    for seqlen in settings.seqlens:
        for case in settings.cases:
            record = {"case": case, "seqlen": seqlen}

            def measure(record, seqlen=seqlen, case=case):
                q, k, v, dout, options = full_inputs(settings, seqlen, case, device)
                leaves = [t.requires_grad_() for t in (q, k, v)]
                if "attn_bias" in options:
                    leaves.append(options["attn_bias"].requires_grad_())
                record["explain"] = str(omniattn.explain(q, k, v, **options))
                for mode, fn in steps(lambda *qkv: omniattn.attention(*qkv, **options), leaves,
                                      dout).items():
                    record[f"{mode}_ms"] = median_ms(fn, settings.warmup, settings.reps,
                                                     device)["ms"]

            recorded(record, measure)
            records.append(record)
            pathlib.Path(out_file).write_text(json.dumps(records))  # kept if a later one dies


def cp_worker(rank: int, settings: Settings, init_file: str, out_file: str) -> None:
    """A rank of the context-parallel group: every case x method x length timed with and
    without communication, then the checks at check_seqlen; rank 0 writes the records."""
    from omniattn import distributed as cp

    device = rank_device(settings.device, rank)
    group = init_group(device, rank, settings.world, init_file)
    records, checks = [], []
    for seqlen in settings.seqlens:
        for case in settings.cases:
            full = full_inputs(settings, seqlen, case, device)
            leaves, dout, options = shard_inputs(*full)
            del full
            for method in settings.methods:
                record = {"case": case, "method": method, "seqlen": seqlen}

                def measure(record, method=method, leaves=leaves, dout=dout, options=options):
                    def attend(*qkv):
                        return cp.attention(*qkv, method=method, **options)

                    record["explain"] = str(cp.explain(*leaves[:3], method=method, **options))
                    for mode, fn in steps(attend, leaves, dout).items():
                        timed = median_ms(fn, settings.warmup, settings.reps, device, group)
                        record[f"{mode}_ms"], record[f"{mode}_rank_ms"] = timed["ms"], \
                            timed["rank_ms"]
                        with local_collectives():
                            record[f"{mode}_ms_local"] = median_ms(
                                fn, settings.warmup, settings.reps, device, group)["ms"]
                        if settings.profile:
                            record[f"{mode}_profile"] = every_rank_object(
                                profiled(fn, device), group)

                recorded(record, measure)
                records.append(record)
                if rank == 0:  # kept if a later call kills the processes
                    pathlib.Path(out_file).write_text(json.dumps({"cp": records, "checks": []}))
            del leaves, dout, options  # before the next case's inputs
    for case in settings.cases:
        record = {"case": case, "seqlen": settings.check_seqlen}
        recorded(record, lambda record, case=case: checks.extend(
            check_case(settings, case, device, group)))
        if "error" in record:
            checks.append({**record, "ok": False})
        if rank == 0:
            pathlib.Path(out_file).write_text(json.dumps({"cp": records, "checks": checks}))
        dist.barrier(group)  # rank 0 ends its single-device calls, or their failure
    dist.destroy_process_group()


# ---- the check ----

def _gradients(attend, q, k, v, dout, options, leaf_dtype=None):
    """(out, lse, dq, dk, dv[, dbias]) of attend(q, k, v, **options) -> (out, lse) under
    loss = sum(out * dout); the inputs as leaves (in leaf_dtype where given)."""
    leaves = [q, k, v] + ([options["attn_bias"]] if "attn_bias" in options else [])
    leaves = [t.detach().to(leaf_dtype or t.dtype).requires_grad_() for t in leaves]
    options = {**options, **({"attn_bias": leaves[3]} if len(leaves) == 4 else {})}
    out, lse = attend(*leaves[:3], **options)
    grads = torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)
    return [out.detach(), lse.detach(), *grads]


def check_case(settings: Settings, case: str, device: torch.device, group) -> list[dict]:
    """Every method's out, lse and gradients at check_seqlen (unsharded on rank 0) against the
    float64 reference: within twice the single-device omniattn.attention's error (+ atol), and
    the error of plain PyTorch in the same dtype beside it. Every rank runs the methods; rank
    0 alone the single-device calls."""
    import omniattn
    from omniattn import distributed as cp
    from omniattn.reference import attention_reference

    q, k, v, dout, options = full_inputs(settings, settings.check_seqlen, case, device)
    found = {}
    for method in settings.methods:
        def sharded(q, k, v, attn_bias=None, method=method, **rest):
            bias = {"attn_bias": cp.shard(attn_bias, group, dim=3)} if attn_bias is not None \
                else {}
            out, lse = cp.attention(*(cp.shard(t, group) for t in (q, k, v)), group=group,
                                    method=method, return_lse=True, **rest, **bias)
            return cp.unshard(out, group), cp.unshard(lse, group, dim=2)

        found[method] = _gradients(sharded, q, k, v, dout, options)
    records = []
    if dist.get_rank(group) == 0:
        single = _gradients(lambda *a, **o: omniattn.attention(*a, return_lse=True, **o),
                            q, k, v, dout, options)
        exact = _gradients(lambda *a, **o: attention_reference(*a, return_lse=True, **o),
                           q, k, v, dout, options, torch.float64)
        plain = _gradients(lambda *a, **o: attention_reference(*a, return_lse=True,
                                                               upcast=False, **o),
                           q, k, v, dout, options)
        for method, got in found.items():
            errors, ok = {}, True
            for name, g, s, e, p in zip(QUANTITIES, got, single, exact, plain):
                atol = ATOL[torch.float32 if name == "lse" else settings.torch_dtype]
                errors[name] = {"cp": max_error(g, e), "single": max_error(s, e),
                                "plain": max_error(p, e), "atol": atol}
                ok = ok and errors[name]["cp"] <= 2 * errors[name]["single"] + atol
            records.append({"case": case, "method": method, "seqlen": settings.check_seqlen,
                            "ok": ok, "errors": errors})
    return records


# ---- the parent: spawn, merge, report ----

def merged(single: list[dict], parallel: list[dict]) -> list[dict]:
    """Each context-parallel record with its single-GPU time beside it: the speedups, the
    ratio the issue bounds, and the communication share."""
    baseline = {(r["case"], r["seqlen"]): r for r in single}
    rows = []
    for record in parallel:
        row = dict(record)
        one = baseline.get((record["case"], record["seqlen"]), {})
        for mode in ("fwd", "fwd_bwd"):
            ms, alone = record.get(f"{mode}_ms"), one.get(f"{mode}_ms")
            row[f"{mode}_single_ms"] = alone
            if ms is not None and alone is not None:
                row[f"{mode}_speedup"] = alone / ms
                row[f"{mode}_ratio"] = ms / alone
            share = comm_share(ms, record.get(f"{mode}_ms_local"))
            if share is not None:
                row[f"{mode}_comm_share"] = share
        if "fwd_bwd_ratio" in row:
            row["target_met"] = row["fwd_bwd_ratio"] <= 0.6
        rows.append(row)
    return rows


def table(rows: list[dict], checks: list[dict], world: int) -> str:
    def ms(value):
        return f"{value:9.2f}" if value is not None else "        -"

    def share(value):
        return f"{100 * value:5.1f}%" if value is not None else "     -"

    lines = [f"{'case':<12}{'method':<9}{'S':>8} | {'fwd 1 GPU':>9} {f'{world} GPUs':>9} "
             f"{'speedup':>7} {'comm':>6} | {'f+b 1 GPU':>9} {f'{world} GPUs':>9} "
             f"{'speedup':>7} {'ratio':>6} {'comm':>6} target"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<12}{r['method']:<9}{r['seqlen']:>8} | failed: "
                         f"{r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(
            f"{r['case']:<12}{r['method']:<9}{r['seqlen']:>8} | {ms(r['fwd_single_ms'])} "
            f"{ms(r['fwd_ms'])} {r.get('fwd_speedup', 0):6.2f}x {share(r.get('fwd_comm_share'))} "
            f"| {ms(r['fwd_bwd_single_ms'])} {ms(r['fwd_bwd_ms'])} "
            f"{r.get('fwd_bwd_speedup', 0):6.2f}x {r.get('fwd_bwd_ratio', 0):6.3f} "
            f"{share(r.get('fwd_bwd_comm_share'))} "
            f"{'met' if r.get('target_met') else 'MISSED'} (<= 0.6)")
    for c in checks:
        if "error" in c:
            lines.append(f"check {c['case']} S{c['seqlen']}: failed: "
                         f"{c['error'].strip().splitlines()[-1]}")
            continue
        worst = max(c["errors"], key=lambda n: c["errors"][n]["cp"] / (
            2 * c["errors"][n]["single"] + c["errors"][n]["atol"]))
        e = c["errors"][worst]
        lines.append(f"check {c['case']} {c['method']} S{c['seqlen']}: "
                     f"{'ok' if c['ok'] else 'FAILED'} (closest: {worst} error {e['cp']:.3g}, "
                     f"single-GPU {e['single']:.3g}, plain {e['plain']:.3g})")
    return "\n".join(lines)


def run(settings: Settings) -> dict:
    """Both phases in processes of their own; the merged results."""
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        single, single_failure = spawned(single_worker, (settings,), 1,
                                          folder / "single.json", [])
        parallel, cp_failure = spawned(cp_worker, (settings, str(folder / "init")),
                                        settings.world, folder / "cp.json",
                                        {"cp": [], "checks": []})
    failures = [f for f in (single_failure, cp_failure) if f is not None]
    return {"environment": environment(settings.device, settings.world),
            "settings": dataclasses.asdict(settings),
            "single": single, "results": merged(single, parallel["cp"]),
            "checks": parallel["checks"], "failures": failures}


def check_settings(settings: Settings) -> None:
    """Lengths the layout and the block mask's cut need, heads ulysses splits: errors before
    any process starts."""
    multiple = 2 * settings.world * settings.block_size
    for seqlen in (*settings.seqlens, settings.check_seqlen):
        if seqlen % multiple:
            raise SystemExit(f"sequence length {seqlen} must be a multiple of 2 x {settings.world}"
                             f" ranks x block size {settings.block_size} = {multiple}")
    if "ulysses" in settings.methods and settings.heads % settings.world:
        raise SystemExit(f"ulysses splits the {settings.heads} heads over {settings.world} "
                         f"ranks: pass --heads a multiple of {settings.world} or drop ulysses")


def parse_settings(argv=None) -> tuple[Settings, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=None,
                        help="default 131072 (smoke 256)")
    parser.add_argument("--check-seqlen", type=int, default=None,
                        help="the length of the 2x-rule check (default 8192; smoke 128)")
    parser.add_argument("--window", type=int, default=None, help="default S / 4")
    parser.add_argument("--profile", action="store_true",
                        help="also each rank's largest kernels of one call of each mode")
    add_run_arguments(parser, METHODS, CASES, heads=16, warmup="default 2 (smoke 1)", reps=7)
    args = parser.parse_args(argv)
    pick = defaults(args)
    settings = Settings(
        **shared_settings(args, pick, heads=16, reps=7),
        seqlens=tuple(pick(args.seqlen, [131072], [256])),
        check_seqlen=pick(args.check_seqlen, 8192, 128), window=args.window,
        block_size=16 if args.cpu_smoke else 128, warmup=pick(args.warmup, 2, 1),
        profile=args.profile)
    return settings, args.json


def main(argv=None) -> None:
    settings, json_path = parse_settings(argv)
    check_settings(settings)
    run_and_report(settings, json_path, run,
                   lambda results: table(results["results"], results["checks"], settings.world))


if __name__ == "__main__":
    main()
