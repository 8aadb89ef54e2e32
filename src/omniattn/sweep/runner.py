"""Running the sweep: each config in this process or in spawned worker processes (`run_seeds`),
and what it prints (`report`, `detail`)."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
import traceback
from collections.abc import Iterator

import torch

from .calls import build_call, evaluate
from .compare import EMPTY_ROWS, QuantityCheck, compare
from .configs import SweepConfig, config_seed, draw_config, limits_for

CONFIG_TIMEOUT_S = 900  # a config running longer in a worker (a hung kernel) fails


@dataclasses.dataclass
class ConfigResult:
    """The outcome of one config: its checks, or the exception it raised."""
    seed: int
    families: list[str]
    description: str
    checks: list[QuantityCheck] = dataclasses.field(default_factory=list)
    exception: str = ""
    device_broken: bool = False  # a CUDA error that leaves the context unusable
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.exception and all(c.passed for c in self.checks)

    def failures(self) -> str:
        """What failed, in a few words per quantity."""
        if self.exception:
            return self.exception
        return "; ".join(f"{c.name}: {c.reason}" for c in self.checks if not c.passed)


def run_config(config: SweepConfig, device: torch.device | str) -> ConfigResult:
    """The kernels, the float64 reference and the plain dtype on the config's call, compared."""
    import omniattn
    from ..reference import attention_reference

    device = torch.device(device)
    started = time.perf_counter()
    result = ConfigResult(config.seed, config.families, config.describe())
    try:
        call = build_call(config, device)
        kernel = evaluate(omniattn.attention, call, None, config.backward, config.return_lse,
                          **call.kernel_options)
        reference = evaluate(attention_reference, call, torch.float64, config.backward, True)
        plain = evaluate(attention_reference, call, None, config.backward, True, upcast=False)
        result.checks = compare(config, kernel, reference, plain)
    except Exception as exc:  # a raising config is a failed config, reported with its seed
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" \
            if frames else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result.exception = f"raised {type(exc).__name__}{where}: {first_line}"
        accelerator_error = getattr(torch, "AcceleratorError", ())
        result.device_broken = device.type == "cuda" and (
            isinstance(exc, accelerator_error) or "CUDA error" in str(exc))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - started
    return result


def run_seed(seed: int, device: torch.device | str) -> ConfigResult:
    """Draw the config of `seed` for `device` (GPU or interpreter limits) and run it."""
    device = torch.device(device)
    return run_config(draw_config(seed, limits_for(device)), device)


def kernels_run_here(device: torch.device) -> bool:
    """Whether this process can run the kernels on `device`: CUDA, or the CPU with
    TRITON_INTERPRET=1 set before triton was imported (what tests/conftest.py does)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _serve(connection, device_index: int | None) -> None:
    """A worker: receive seeds, send back their ConfigResult, stop at None (or after a CUDA
    error that broke its context, to be replaced)."""
    if device_index is not None:
        torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index) if device_index is not None \
        else torch.device("cpu")
    while True:
        seed = connection.recv()
        if seed is None:
            return
        result = run_seed(seed, device)
        connection.send(result)
        if result.device_broken:
            return


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """os.environ with `variables` set (what spawned workers inherit), restored after."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class _Worker:
    process: object
    connection: object
    seed: int | None = None  # the config in flight
    started: float = 0.0


