"""What `omniattn bench` prints and saves: the table of its records (`format_table`), the JSON
records with the environment they were measured in (`write_json`, `load_records`)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path
import platform
import subprocess

import torch
import triton

import omniattn
from omniattn.runtime.switches import interpreting, switches

from .providers import BLOCK_MASK_PROVIDERS, ELEMENT_MASK_PROVIDERS
from .workloads import DOCUMENTS, DYNAMIC_BIASES, ROW_LENGTHS


def _git_commit() -> str | None:
    """HEAD of the checkout the package is imported from; None if it is not a git checkout."""
    checkout = Path(__file__).resolve().parents[3]  # src/omniattn/bench/report.py in it
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
        "switches": switches(),
        "omniattn": omniattn.__version__,
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def results_header(results: list[dict], tflops: bool = True) -> str:
    """`tflops=False` for a plot with no TFLOP/s panel: its times need no FLOP convention."""
    if any(r["device"] == "cpu" for r in results):
        path = "Triton kernels under the interpreter" if interpreting() else "reference path"
        return (f"CPU: a smoke test of omniattn's {path} against SDPA math, not a speed "
                f"measurement of the kernels; run on a GPU for that")
    if not tflops:
        return "GPU: median time per call"
    return "GPU: TFLOP/s = FLOPs of the tiles omniattn computes / time, for every provider"


def _timing_lines(results: list[dict]) -> list[str]:
    """How the CPU rows' times were taken, from their records; none for do_bench's rows or
    records that predate the counts."""
    counted = [r for r in results if r.get("timed_runs")]
    if not counted:
        return []
    runs = min(r["timed_runs"] for r in counted)
    warmups, threads = ("/".join(map(str, sorted({r[field] for r in counted})))
                        for field in ("warmup_runs", "threads"))
    return [f"ms: median CPU time per call over >= {runs} timed calls per row, after {warmups} "
            f"untimed warm-up calls; CPU threads {threads}; clock {counted[0]['timer']}"]


def _mask_label(r: dict) -> str:
    """The mask form of a record's workload, e.g. "causal", "block 0.50 of 64x64" (records
    older than a mask kind lack its field)."""
    causal = " causal" if r["causal"] else ""
    if r.get("density") is not None:
        return f"block {r['density']:.2f} of {r['block_size']}x{r['block_size']}"
    if r.get("topk") is not None:
        return f"top-{r['topk']}{causal} + {r['bias']} bias"
    if r.get("row_lengths") is not None:
        return f"row lengths {r['row_lengths']}"
    if r.get("window") is not None:  # a list in records read back from JSON
        return f"window {tuple(r['window'])}"
    if r.get("documents") is not None:
        return f"docs {r['documents']}{causal}"
    if r.get("page_size") is not None:
        return f"pages of {r['page_size']}{causal}"
    return "causal" if r["causal"] else "none"


# the table's columns naming a row: the workload's shape, mask and mode; left-aligned where text
_ROW_COLUMNS = ("workload", "B", "Sq", "Sk", "H/Hk", "D", "dtype", "mask", "mode")
_TEXT_COLUMNS = {"workload", "dtype", "mask", "mode"}


def _row_cells(r: dict) -> list[str]:
    return [r["name"], str(r["batch"]), str(r["seqlen_q"]), str(r["seqlen_k"]),
            f"{r['heads']}/{r['heads_k']}", str(r["head_dim"]), r["dtype"], _mask_label(r),
            r["mode"]]


def format_table(results: list[dict]) -> str:
    """Plain-text table: one row per (workload, mode), labelled with its shape (B, Sq, Sk, H/Hk,
    D, dtype) and mask form, ms and TFLOP/s columns per provider ('-' where the provider has no
    row: SDPA on sparse workloads, SDPA flash and cuDNN on dynamic and rows ones); under the
    header, how CPU times were taken; errors are listed under the table, then notes on the
    sparse, dynamic and rows workloads."""
    providers = list(dict.fromkeys(r["provider"] for r in results))
    rows = {}
    for r in results:
        rows.setdefault((r["name"], r["mode"]), {})[r["provider"]] = r
    header = list(_ROW_COLUMNS)
    for provider in providers:
        header += [f"{provider} ms", f"{provider} TFLOP/s"]
    table = [header]
    for by_provider in rows.values():
        line = _row_cells(next(iter(by_provider.values())))
        for provider in providers:
            r = by_provider.get(provider)
            if r is None or r["ms"] is None:
                line += ["error" if r else "-", "-"]
            else:
                line += [f"{r['ms']:.3f}", f"{r['tflops']:.4g}"]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [results_header(results), *_timing_lines(results), ""]
    for i, row in enumerate(table):
        cells = [c.ljust(w) if name in _TEXT_COLUMNS else c.rjust(w)
                 for name, c, w in zip(header, row, widths)]
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
    if any(r["density"] is not None for r in results):
        lines += ["", f"sparse-d<density>: random block mask listing that fraction of the blocks; "
                      f"only {', '.join(BLOCK_MASK_PROVIDERS)} run block masks"]
    dynamic = {r["name"]: r for r in results if r["topk"] is not None}
    if dynamic:
        lines += ["", f"dyn-<bias>: top-k element mask + learnable bias, its gradient timed in "
                      f"fwd+bwd; only {', '.join(ELEMENT_MASK_PROVIDERS)} run them"]
        lines += [f"  {name}: {r['topk']} keys per row{' (causal)' if r['causal'] else ''}, "
                  f"{r['active_tile_fraction']:.0%} of the forward tiles active, "
                  f"{r['bias']} bias {DYNAMIC_BIASES[r['bias']]}"
                  for name, r in dynamic.items()]
    lines += _rows_notes(results)
    if any(r.get("window") is not None for r in results):
        lines += ["", f"sliding<left> / window<left>-<right>: attention's window=(left, right) "
                      f"about the bottom-right diagonal is the only mask; only "
                      f"{', '.join(ELEMENT_MASK_PROVIDERS)} run them (SDPA on a bool mask)"]
    if any(r.get("documents") is not None for r in results):
        lines += ["", f"docs-<lengths>: one batch packed from documents (omniattn: cu_seqlens; "
                      f"the others: a document mask), lengths as fractions of the total "
                      f"{DOCUMENTS}; only {', '.join(ELEMENT_MASK_PROVIDERS)} run them"]
    lines += _decode_notes(results)
    return "\n".join(lines)


def _decode_notes(results: list[dict]) -> list[str]:
    """What the decode rows read: their time is bound by the K/V bytes (GB/s = bytes / ms / 1e6),
    not FLOPs; pages are omniattn's alone."""
    decode = {r["name"]: r for r in results if r.get("forward_only")}
    if not decode:
        return []
    lines = ["", "decode-b<B>-k<keys>: one query token per sequence over a cache of that many "
                 "keys, forward only; -paged<n>: pages of n keys in a shuffled order (omniattn "
                 "alone). K/V bytes each call reads:"]
    for name, r in decode.items():
        size = torch.finfo(getattr(torch, r["dtype"])).bits // 8
        kv_bytes = 2 * r["batch"] * r["seqlen_k"] * r["heads_k"] * r["head_dim"] * size
        lines.append(f"  {name}: {kv_bytes / 1e6:.1f} MB")
    return lines


