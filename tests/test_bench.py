import importlib.util
import json

import pytest
import torch

import omniattn
from omniattn import bench


@pytest.fixture
def reference_path(monkeypatch):
    """omniattn on CPU runs the PyTorch reference (conftest turns the slow interpreter on)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _tiny(name, causal=False, density=None):
    """B1 H2 S64 D16 fp32, 16 x 16 blocks: 4 x 4 blocks for the sparse case."""
    return bench.Workload(name, 1, 64, 64, 2, 2, 16, causal, torch.float32, density=density,
                          block_size=16)


def _brute_force_pairs(blocks: torch.Tensor, block_size: int, seqlen_q: int, seqlen_k: int) -> int:
    """Visible (query, key) elements of a (1, 1, nQ, nK) block picture, one element at a time."""
    return sum(bool(blocks[0, 0, i // block_size, j // block_size])
               for i in range(seqlen_q) for j in range(seqlen_k))


@pytest.mark.parametrize("seq_lengths", [(64, 64), (50, 70)])
def test_block_mask_pairs_match_brute_force(seq_lengths):
    seqlen_q, seqlen_k = seq_lengths
    generator = torch.Generator().manual_seed(1)
    blocks = torch.rand((1, 1, -(-seqlen_q // 16), -(-seqlen_k // 16)), generator=generator) < 0.4
    mask = omniattn.block_mask_from_blocks(blocks, 16, seq_lengths=seq_lengths)
    assert bench.block_mask_pairs(mask) == _brute_force_pairs(blocks, 16, seqlen_q, seqlen_k)


def test_sparse_workload_mask_density_and_flops(reference_path):
    workload = _tiny("sparse", density=0.5)
    mask = bench.workload_block_mask(workload, "cpu")
    assert mask.density == 0.5
    pairs = _brute_force_pairs(mask.states != 0, 16, 64, 64)
    assert pairs == 64 * 64 // 2
    [row] = bench.run_suite([workload], providers=["omniattn"], modes=("fwd",), progress=False,
                            device="cpu")
    assert row["flops"] == row["flops_exact"] == 4 * 1 * 2 * 16 * pairs
    # every block listed: the dense count
    full = bench.workload_block_mask(_tiny("full", density=1.0), "cpu")
    assert bench.block_mask_pairs(full) == bench.visible_pairs(64, 64, causal=False)


def test_sparse_masks_are_nested_across_densities():
    masks = [bench.workload_block_mask(_tiny(f"d{d}", density=d), "cpu").states
             for d in (0.25, 0.5, 1.0)]
    for sparser, denser in zip(masks, masks[1:]):
        assert not ((sparser != 0) & (denser == 0)).any()


def test_sparse_workload_must_not_be_causal():
    with pytest.raises(ValueError, match="causal"):
        _tiny("bad", causal=True, density=0.5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_suite_constructs(device):
    suites = {suite: bench.default_workloads(device, suite) for suite in bench.SUITES}
    assert all(suites.values())
    assert bench.default_workloads(device, "all") == [w for ws in suites.values() for w in ws]
    names = [w.name for w in bench.default_workloads(device, "all")]
    assert len(names) == len(set(names))
    assert bench.default_workloads(device) == suites["core"]
    assert [w.density for w in suites["sparse"]] == list(bench.SPARSE_DENSITIES)
    assert all(w.heads != w.heads_k and w.causal for w in suites["gqa"])
    assert {w.head_dim for w in suites["headdim"]} == {64, 256}
    if device == "cpu":  # masks build here only on the CPU
        for workload in suites["sparse"]:
            mask = bench.workload_block_mask(workload, device)
            assert mask.seq_lengths == (workload.seqlen_q, workload.seqlen_k)
            assert mask.density == pytest.approx(workload.density, abs=0.01)


def test_core_suite_is_unchanged_on_gpu():
    core = bench.default_workloads("cuda", "core")
    assert [(w.name, w.batch, w.seqlen_q, w.heads, w.head_dim, w.dtype) for w in core] == [
        ("dense-b2-s4096", 2, 4096, 16, 128, torch.bfloat16),
        ("causal-b2-s4096", 2, 4096, 16, 128, torch.bfloat16),
        ("dense-b1-s16384", 1, 16384, 16, 128, torch.bfloat16),
        ("causal-b1-s16384", 1, 16384, 16, 128, torch.bfloat16),
    ]


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite"):
        bench.default_workloads("cpu", "nope")


@pytest.fixture(scope="module")
def tiny_results():
    """run_suite on a sparse and a dense tiny workload, omniattn (reference path) and SDPA math."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return bench.run_suite([_tiny("tiny-sparse", density=0.5), _tiny("tiny-dense")],
                               providers=["omniattn", "sdpa-math"], progress=False, device="cpu")


def test_run_suite_rows(tiny_results):
    runs = [(r["name"], r["mode"], r["provider"]) for r in tiny_results]
    assert runs == [
        ("tiny-sparse", "fwd", "omniattn"),
        ("tiny-sparse", "fwd+bwd", "omniattn"),  # SDPA has no row on a sparse workload
        ("tiny-dense", "fwd", "omniattn"),
        ("tiny-dense", "fwd", "sdpa-math"),
        ("tiny-dense", "fwd+bwd", "omniattn"),
        ("tiny-dense", "fwd+bwd", "sdpa-math"),
    ]
    for r in tiny_results:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0
        assert r["density"] == (0.5 if r["name"] == "tiny-sparse" else None)


def test_format_table_names_workloads(tiny_results):
    table = bench.format_table(tiny_results)
    assert "tiny-sparse" in table and "tiny-dense" in table
    assert "errors:" not in table


def test_write_json_round_trips(tiny_results, tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json(path, tiny_results)
    written = json.loads(path.read_text())
    assert written["results"] == tiny_results
    assert written["environment"]["torch"] == torch.__version__


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_plot_writes_png(tiny_results, tmp_path):
    path = tmp_path / "bench.png"
    bench.plot_results(tiny_results, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_cli_bench_suite_option(monkeypatch, capsys):
    from omniattn import cli

    calls = []

    def fake_run_suite(workloads, **kwargs):
        calls.append(workloads)
        return []

    monkeypatch.setattr(cli, "run_suite", fake_run_suite)
    monkeypatch.setattr(cli, "format_table", lambda results: "table")
    assert cli.main(["bench", "--suite", "all,gqa"]) == 0
    assert calls == [bench.default_workloads(cli._current_device(), "all")]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--suite", "nope"])
    capsys.readouterr()

    # without matplotlib, --plot says so and the run still succeeds
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["bench", "--suite", "gqa", "--plot", "out.png"]) == 0
    assert "--plot needs matplotlib" in capsys.readouterr().out
