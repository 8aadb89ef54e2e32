"""benchmarks/cp_million.py, issue #56's million-token benchmark, without a GPU: its whole run
on the CPU at tiny sizes (--cpu-smoke: gloo, 2 processes, the reference path; the single-GPU
baseline, timings with and without communication, the ring's refusal of top-k, auto's choice,
the check of sampled rows, the JSON and the table), and its host-side logic."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmark_scripts import benchmark_module, smoke_run


def _script():
    return benchmark_module("cp_million")


def test_cpu_smoke_run(tmp_path):
    results, stdout = smoke_run("cp_million", tmp_path)
    assert results["failures"] == []
    environment = results["environment"]
    assert environment["device"] == "cpu" and environment["devices"] == 2
    assert environment["NCCL_NVLS_ENABLE"] == "0"
    assert {"torch", "triton", "git_commit", "date_utc", "wall_s"} <= set(environment)
    settings = results["settings"]
    assert (settings["seqlen"], settings["heads"], settings["heads_k"], settings["head_dim"],
            settings["dtype"], settings["topk"]) == (256, 4, 2, 16, "float32", 16)
    assert results["check_rows"] == _script().sample_rows(256, 2, 16, 16)
    single = results["single"]
    assert single["seqlen"] == 128 and single["fwd_bwd_tflops_causal_pairs"] > 0

    rows = {(r["case"], r["method"]): r for r in results["results"]}
    assert set(rows) == {(c, m) for c in ("causal", "bias_topk")
                         for m in ("ring", "ulysses", "auto")}
    refused = rows.pop(("bias_topk", "ring"))
    assert refused["status"] == "refused" and "fwd_ms" not in refused
    assert refused["refused"].startswith("method='ring' cannot run this call: top-k")
    for (case, method), row in rows.items():
        assert row["status"] == "ok", row.get("error")
        for mode in ("fwd", "fwd_bwd"):
            assert row[f"{mode}_ms"] > 0 and row[f"{mode}_ms_local"] > 0
            assert len(row[f"{mode}_rank_ms"]) == 2
            assert 0 <= row[f"{mode}_comm_share"] < 1
            assert row[f"{mode}_peak_gib_per_rank"] is None  # no allocator statistics on CPU
            assert row[f"{mode}_tflops_ratio_to_single"] == pytest.approx(
                row[f"{mode}_tflops_per_gpu_causal_pairs"]
                / single[f"{mode}_tflops_causal_pairs"])
            kept = row.get(f"{mode}_tflops_per_gpu_topk_pairs")
            assert (kept is not None) == (case == "bias_topk")
        assert ("target_met" in row) == (case == "causal")
        assert row["check"]["ok"], row["check"]
        assert set(row["check"]["errors"]) == {"out", "lse", "dq"}
        if method == "auto":
            assert row["chose"] == row["timed_as"] == "ulysses"
            assert row["fwd_bwd_ms"] == rows[(case, "ulysses")]["fwd_bwd_ms"]
        else:
            assert row["explain"].startswith(f"method: {method} (asked for:")
    assert "bias_topk ring            | refused: method='ring' cannot run" in stdout
    assert "causal    auto->ulysses   |" in stdout


def test_sample_rows_hold_the_boundaries_the_last_rows_and_the_kth_key():
    sample_rows = _script().sample_rows
    seqlen, world, topk = 1 << 20, 8, 4096
    rows = sample_rows(seqlen, world, 64, topk)
    assert len(rows) == 64 and rows == sorted(set(rows))
    chunk = seqlen // (2 * world)
    fixed = {0, seqlen - 2, seqlen - 1, topk - 1, topk}
    fixed |= {row for b in range(chunk, seqlen, chunk) for row in (b - 1, b)}
    assert fixed <= set(rows)
    assert max(b - a for a, b in zip(rows, rows[1:])) < chunk  # spread: no chunk left out
    assert sample_rows(8, 2, 100, 16) == list(range(8))
    assert len(sample_rows(256, 2, 3, 16)) == 11  # the fixed rows, more than asked


def test_owner_finds_each_row_in_its_zigzag_shard():
    from omniattn.distributed.layout import to_shards

    seqlen, world = 48, 3
    shards = to_shards(torch.arange(seqlen), "zigzag", world, 0)
    for row in range(seqlen):
        rank, index = _script().owner(row, world, seqlen)
        assert shards[rank][index] == row
    with pytest.raises(ValueError, match=r"row must lie in \[0, 48\), got 48"):
        _script().owner(seqlen, world, seqlen)


def test_pair_counts():
    script = _script()
    for seqlen in (1, 7, 64):
        assert script.causal_pairs(seqlen) == int(torch.ones(seqlen, seqlen).tril().sum())
        for topk in (1, 5, 64, 100):
            assert script.topk_pairs(seqlen, topk) == sum(min(i + 1, topk)
                                                          for i in range(seqlen))


def test_merged_rates_ratio_and_target():
    script = _script()
    settings = dataclasses.replace(script.parse_settings(["--cpu-smoke"])[0], seqlen=256,
                                   topk=16)
    single = script.with_rates({"case": "causal", "seqlen": 128, "fwd_ms": 1.0,
                                "fwd_bwd_ms": 4.0}, settings)
    # 4 x D16 x B1 x H4 FLOPs a pair, forward+backward 3.5x
    assert single["fwd_tflops_causal_pairs"] == pytest.approx(256 * 8256 / 1e9)
    assert single["fwd_bwd_tflops_causal_pairs"] == pytest.approx(3.5 * 256 * 8256 / 4e9)
    parallel = [{"case": "causal", "method": "ring", "seqlen": 256, "fwd_ms": 2.0,
                 "fwd_ms_local": 1.5, "fwd_bwd_ms": 8.0, "fwd_bwd_ms_local": 8.0,
                 "fwd_peak_gib_per_rank": [1.0, 3.0], "fwd_bwd_peak_gib_per_rank": None},
                {"case": "bias_topk", "method": "ulysses", "seqlen": 256, "fwd_ms": 2.0,
                 "fwd_bwd_ms": 8.0},
                {"case": "bias_topk", "method": "ring", "seqlen": 256, "refused": "top-k"},
                {"case": "causal", "method": "ulysses", "seqlen": 256, "error": "OOM"}]
    ring, topk, refused, failed = script.merged(single, parallel, settings)
    # 32896 causal pairs of 256 rows, over 2 GPUs
    assert ring["fwd_tflops_per_gpu_causal_pairs"] == pytest.approx(256 * 32896 / 2 / 2e9)
    assert ring["fwd_bwd_tflops_ratio_to_single"] == pytest.approx(
        (3.5 * 256 * 32896 / 2 / 8e9) / (3.5 * 256 * 8256 / 4e9))
    assert ring["target_met"] == (ring["fwd_bwd_tflops_ratio_to_single"] >= 0.8)
    assert ring["fwd_comm_share"] == pytest.approx(0.25) and ring["fwd_bwd_comm_share"] == 0
    assert ring["fwd_peak_gib"] == 3.0 and ring["fwd_bwd_peak_gib"] is None
    # top-k: 16 x 17 / 2 + 240 x 16 kept pairs; no target (its tiles are not causal's)
    assert topk["fwd_tflops_per_gpu_topk_pairs"] == pytest.approx(256 * 3976 / 2 / 2e9)
    assert topk["fwd_comm_share"] is None and "target_met" not in topk
    assert refused["status"] == "refused" and "fwd_tflops_per_gpu_causal_pairs" not in refused
    assert failed["status"] == "failed" and ring["status"] == topk["status"] == "ok"


def test_settings_refused_before_any_process():
    script = _script()

    def refused(*argv):
        return script.check_settings(script.parse_settings(["--cpu-smoke", *argv])[0])

    with pytest.raises(SystemExit, match=r"--seqlen 250 must be a multiple of 2 x 2 ranks = 4"):
        refused("--seqlen", "250")
    with pytest.raises(SystemExit, match=r"--heads 5 must be a multiple of --heads-k 2"):
        refused("--heads", "5")
    with pytest.raises(SystemExit, match=r"--topk must be at least 1, got 0"):
        refused("--topk", "0")
    refused("--heads", "6", "--methods", "ring")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a run without GPUs")
def test_gpu_run_without_gpus_says_so():
    with pytest.raises(SystemExit, match="no CUDA GPU visible"):
        _script().parse_settings([])
