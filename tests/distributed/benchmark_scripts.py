"""The scripts of benchmarks/ as modules, for their tests: each imports its neighbours (such as
cp_common) from its own directory, which is on sys.path when it runs as a script; here they
are loaded from their files and registered under their names the same way."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]
BENCHMARKS = ROOT / "benchmarks"


@functools.cache
def benchmark_module(name: str, neighbours: tuple[str, ...] = ("cp_common",)):
    """benchmarks/<name>.py as the module `name`, its `neighbours` loaded first."""
    for module_name in (*neighbours, name):
        if module_name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(module_name,
                                                      BENCHMARKS / f"{module_name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def smoke_run(name: str, folder: pathlib.Path, *options: str) -> tuple[dict, str]:
    """(the JSON results, stdout) of `python benchmarks/<name>.py --cpu-smoke *options`, run
    as a script with this checkout's package; its failure fails the test with its stderr."""
    results_file = folder / f"{name}.json"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--cpu-smoke",
                          *options, "--json", str(results_file)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(results_file.read_text()), run.stdout
