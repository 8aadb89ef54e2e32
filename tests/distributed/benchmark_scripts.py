"""The scripts of benchmarks/ as modules, for their tests: each imports its neighbours (such as
cp_common) from its own directory, which is on sys.path when it runs as a script; here they
are loaded from their files and registered under their names the same way."""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


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
