"""compute-sanitizer's memcheck, racecheck and synccheck over one small call of every kernel
family, each (family, tool) in a process of its own; one verdict line per pair and a summary.

    python tools/sanitize.py --out $OUT/sanitize
    python tools/sanitize.py --tools racecheck --families 'minimal,gluon-*'
    python tools/sanitize.py --list

Each family is one call of `omniattn.attention` (B1, S 200, H2, D128 bf16 unless it says
otherwise), forward and backward, synchronised; `minimal` runs tools/racecheck_minimal.py's
race-free warp-specialised kernels, `minimal-VARIANT` one of them alone. Every family first
runs once without the sanitizer (in parallel processes), which fills Triton's cache so the
sanitised runs do not compile, and says which kernels it launched. Exit status: 1 when memcheck
or synccheck report errors, 2 when a run gave no verdict (timeout, crash, no sanitizer
summary), else 0; racecheck hazards are reported, not failed on (docs/sanitizer.md says why).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fnmatch
import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(SCRIPT.parent))  # the sibling modules below
from sanitizer_log import describe, parse_log  # noqa: E402
TOOLS = ("memcheck", "racecheck", "synccheck")
CHILD_TAG = "sanitize-child: "

BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 200, 2, 128
TMA_SEQLEN = 256  # rows of 16-byte multiples: mask and bias tiles by TMA
DEVICE = "cuda"  # the families' tensors (tests run the calls' host side on "cpu")


class Skip(Exception):
    """A family that cannot run on this machine (said in the verdict, not an error)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One call reaching a kernel family. expects: kernels the call must launch on an H100
    (a missing one is noted beside the verdicts); env: switches set before the call."""

    name: str
    description: str
    expects: tuple[str, ...]
    run: Callable[[], None]
    env: tuple[tuple[str, str], ...] = ()


def _synchronize():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _randn(*shape, dtype=None, grad=True):
    import torch

    return torch.randn(*shape, device=DEVICE, dtype=dtype or torch.bfloat16, requires_grad=grad)


def _qkv(head_dim=HEAD_DIM, heads=HEADS, heads_k=None, packed_rows=None):
    """q (B, S, H, D), k / v (B, S, Hk, D); packed_rows: (total, H, D) and (total, Hk, D)."""
    heads_k = heads_k or heads
    rows = (packed_rows,) if packed_rows else (BATCH, SEQLEN)
    return _randn(*rows, heads, head_dim), _randn(*rows, heads_k, head_dim), \
        _randn(*rows, heads_k, head_dim)


def _forward_backward(inputs, **kwargs) -> None:
    """attention(q, k, v, **kwargs) and the gradients of every input that takes one (a bias
    in kwargs included), checked finite; synchronised."""
    import torch

    import omniattn

    out = omniattn.attention(*inputs, **kwargs)
    wrt = [t for t in (*inputs, kwargs.get("attn_bias")) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, wrt, torch.randn_like(out)) if wrt else ()
    _synchronize()
    for name, t in [("out", out)] + [(f"grad {i}", g) for i, g in enumerate(grads)]:
        if not bool(torch.isfinite(t.float()).all()):
            raise RuntimeError(f"{name} has non-finite values")


def _keep_mask(heads=HEADS, seqlen=None):
    """bool (B, H, S, S) (S: SEQLEN by default): about 70% kept, the diagonal always (no empty
    row)."""
    import torch

    seqlen = seqlen or SEQLEN
    torch.manual_seed(0)
    keep = torch.rand(BATCH, heads, seqlen, seqlen, device=DEVICE) < 0.7
    return keep | torch.eye(seqlen, dtype=torch.bool, device=DEVICE)


def _packed_offsets():
    """(cu_seqlens, longest) of two packed sequences of 3/5 and 2/5 of SEQLEN rows (120, 80)."""
    import torch

    longest = SEQLEN * 3 // 5
    return torch.tensor([0, longest, SEQLEN], dtype=torch.int32, device=DEVICE), longest


def _dense(head_dim=HEAD_DIM, **kwargs):
    return lambda: _forward_backward(_qkv(head_dim), **kwargs)


def _mask_key_bias():
    _forward_backward(_qkv(), attn_mask=_keep_mask(), attn_bias=_randn(BATCH, HEADS, 1, SEQLEN))


def _mask_full_bias():
    q, k, v = (_randn(BATCH, TMA_SEQLEN, HEADS, HEAD_DIM) for _ in range(3))
    _forward_backward((q, k, v), causal=True, attn_mask=_keep_mask(seqlen=TMA_SEQLEN),
                      attn_bias=_randn(BATCH, HEADS, TMA_SEQLEN, TMA_SEQLEN))


def _block_mask():
    import omniattn

    mask = omniattn.causal_block_mask(SEQLEN, SEQLEN, block_size=128, device=DEVICE)
    _forward_backward(_qkv(), block_mask=mask)


def _row_lengths():
    import torch

    torch.manual_seed(0)
    lengths = torch.randint(1, SEQLEN + 1, (BATCH, SEQLEN), dtype=torch.int32, device=DEVICE)
    _forward_backward(_qkv(), seqlens_k_per_row=lengths)


def _varlen():
    offsets, longest = _packed_offsets()
    _forward_backward(_qkv(packed_rows=SEQLEN), causal=True, cu_seqlens_q=offsets,
                      cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest)


def _gqa_mask_full_bias():
    # a bias per query head under explicit lists: the Triton backward zeroes its unlisted tiles,
    # and sums the GQA group's dK / dV partials
    _forward_backward(_qkv(heads=4, heads_k=2), attn_mask=_keep_mask(heads=4),
                      attn_bias=_randn(BATCH, 4, SEQLEN, SEQLEN))


def _forward_lists():
    # no gradient: the mask pre-pass builds the forward's lists in one launch
    import torch

    import omniattn

    q, k, v = (_randn(BATCH, SEQLEN, HEADS, HEAD_DIM, grad=False) for _ in range(3))
    out = omniattn.attention(q, k, v, attn_mask=_keep_mask())
    _synchronize()
    if not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError("out has non-finite values")


def _minimal(variants: tuple[str, ...] | None = None):
    """tools/racecheck_minimal.py's variants (all by default), each launched and checked."""
    import racecheck_minimal

    if not racecheck_minimal.runs_here():
        raise Skip("the minimal kernels run on sm90 only")
    for variant in variants or racecheck_minimal.VARIANTS:
        racecheck_minimal.run(variant)