def _in_workers(seeds: list[int], device: torch.device, jobs: int) -> Iterator[ConfigResult]:
    """Results of `seeds` from `jobs` spawned worker processes (GPUs shared round-robin), in
    the order they finish. A worker that dies or runs past CONFIG_TIMEOUT_S fails its config
    and is replaced."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")
    cuda = device.type == "cuda"
    # CPU workers import triton under the interpreter: it must be set when they start
    environment = {} if cuda else {"TRITON_INTERPRET": "1"}
    pending = collections.deque(seeds)
    workers: list[_Worker] = []
    started_count = 0

    def start() -> None:
        nonlocal started_count
        parent_end, child_end = context.Pipe()
        gpu = started_count % torch.cuda.device_count() if cuda else None
        started_count += 1
        with _environment(**environment):
            process = context.Process(target=_serve, args=(child_end, gpu), daemon=True)
            process.start()
        child_end.close()
        worker = _Worker(process, parent_end)
        workers.append(worker)
        give_work(worker)

    def give_work(worker: _Worker) -> None:
        if pending:
            worker.seed, worker.started = pending.popleft(), time.monotonic()
            worker.connection.send(worker.seed)
        else:
            worker.connection.send(None)
            stop(worker)

    def stop(worker: _Worker) -> None:
        workers.remove(worker)
        worker.process.join(timeout=30)
        worker.process.kill()
        worker.connection.close()

    def lost(worker: _Worker, why: str) -> ConfigResult:
        stop(worker)
        if pending:
            start()
        config = draw_config(worker.seed, limits_for(device))
        return ConfigResult(worker.seed, config.families, config.describe(), exception=why)

    for _ in range(min(jobs, len(seeds))):
        start()
    while workers:
        wait([w.connection for w in workers] + [w.process.sentinel for w in workers],
             timeout=10)
        for worker in list(workers):
            if worker.connection.poll():
                try:
                    result = worker.connection.recv()
                except EOFError:
                    yield lost(worker, f"the worker process died (exit code "
                                       f"{worker.process.exitcode})")
                    continue
                yield result
                if result.device_broken:  # the worker exits: a fresh one takes over
                    stop(worker)
                    if pending:
                        start()
                else:
                    give_work(worker)
            elif not worker.process.is_alive():
                yield lost(worker, f"the worker process died (exit code "
                                   f"{worker.process.exitcode})")
            elif time.monotonic() - worker.started > CONFIG_TIMEOUT_S:
                yield lost(worker, f"timed out after {CONFIG_TIMEOUT_S} s")


def run_seeds(seeds: list[int], device: torch.device, jobs: int = 1) -> Iterator[ConfigResult]:
    """ConfigResults of `seeds` (each drawn for `device`) as they finish: in this process when
    jobs == 1 and it can run the kernels, else in worker processes. In this process a CUDA
    error that breaks the context stops the run (later seeds get no result)."""
    if jobs <= 1 and kernels_run_here(device):
        for seed in seeds:
            result = run_seed(seed, device)
            yield result
            if result.device_broken:
                return
    else:
        yield from _in_workers(seeds, device, max(jobs, 1))


def _progress(results: Iterator[ConfigResult], total: int) -> Iterator[ConfigResult]:
    """Results passed through, with a tqdm bar if tqdm is installed, else a line each."""
    try:
        from tqdm import tqdm
    except ImportError:
        for done, result in enumerate(results, 1):
            print(f"[{done}/{total}] {'PASS' if result.passed else 'FAIL'} {result.seed} "
                  f"({result.seconds:.1f} s)", flush=True)
            yield result
        return
    with tqdm(total=total, unit="config") as bar:
        failed = 0
        for result in results:
            failed += not result.passed
            bar.set_postfix(failed=failed)
            bar.update()
            yield result


def reproduce_command(seed: int) -> str:
    return f"omniattn check --config {seed}"


def report(results: list[ConfigResult], requested: int) -> str:
    """Per-family pass counts (a config counts in every family it has), the total, and each
    failing config: its reproduce command, what failed by how much, and its description."""
    families: dict[str, list[int]] = {}
    for result in results:
        for family in result.families:
            counts = families.setdefault(family, [0, 0])
            counts[0] += 1
            counts[1] += result.passed
    width = max([len("family"), *map(len, families)])
    lines = ["per family (a config counts in each family of its features; dense: no mask of "
             "any kind):", f"{'family':<{width}}  configs  passed  failed"]
    for family, (count, passed) in sorted(families.items()):
        lines.append(f"{family:<{width}}  {count:7d}  {passed:6d}  {count - passed:6d}")
    passed = sum(r.passed for r in results)
    lines.append(f"total: {len(results)} configs, {passed} passed, {len(results) - passed} failed"
                 + (f", {requested - len(results)} not run" if len(results) < requested else ""))
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append("failing configs (each line re-runs one alone):")
    for result in sorted(failed, key=lambda r: r.seed):
        lines.append(f"  {reproduce_command(result.seed)}  # {result.failures()}")
        lines.append(f"      {result.description}")
    return "\n".join(lines)


def detail(result: ConfigResult) -> str:
    """Every quantity of one config: error, plain dtype's error, bound, verdict."""
    lines = [f"config {result.seed}: {result.description}",
             f"  families: {', '.join(result.families)}; {result.seconds:.1f} s"]
    if result.exception:
        lines.append(f"  FAIL {result.exception}")
    for check in result.checks:
        verdict = "PASS" if check.passed else f"FAIL ({check.reason})"
        if check.name.endswith(EMPTY_ROWS):
            numbers = f"max |value| {check.error:.3e}, must be exactly 0"
        else:
            numbers = f"error {check.error:.3e}  torch {check.torch_error:.3e}  bound " \
                      f"{check.bound:.3e}"
        lines.append(f"  {check.name:<16} {numbers}  {verdict}")
    return "\n".join(lines)


def sweep(count: int, sweep_seed: int, device: torch.device, jobs: int = 1,
          progress: bool = True) -> list[ConfigResult]:
    """Run configs 0..count-1 of `sweep_seed`; results in config order."""
    seeds = [config_seed(sweep_seed, index) for index in range(count)]
    results = run_seeds(seeds, device, jobs)
    if progress:
        results = _progress(results, count)
    order = {seed: index for index, seed in enumerate(seeds)}
    return sorted(results, key=lambda r: order[r.seed])
