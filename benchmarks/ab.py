"""A/B of omniattn's speed between two trees (a change against the commit before it) on the
`omniattn bench` suites, in one GPU session: each (round, suite) runs both trees in separate
processes, alternating which goes first, and each row's time is the median over rounds.

    git archive e3ca244 | tar -x -C .ab-base   # the base tree, in a folder git ignores
    python benchmarks/ab.py --base .ab-base --suites core,sparse,dynamic,rows,headdim,gqa \
        --rounds 2 --out $OUT/ab

Prints one line per (workload, mode): base and new ms and their ratio, flagged where new is
more than --tolerance slower; writes every record and the summary (JSON) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def package_root(tree: pathlib.Path) -> pathlib.Path:
    """Where `import omniattn` finds the tree's package: src/ or (older trees) the tree itself."""
    return tree / "src" if (tree / "src" / "omniattn").is_dir() else tree


def run_bench(tree: pathlib.Path, suite: str, providers: str, path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(package_root(tree))}
    command = [sys.executable, "-m", "omniattn.cli", "bench", "--suite", suite, "--providers",
               providers, "--json", str(path)]
    with open(path.with_suffix(".log"), "w") as log:  # its table and progress bar
        subprocess.run(command, env=env, cwd=tree, check=True, stdout=log, stderr=log)


def rows(path: pathlib.Path) -> dict[tuple[str, str, str], float]:
    """(workload, mode, provider) -> ms of one record."""
    with open(path) as f:
        results = json.load(f)["results"]
    return {(r["name"], r["mode"], r["provider"]): r["ms"] for r in results
            if r.get("ms") is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=pathlib.Path, help="the base tree")
    parser.add_argument("--new", default=ROOT, type=pathlib.Path, help="the changed tree")
    parser.add_argument("--suites", default="core")
    parser.add_argument("--providers", default="omniattn")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="flag rows where new / base exceeds 1 + this")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, dict[tuple, list[float]]] = {"base": {}, "new": {}}
    trees = {"base": opts.base.resolve(), "new": opts.new.resolve()}
    for round_index in range(opts.rounds):
        for suite in opts.suites.split(","):
            order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
            for side in order:
                path = opts.out / f"{side}-{suite}-{round_index}.json"
                run_bench(trees[side], suite, opts.providers, path)
                for key, ms in rows(path).items():
                    times[side].setdefault(key, []).append(ms)
    summary = []
    print(f"{'workload':32s} {'mode':8s} {'provider':10s} {'base ms':>9s} {'new ms':>9s} ratio")
    for key in sorted(set(times["base"]) & set(times["new"])):
        base, new = (statistics.median(times[side][key]) for side in ("base", "new"))
        ratio = new / base
        flag = "  SLOWER" if ratio > 1 + opts.tolerance else ""
        summary.append({"workload": key[0], "mode": key[1], "provider": key[2], "base_ms": base,
                        "new_ms": new, "ratio": ratio, "base_runs": times["base"][key],
                        "new_runs": times["new"][key]})
        print(f"{key[0]:32s} {key[1]:8s} {key[2]:10s} {base:9.3f} {new:9.3f} {ratio:.3f}{flag}")
    with open(opts.out / "summary.json", "w") as f:
        json.dump({"base": str(trees["base"]), "new": str(trees["new"]),
                   "suites": opts.suites, "rounds": opts.rounds, "rows": summary}, f, indent=1)
    slower = sum(row["ratio"] > 1 + opts.tolerance for row in summary)
    print(f"{len(summary)} rows, {slower} slower than {1 + opts.tolerance:.2f}x the base")


if __name__ == "__main__":
    main()