# tools/racecheck_minimal.py's variants and kernels (that module imports torch and triton)
MINIMAL_KERNELS = {"bare": "_ws_bare_kernel", "wide": "_ws_wide_kernel",
                   "captures": "_ws_captures_kernel", "tma": "_ws_tma_kernel",
                   "regs": "_ws_regs_kernel", "ring": "_ws_ring_kernel",
                   "ring_tma_store": "_ws_ring_tma_store_kernel",
                   "forward": "_ws_forward_kernel", "smem": "_ws_smem_kernel"}


def _minimal_alone(variant: str) -> Family:
    # a process of its own: racecheck's print limit, which smem's reports reach, is per process
    return Family(f"minimal-{variant}", f"racecheck_minimal.py's {variant} alone",
                  (MINIMAL_KERNELS[variant],), lambda: _minimal((variant,)))


_GLUON = ("_fwd_hopper_kernel", "_bwd_hopper_kernel")
_TRITON = ("_fwd_kernel", "bwd_kernel")
_OFF = (("OMNIATTN_GLUON", "0"),)

FAMILIES = (
    Family("minimal", "tools/racecheck_minimal.py: race-free warp_specialize kernels (bare, "
           "wide, captures, tma; with the forward's partitions and budgets: regs, ring, "
           "ring_tma_store, forward; smem)", tuple(MINIMAL_KERNELS.values()), _minimal),
    *(_minimal_alone(variant) for variant in MINIMAL_KERNELS),
    Family("gluon-dense", "dense D128: fwd_hopper, bwd_hopper", _GLUON, _dense()),
    Family("gluon-causal", "causal D128", _GLUON, _dense(causal=True)),
    Family("gluon-mask-key-bias", "element mask (B, H, S, S) + key bias (B, H, 1, S): the "
           "mask pre-pass and list builder, the consumers' mask / bias loads",
           _GLUON + ("_mask_states_kernel", "_mask_lists_kernel"), _mask_key_bias),
    Family("gluon-mask-full-bias", "S 256, causal, element mask + full bias (B, H, S, S): the "
           "producer's mask and bias tiles by TMA", _GLUON, _mask_full_bias),
    Family("gluon-block-mask", "causal block mask of 128-blocks (lists, no bitmaps)", _GLUON,
           _block_mask),
    Family("gluon-row-lengths", "per-row key lengths alone: rows in length order (rank "
           "kernel), gathered q, dQ scattered back",
           _GLUON + ("_length_rank_kernel", "_rows_to_callers_kernel"), _row_lengths),
    Family("gluon-d64", "dense D64: three consumer warpgroups forward, bwd_hopper at 64",
           _GLUON, _dense(64)),
    Family("gluon-d256", "dense D256: fwd_hopper at 256, bwd_hopper_wide",
           ("_fwd_hopper_kernel", "_bwd_wide_kernel"), _dense(256)),
    Family("gluon-varlen", "packed sequences 120 + 80, causal", _GLUON, _varlen),
    Family("triton-causal", "causal D128 with OMNIATTN_GLUON=0: the Triton forward and backward",
           _TRITON + ("bwd_preprocess",), _dense(causal=True), _OFF),
    Family("triton-deterministic", "dense, deterministic=True: the Gluon forward, the Triton "
           "backward", ("_fwd_hopper_kernel", "bwd_kernel"), _dense(deterministic=True)),
    Family("triton-dropout", "dense, dropout_p=0.1", _TRITON, _dense(dropout_p=0.1)),
    Family("triton-varlen", "packed sequences, causal, OMNIATTN_GLUON=0", _TRITON, _varlen,
           _OFF),
    Family("triton-gqa-mask-full-bias", "GQA 4/2, element mask + full bias, "
           "OMNIATTN_GLUON=0: dbias tiles zeroed where unlisted, dK / dV partials summed",
           _TRITON + ("zero_unlisted_kernel", "sum_kv_parts", "_mask_states_kernel",
                      "_mask_lists_kernel"), _gqa_mask_full_bias, _OFF),
    Family("prepass-forward-lists", "element mask, forward only: lists built by the "
           "pre-pass in one launch", ("_mask_forward_lists_kernel",), _forward_lists),
)


