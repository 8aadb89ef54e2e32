"""benchmarks/cp_scaling.py, the GPU scaling benchmark of omniattn.distributed, without a GPU:
its whole run on the CPU at tiny sizes (--cpu-smoke: gloo, 2 processes, the reference path;
timings with and without communication, the checks, the JSON), and its host-side logic."""
from __future__ import annotations


import pytest
import torch

from benchmark_scripts import benchmark_module, smoke_run


def _script():
    return benchmark_module("cp_scaling")


def test_cpu_smoke_run(tmp_path):
    results, stdout = smoke_run("cp_scaling", tmp_path, "--profile")
    assert results["failures"] == []
    environment = results["environment"]
    assert environment["device"] == "cpu" and environment["devices"] == 2
    assert environment["NCCL_NVLS_ENABLE"] == "0"
    assert {"torch", "triton", "git_commit", "date_utc", "wall_s"} <= set(environment)
    rows = {(r["case"], r["method"]): r for r in results["results"]}
    assert set(rows) == {(c, m) for c in ("causal", "bias_window") for m in ("ring", "ulysses")}
    for row in rows.values():
        assert "error" not in row, row["error"]
        for mode in ("fwd", "fwd_bwd"):
            assert row[f"{mode}_ms"] > 0 and row[f"{mode}_ms_local"] > 0
            assert len(row[f"{mode}_rank_ms"]) == 2
            assert row[f"{mode}_speedup"] == pytest.approx(
                row[f"{mode}_single_ms"] / row[f"{mode}_ms"])
            assert 0 <= row[f"{mode}_comm_share"] < 1
            profiles = row[f"{mode}_profile"]  # each rank's
            assert len(profiles) == 2
            assert all(p["busy_ms"] > 0 and p["wall_ms"] > 0 and p["ops"] for p in profiles)
        assert row["explain"].startswith(f"method: {row['method']} (asked for:")
        assert row["target_met"] == (row["fwd_bwd_ratio"] <= 0.6)
    checks = results["checks"]
    assert len(checks) == 4 and all(c["ok"] for c in checks), checks
    assert set(checks[0]["errors"]) >= {"out", "lse", "dq", "dk", "dv"}
    assert "dbias" in next(c for c in checks if c["case"] == "bias_window")["errors"]
    assert "check causal ring S128: ok" in stdout


def test_lengths_and_heads_refused_before_any_process():
    script = _script()
    settings, _ = script.parse_settings(["--cpu-smoke", "--seqlen", "200"])
    with pytest.raises(SystemExit, match=r"sequence length 200 must be a multiple of 2 x 2 "
                                         r"ranks x block size 16 = 64"):
        script.check_settings(settings)
    settings, _ = script.parse_settings(["--cpu-smoke", "--heads", "3"])
    with pytest.raises(SystemExit, match=r"ulysses splits the 3 heads over 2 ranks"):
        script.check_settings(settings)
    script.check_settings(script.parse_settings(["--cpu-smoke", "--heads", "3", "--methods",
                                                 "ring"])[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a run without GPUs")
def test_gpu_run_without_gpus_says_so():
    with pytest.raises(SystemExit, match="no CUDA GPU visible"):
        _script().parse_settings([])


def test_merged_speedup_ratio_and_communication_share():
    single = [{"case": "causal", "seqlen": 8, "fwd_ms": 10.0, "fwd_bwd_ms": 30.0}]
    parallel = [{"case": "causal", "method": "ring", "seqlen": 8, "fwd_ms": 6.0,
                 "fwd_ms_local": 5.4, "fwd_bwd_ms": 20.0, "fwd_bwd_ms_local": 16.0},
                {"case": "causal", "method": "ulysses", "seqlen": 8, "error": "OOM"}]
    ring, failed = _script().merged(single, parallel)
    assert ring["fwd_speedup"] == pytest.approx(10 / 6)
    assert ring["fwd_bwd_ratio"] == pytest.approx(2 / 3) and not ring["target_met"]
    assert ring["fwd_comm_share"] == pytest.approx(0.1)
    assert ring["fwd_bwd_comm_share"] == pytest.approx(0.2)
    assert failed["error"] == "OOM" and "fwd_speedup" not in failed
