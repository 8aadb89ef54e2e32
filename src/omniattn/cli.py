"""`omniattn` command line: `bench` (speed), `plot` (a PNG of saved records), `check`
(correctness: fixed cases, or `check --sweep N --seed S [--jobs J]`, a randomized sweep of every
feature, see omniattn/sweep/), `info` (environment)."""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import platform
import warnings

import torch
import triton

import omniattn
from omniattn.bench import (MODES, PROVIDERS, SUITES, default_workloads, device_name, format_table,
                            load_records, plot_results, run_suite, write_json)
from omniattn.reference import attention_reference
from omniattn.runtime.switches import interpreting, switches


def _current_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _omniattn_path(device: torch.device) -> str:
    """What omniattn.attention runs for tensors on `device` (mirrors plan.uses_kernels)."""
    if device.type == "cuda":
        return "Triton kernels"
    if interpreting():
        return "Triton kernels under the interpreter"
    return "reference path"


def _comma_list(choices):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of "
                                             f"{','.join(choices)}, got {text!r}")
        return items

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def run_bench(args: argparse.Namespace) -> int:
    device = _current_device()
    workloads = [w for suite in args.suite for w in default_workloads(device, suite)]
    # "all" next to a named suite lists its workloads twice
    workloads = list(dict.fromkeys(workloads))
    results = run_suite(workloads, providers=args.providers, modes=tuple(args.modes),
                        device=device)
    print(format_table(results))
    if args.json:
        write_json(args.json, results)
        print(f"\nwrote {args.json}")
    if args.plot:
        _write_plot(results, args.plot)
    return 0


def _write_plot(results: list[dict], path: str, device: str | None = None) -> bool:
    """plot_results, or a line saying why the PNG was not written."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nplots need matplotlib (pip install matplotlib, or the [bench] extra); {path} "
              f"not written")
        return False
    try:
        plot_results(results, path, device)
    except ValueError as exc:
        print(f"\n{path} not written: {exc}")
        return False
    print(f"\nwrote {path}")
    return True


def run_plot(args: argparse.Namespace) -> int:
    try:
        results, device = load_records(args.records)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot read the records: {exc!r}")
        return 2
    return 0 if _write_plot(results, args.out, device) else 1


# name, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal
_CHECK_CASES = [
    ("dense", 2, 64, 64, 4, 4, 64, False),
    ("causal", 2, 64, 64, 4, 4, 64, True),
    ("gqa-causal", 2, 64, 64, 4, 2, 64, True),
    ("odd-lengths-dense", 1, 17, 33, 4, 4, 64, False),
    ("odd-lengths-causal", 1, 17, 33, 4, 4, 64, True),
]


def _output_and_grads(attn, q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of attn on fresh leaves made from q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, causal=causal)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _max_errors(tensors: list[torch.Tensor], gold: list[torch.Tensor]) -> list[float]:
    return [(t.double() - g).abs().max().item() for t, g in zip(tensors, gold)]


def run_check(args: argparse.Namespace) -> int:
    if args.sweep is not None or args.config is not None:
        return _run_sweep(args)
    if args.seed is not None or args.jobs is not None:
        print("--seed and --jobs go with --sweep N (or --jobs with --config)")
        return 2
    device = _current_device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    atol = 1e-3 if dtype == torch.float16 else 1e-5
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"check: omniattn ({_omniattn_path(device)}) on {device.type} {dtype_name} against the "
          f"float64 reference; bound = 2 x (reference in {dtype_name}) error + {atol:g}")
    names = ("out", "dq", "dk", "dv")
    failures = 0
    for name, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal in _CHECK_CASES:
        generator = torch.Generator(device).manual_seed(0)

        def randn(seqlen, num_heads):
            return torch.randn((batch, seqlen, num_heads, head_dim), generator=generator,
                               device=device, dtype=dtype)

        q, k, v = randn(seqlen_q, heads), randn(seqlen_k, heads_k), randn(seqlen_k, heads_k)
        dout = randn(seqlen_q, heads)
        gold = _output_and_grads(attention_reference, q.double(), k.double(), v.double(),
                                 dout.double(), causal)
        ours = _output_and_grads(omniattn.attention, q, k, v, dout, causal)
        baseline = _output_and_grads(functools.partial(attention_reference, upcast=False),
                                     q, k, v, dout, causal)
        errors = _max_errors(ours, gold)
        bounds = [2 * e + atol for e in _max_errors(baseline, gold)]
        passed = all(e <= b for e, b in zip(errors, bounds))
        failures += not passed
        detail = "  ".join(f"{n} {e:.2e} (<= {b:.2e})" for n, e, b in zip(names, errors, bounds))
        print(f"{'PASS' if passed else 'FAIL'}  {name:<20} {detail}")
    print(f"{len(_CHECK_CASES) - failures} passed, {failures} failed")
    return 1 if failures else 0


def _run_sweep(args: argparse.Namespace) -> int:
    """--sweep N [--seed S]: configs 0..N-1 of seed S; --config SEED...: those configs alone,
    each quantity in detail. Exit status 1 if any failed."""
    from omniattn import sweep

    if args.sweep is not None and args.config is not None:
        print("give either --sweep N (with --seed) or --config SEED, not both")
        return 2
    if args.config is not None and args.seed is not None:
        print("--seed goes with --sweep; --config takes the config seeds themselves")
        return 2
    device = _current_device()
    jobs = args.jobs or 1
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device_name()
    # without TRITON_INTERPRET=1 from the start, CPU configs run in interpreter workers
    path = _omniattn_path(device) if sweep.kernels_run_here(device) \
        else "Triton kernels under the interpreter, in worker processes"
    print(f"check: omniattn ({path}) on {device.type} ({where}), {jobs} job(s), against the "
          f"float64 reference; per quantity: error <= 2 x (reference in the input dtype) "
          f"error + {sweep.RELATIVE_TOLERANCE:g} x max|float64 reference|")
    if args.config is not None:
        results = list(sweep.run_seeds(args.config, device, jobs))
        for result in results:
            print(sweep.detail(result))
        requested = len(args.config)
    else:
        print(f"sweep: {args.sweep} configs of seed {args.seed or 0}")
        results = sweep.sweep(args.sweep, args.seed or 0, device, jobs)
        requested = args.sweep
    print(sweep.report(results, requested))
    return 0 if len(results) == requested and all(r.passed for r in results) else 1


def _probe_sdpa(backend, device: torch.device) -> str:
    """'available', or why a tiny call under this SDPA backend fails on `device`."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    # half precision is what the fused GPU backends need; the CPU runs float32
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    # torch explains an unavailable backend in warnings and then raises a generic error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                scaled_dot_product_attention(q, q, q)
        except RuntimeError as exc:
            reasons = [str(w.message).strip().splitlines()[0] for w in caught] or [str(exc)]
            return f"unavailable ({reasons[0]})"
    return "available"