def select_families(patterns: str) -> list[Family]:
    """The families whose names match any of the comma-separated names / glob patterns, in
    FAMILIES' order. Raises ValueError naming a pattern that matches none."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    for pattern in wanted:
        if not any(fnmatch.fnmatchcase(f.name, pattern) for f in FAMILIES):
            raise ValueError(f"--families: {pattern!r} matches no family; families: "
                             f"{', '.join(f.name for f in FAMILIES)}")
    return [f for f in FAMILIES if any(fnmatch.fnmatchcase(f.name, p) for p in wanted)]


def run_child(name: str) -> int:
    """Runs one family in this process and prints CHILD_TAG + JSON: the family, the kernels it
    launched (every Triton / Gluon launch passes JITFunction.run at least once a process),
    seconds, and a skip reason if any."""
    family = {f.name: f for f in FAMILIES}[name]
    os.environ.update(dict(family.env))
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime.jit import JITFunction

    launched: list[str] = []
    run = JITFunction.run

    def recording_run(self, *args, **kwargs):
        if self.fn.__name__ not in launched:
            launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    JITFunction.run = recording_run
    start = time.monotonic()
    skipped = None
    try:
        family.run()
    except Skip as reason:
        skipped = str(reason)
    report = dict(family=name, kernels=launched, seconds=round(time.monotonic() - start, 2),
                  skipped=skipped)
    print(CHILD_TAG + json.dumps(report), flush=True)
    return 0


@dataclasses.dataclass
class Outcome:
    """One (family, tool) run: status "clean", "found" (errors or hazards), "skipped" or
    "error" (no verdict); count: errors / hazards displayed; kernels: launched by the child."""

    family: str
    tool: str
    status: str
    count: int | None
    verdict: str
    seconds: float
    kernels: list[str] = dataclasses.field(default_factory=list)
    findings: list[dict] = dataclasses.field(default_factory=list)
    log: str = ""


def _child_report(output: str) -> dict | None:
    for line in output.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    return None


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-400:]


def verdict(family: str, tool: str, log_text: str, child_output: str, returncode: int | None,
            seconds: float) -> Outcome:
    """The outcome of one sanitised child from its sanitizer log, its own output (stdout and
    stderr) and exit status (None: killed at its timeout)."""
    report = parse_log(log_text)
    child = _child_report(child_output) or {}
    kernels = child.get("kernels", [])
    findings = [dataclasses.asdict(f)
                for f in report.analysis + report.hazard_reports + report.messages]
    outcome = Outcome(family, tool, "error", report.count(), "", round(seconds, 1), kernels,
                      findings)
    if returncode is None:
        outcome.verdict = f"error: timed out after {seconds:.0f} s"
        return outcome
    if child.get("skipped"):
        outcome.status, outcome.count = "skipped", None
        outcome.verdict = f"skipped: {child['skipped']}"
        return outcome
    count = report.count()
    if count is None:
        outcome.verdict = f"error: no sanitizer summary (exit {returncode}): " \
            f"{_tail(log_text + chr(10) + child_output)}"
        return outcome
    if count:
        outcome.status = "found"
        if report.hazards is not None:
            noun = f"{count} hazard{'s' * (count != 1)} ({report.hazard_errors} errors, " \
                f"{report.hazard_warnings} warnings)"
        else:
            noun = f"{count} error{'s' * (count != 1)}"
        outcome.verdict = f"{noun}: {describe(report.findings())}"
        if report.analysis and report.hazard_reports:
            # which warps on each side: the partitions (warps 0-3 are the default one)
            outcome.verdict += "; by thread: " + "; ".join(
                f"{f.what} {f.warps} [{f.count}]" for f in report.hazard_reports[:3])
    else:
        outcome.status, outcome.verdict = "clean", "clean"
    if not child:
        # the call itself failed: its exception ends the child's output
        failure = f"call failed (exit {returncode}): {_tail(child_output, 2)}"
        outcome.verdict = failure if count == 0 else f"{outcome.verdict}; {failure}"
        if count == 0:
            outcome.status = "error"
    return outcome


def find_sanitizer(given: str | None) -> str | None:
    """compute-sanitizer: as given, $COMPUTE_SANITIZER, on PATH, or in a CUDA install."""
    candidates = [given, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                  "/usr/local/cuda/bin/compute-sanitizer",
                  *sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def sanitizer_options(sanitizer: str, racecheck_report: str) -> dict[str, list[str]]:
    """Per-tool options, each kept only where this compute-sanitizer's --help names it:
    racecheck's report mode (hazard: each hazard with its threads; analysis: the pairs of
    source lines; all: both), device backtraces, a print limit far above the default."""
    try:
        help_text = subprocess.run([sanitizer, "--help"], capture_output=True, text=True,
                                   timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        help_text = ""

    def known(option: str, *values: str) -> list[str]:
        return [option, *values] if option in help_text else []

    common = known("--show-backtrace", "device") + known("--print-limit", "10000")
    return {"memcheck": common, "synccheck": common,
            "racecheck": common + known("--racecheck-report", racecheck_report)}


class Runner:
    """Runs children (warm-up or sanitised) in their own process groups, each killed at its
    timeout or at the deadline, whichever comes first."""

    def __init__(self, logs: pathlib.Path, timeout: float, deadline: float):
        self.logs, self.timeout, self.deadline = logs, timeout, deadline
        self.env = {**os.environ, "TRITON_INTERPRET": "0",
                    "PYTHONPATH": os.pathsep.join(
                        [str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, command: list[str], output: pathlib.Path) -> tuple[int | None, str, float]:
        """(exit status or None if killed, stdout + stderr, seconds)."""
        limit = min(self.timeout, self.left())
        start = time.monotonic()
        with open(output, "w") as out:
            child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=ROOT, start_new_session=True)
            try:
                returncode = child.wait(timeout=max(limit, 1))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                returncode = None
        return returncode, output.read_text(errors="replace"), time.monotonic() - start


def _line(outcome: Outcome) -> str:
    count = "-" if outcome.count is None else str(outcome.count)
    return f"{outcome.family:<26} {outcome.tool:<9} {count:>6}  {outcome.verdict}"


def warm_up(families: list[Family], runner: Runner, jobs: int) -> dict[str, dict]:
    """Each family's call once without the sanitizer (fills Triton's cache): name -> {"ok",
    "kernels", "seconds", "skipped", "failure"}."""
    warm_dir = runner.logs / "warm"
    warm_dir.mkdir(parents=True, exist_ok=True)

    def one(family: Family) -> tuple[str, dict]:
        if runner.left() <= 0:
            return family.name, dict(ok=False, failure="not run: budget spent")
        returncode, output, seconds = runner.run(
            [sys.executable, str(SCRIPT), "--child", family.name], warm_dir / f"{family.name}.out")
        child = _child_report(output)
        if returncode == 0 and child:
            return family.name, dict(ok=True, **child)
        why = "timed out" if returncode is None else f"exit {returncode}: {_tail(output, 2)}"
        return family.name, dict(ok=False, failure=why, seconds=round(seconds, 1))

    results = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for name, result in pool.map(one, families):
            results[name] = result
            if result["ok"]:
                missing = [k for k in {f.name: f for f in families}[name].expects
                           if k not in result["kernels"]]
                note = f"; expected, not launched: {', '.join(missing)}" if missing else ""
                state = f"skipped ({result['skipped']})" if result.get("skipped") \
                    else f"{result['seconds']} s, kernels: {', '.join(result['kernels'])}{note}"
                print(f"warm-up {name:<26} {state}", flush=True)
            else:
                print(f"warm-up {name:<26} FAILED {result['failure']}", flush=True)
    return results


def sanitize(jobs_list: list[tuple[Family, str]], runner: Runner, sanitizer: str,
             options: dict[str, list[str]], extra: list[str], jobs: int) -> list[Outcome]:
    """Each (family, tool) under compute-sanitizer, verdict lines printed as they finish."""

    def one(job: tuple[Family, str]) -> Outcome:
        family, tool = job
        if runner.left() <= 0:
            return Outcome(family.name, tool, "error", None, "error: not run, budget spent", 0)
        log = runner.logs / f"{family.name}.{tool}.log"
        log.unlink(missing_ok=True)
        command = [sanitizer, "--tool", tool, "--log-file", str(log), *options[tool], *extra,
                   sys.executable, str(SCRIPT), "--child", family.name]
        returncode, output, seconds = runner.run(command,
                                                 runner.logs / f"{family.name}.{tool}.out")
        log_text = log.read_text(errors="replace") if log.exists() else ""
        outcome = verdict(family.name, tool, log_text, output, returncode, seconds)
        outcome.log = str(log)
        print(_line(outcome), flush=True)
        return outcome

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, jobs_list))


def summarise(outcomes: list[Outcome], families: list[Family], tools: list[str],
              warm: dict[str, dict], seconds: float) -> tuple[str, int]:
    """(summary text, exit status)."""
    order = {f.name: i for i, f in enumerate(families)}
    outcomes = sorted(outcomes, key=lambda o: (order[o.family], TOOLS.index(o.tool)))
    lines = ["", f"{'family':<26} {'tool':<9} {'count':>6}  verdict"]
    lines += [_line(o) for o in outcomes]
    lines.append("")
    for tool in tools:
        mine = [o for o in outcomes if o.tool == tool]
        by_status = defaultdict(list)
        for o in mine:
            by_status[o.status].append(o.family)
        parts = [f"{len(by_status['clean'])} clean"]
        for status, label in (("found", "with hazards" if tool == "racecheck" else "with errors"),
                              ("error", "without a verdict"), ("skipped", "skipped")):
            if by_status[status]:
                parts.append(f"{len(by_status[status])} {label} ({', '.join(by_status[status])})")
        lines.append(f"{tool}: " + "; ".join(parts))
    racy = defaultdict(set)
    for o in outcomes:
        if o.tool == "racecheck" and o.status == "found":
            for f in o.findings:
                if f["kernel"]:
                    racy[f["kernel"]].add(o.family)
    if racy:
        lines.append("racecheck hazards by kernel: " + "; ".join(
            f"{kernel} ({', '.join(sorted(fams, key=order.get))})"
            for kernel, fams in sorted(racy.items())))
    for name, result in warm.items():
        if result.get("ok"):
            missing = [k for k in {f.name: f for f in families}[name].expects
                       if k not in result["kernels"]]
            if missing and not result.get("skipped"):
                lines.append(f"note: {name} did not launch {', '.join(missing)}")
    failed = any(o.status == "found" for o in outcomes if o.tool in ("memcheck", "synccheck"))
    incomplete = any(o.status == "error" for o in outcomes)
    status = 1 if failed else 2 if incomplete else 0
    lines.append(f"{len(outcomes)} (family, tool) pairs, {seconds:.0f} s in all; exit {status}")
    return "\n".join(lines), status


def _details(outcomes: list[Outcome]) -> str:
    """Every finding of every run, for summary.txt."""
    out = []
    for o in outcomes:
        if not o.findings:
            continue
        out.append(f"\n{o.family} {o.tool} ({o.log}):")
        for f in o.findings:
            out.append(f"  {f['severity']:<7} {f['kernel'] or '?'}: {f['what']} {f['where']} "
                       f"[{f['count']}] {f['warps']}".rstrip())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Families: " + ", ".join(f.name for f in FAMILIES) + " (--list describes them)")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="comma-separated, of memcheck, racecheck, synccheck (default: all)")
    parser.add_argument("--families", default="*",
                        help="comma-separated names or glob patterns (default: all), e.g. "
                        "'minimal,gluon-*'")
    parser.add_argument("--out", metavar="DIR",
                        help="keep every log here (sanitizer logs, children's output, "
                        "summary.txt, summary.json); default: a temporary directory, removed")
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds per child process (default: 240)")
    parser.add_argument("--budget", type=float, default=450,
                        help="seconds for the whole run: no child starts after it and running "
                        "ones are killed at it (default: 450)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="children at once, on the one GPU (default: min(8, CPUs))")
    parser.add_argument("--no-warm", action="store_true",
                        help="skip the unsanitised runs that fill Triton's cache")
    parser.add_argument("--racecheck-report", choices=("hazard", "analysis", "all"),
                        default="all", help="racecheck's report mode (default: all)")
    parser.add_argument("--sanitizer", help="the compute-sanitizer binary (default: "
                        "$COMPUTE_SANITIZER, PATH, /usr/local/cuda*/bin)")
    parser.add_argument("--extra-args", default="",
                        help="more compute-sanitizer options for every run, one string, e.g. "
                        "'--kernel-name kns=_fwd_hopper_kernel'")
    parser.add_argument("--list", action="store_true", help="describe the families and exit")
    parser.add_argument("--child", metavar="FAMILY", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    if opts.child:
        return run_child(opts.child)
    try:
        families = select_families(opts.families)
    except ValueError as error:
        parser.error(str(error))
    if opts.list:
        for f in families:
            env = " ".join(f"{k}={v}" for k, v in f.env)
            print(f"{f.name:<26} {f.description}{' [' + env + ']' if env else ''}\n"
                  f"{'':<26} expects: {', '.join(f.expects)}")
        return 0
    tools = [t.strip() for t in opts.tools.split(",") if t.strip()]
    for tool in tools:
        if tool not in TOOLS:
            parser.error(f"--tools: unknown tool {tool!r}; choose from {', '.join(TOOLS)}")
    sanitizer = find_sanitizer(opts.sanitizer)
    if sanitizer is None:
        parser.error("compute-sanitizer not found: pass --sanitizer or set $COMPUTE_SANITIZER")

    start = time.monotonic()
    scratch = None if opts.out else tempfile.TemporaryDirectory(prefix="sanitize-")
    logs = pathlib.Path(opts.out or scratch.name)
    logs.mkdir(parents=True, exist_ok=True)
    runner = Runner(logs, opts.timeout, start + opts.budget)
    options = sanitizer_options(sanitizer, opts.racecheck_report)
    print(f"{sanitizer}; options: " + "; ".join(f"{t}: {' '.join(options[t])}" for t in tools),
          flush=True)
    warm = {}
    if not opts.no_warm:
        warm = warm_up(families, runner, opts.jobs)
    failed_warm = {name for name, result in warm.items() if not result["ok"]}
    # racecheck first: the question at hand; a family whose call failed unsanitised is not rerun
    jobs_list = [(f, t) for t in sorted(tools, key=("racecheck", "memcheck", "synccheck").index)
                 for f in families if f.name not in failed_warm]
    outcomes = sanitize(jobs_list, runner, sanitizer, options, opts.extra_args.split(),
                        opts.jobs)
    for name in sorted(failed_warm):
        for tool in tools:
            outcomes.append(Outcome(name, tool, "error", None,
                                    f"error: call failed unsanitised: {warm[name]['failure']}", 0))
    text, status = summarise(outcomes, families, tools, warm, time.monotonic() - start)
    print(text, flush=True)
    (logs / "summary.txt").write_text(text + "\n" + _details(outcomes) + "\n")
    (logs / "summary.json").write_text(json.dumps(
        dict(warm=warm, outcomes=[dataclasses.asdict(o) for o in outcomes]), indent=1))
    if scratch is not None:
        scratch.cleanup()
    return status


if __name__ == "__main__":
    sys.exit(main())