def _shape_key(r: dict) -> tuple:
    return tuple(r[field] for field in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_k",
                                        "head_dim", "dtype"))


def _rows_notes(results: list[dict]) -> list[str]:
    """Notes on the rows workloads: their lengths, active tile fraction, and per mode omniattn's
    time over (its time on the dense workload of the same shape x that fraction), the ratio
    issue #5's acceptance bounds by 1.1 (where the run has that dense time)."""
    rows = {r["name"]: r for r in results if r["row_lengths"] is not None}
    if not rows:
        return []
    dense_ms = {(_shape_key(r), r["mode"]): r["ms"] for r in results
                if r["provider"] == "omniattn" and r["ms"] is not None and not r["causal"]
                and r["density"] is None and r["topk"] is None and r["row_lengths"] is None
                and r.get("window") is None and r.get("documents") is None}
    lines = ["", f"rows-<lengths>: per-row key lengths (seqlens_k_per_row), not causal; only "
                 f"{', '.join(ELEMENT_MASK_PROVIDERS)} run them; ratio = omniattn ms / (dense "
                 f"ms x active tile fraction), to stay <= 1.1"]
    for name, r in rows.items():
        fraction = r["active_tile_fraction"]
        ratios = []
        for run in results:
            dense = dense_ms.get((_shape_key(run), run["mode"]))
            if run["name"] == name and run["provider"] == "omniattn" and run["ms"] is not None \
                    and dense is not None and fraction:
                ratios.append(f"{run['mode']} {run['ms'] / (dense * fraction):.2f}")
        line = f"  {name}: lengths {ROW_LENGTHS[r['row_lengths']]}, {fraction:.1%} of the " \
               f"forward tiles active"
        lines.append(line + (f"; ratio {', '.join(ratios)}" if ratios else ""))
    return lines


def load_records(paths: list[str | Path]) -> tuple[list[dict], str]:
    """The results of records written by write_json (`omniattn bench --json`), concatenated,
    and the device they were measured on. Raises ValueError for records of different devices."""
    results, devices = [], []
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        results += record["results"]
        devices.append(record["environment"]["device"])
    if len(set(devices)) > 1:
        raise ValueError(f"records of different devices cannot share a plot: "
                         f"{dict(zip(map(str, paths), devices))}")
    return results, devices[0]


def write_json(path: str | Path, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment_info(), "results": results}, f, indent=2)
        f.write("\n")