def run_info(args: argparse.Namespace) -> int:
    from torch.nn.attention import SDPBackend

    device = _current_device()
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            print(f"device cuda:{index}: {props.name} (sm_{props.major}{props.minor}, "
                  f"{props.total_memory / 2**30:.0f} GiB)")
    else:
        print(f"device: cpu ({device_name()}); no CUDA device")
    print(f"omniattn {omniattn.__version__}, torch {torch.__version__}, "
          f"triton {triton.__version__}, python {platform.python_version()}")
    if device.type == "cuda":
        print(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    print(f"TRITON_INTERPRET: {os.environ.get('TRITON_INTERPRET', 'not set')}")
    print("switches: " + ", ".join(f"{name} {'on' if on else 'off'}"
                                   for name, on in switches().items()))
    print("backends:")
    print(f"  omniattn on {device.type}: {_omniattn_path(device)}")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        print(f"  SDPA {backend.name}: {_probe_sdpa(backend, device)}")
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        flex = "importable (benchmarked on CUDA only)"
    except ImportError as exc:
        flex = f"unavailable ({exc})"
    print(f"  flex_attention: {flex}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omniattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench_parser = commands.add_parser(
        "bench", help="time the benchmark suites on cuda if available, else cpu")
    bench_parser.add_argument("--suite", type=_comma_list((*SUITES, "all")), default=["core"],
                              help=f"comma-separated, from {','.join(SUITES)} or all "
                                   f"(default: core)")
    bench_parser.add_argument("--json", metavar="PATH", help="also write environment and results")
    bench_parser.add_argument("--plot", metavar="PATH",
                              help="also draw a PNG: time against density for the sparse suite, "
                                   "against sequence length for the seqlen suite, TFLOP/s per "
                                   "workload for the others (needs matplotlib)")
    bench_parser.add_argument("--providers", type=_comma_list(PROVIDERS), default=None,
                              help=f"comma-separated, from {','.join(PROVIDERS)} "
                                   f"(default: those suited to the device)")
    bench_parser.add_argument("--modes", type=_comma_list(MODES), default=list(MODES),
                              help=f"comma-separated, from {','.join(MODES)} (default: both)")
    bench_parser.set_defaults(handler=run_bench)

    plot_parser = commands.add_parser(
        "plot", help="draw the PNG of records written by bench --json (no GPU needed)")
    plot_parser.add_argument("records", nargs="+", metavar="RECORD",
                             help="JSON records of one device, e.g. benchmarks/results/*.json")
    plot_parser.add_argument("--out", metavar="PATH", required=True, help="the PNG to write")
    plot_parser.set_defaults(handler=run_plot)
    check_parser = commands.add_parser(
        "check", help="compare output and gradients with the float64 reference: a few fixed "
                      "cases, or a randomized sweep of every feature (--sweep)")
    check_parser.add_argument(
        "--sweep", type=_positive_int, metavar="N",
        help="run N random configs (shapes, dtypes, GQA, causal, windows, softcap, masks, "
             "biases, per-row lengths, block masks, varlen, lse, deterministic) instead of the "
             "fixed cases; each failing config is printed as an 'omniattn check --config SEED' "
             "line that re-runs it alone on the same kind of device (CUDA or the CPU "
             "interpreter draw different sizes)")
    check_parser.add_argument("--seed", type=int, metavar="S",
                              help="the sweep's seed (default 0); config i has its own seed, "
                                   "derived from S and i")
    check_parser.add_argument("--config", type=int, nargs="+", metavar="SEED",
                              help="re-run these configs (seeds a sweep printed), each "
                                   "quantity in detail")
    check_parser.add_argument("--jobs", type=_positive_int, metavar="J",
                              help="worker processes sharing the device (default 1); Triton "
                                   "compiles every new kernel variant, so on a GPU use about "
                                   "one per CPU core")
    check_parser.set_defaults(handler=run_check)
    commands.add_parser(
        "info", help="devices, versions and available backends"
    ).set_defaults(handler=run_info)

    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
