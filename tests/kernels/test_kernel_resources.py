"""benchmarks/kernel_resources.py: the kernels compile for sm_90a without a GPU and ptxas
reports their resources."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import triton

TOOL = pathlib.Path(__file__).parents[2] / "benchmarks" / "kernel_resources.py"
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
CUOBJDUMP = PTXAS.parent / "cuobjdump"


def _run_tool(*args: str) -> str:
    """The tool's report (stdout); its stderr's tail in the failure if it exits non-zero."""
    # the GPU tiles, not the interpreter's; the GPU hidden, as the compile needs none. The
    # environment is the test process's: after a FlexAttention compile it names torch's ptxas
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, f"kernel_resources.py {' '.join(args)}: exit {run.returncode}\n" \
        + run.stderr[-3000:]
    return run.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
def test_forward_resources_of_the_tuned_config(tmp_path):
    """The causal D128 forward at its tuned tiles (64 x 64, 4 warps, 3 stages through tensor
    descriptors): a real compile, so registers and shared memory come from ptxas and Triton."""
    cubin = tmp_path / "fwd.cubin"
    out = _run_tool("--kernel", "fwd", "--causal", "--seqlen", "256", "--cubin", str(cubin))
    report = dict(re.findall(r"(\w+)=(\w+)", out))
    assert report["kernel"] == "_fwd_kernel"
    assert (report["num_warps"], report["num_stages"]) == ("4", "3")
    assert 64 <= int(report["registers"]) <= 255
    # q tile + K/V tiles per stage, bf16: at least 16 KB + 3 x 32 KB
    assert int(report["shared_bytes"]) >= 16384 + 3 * 32768
    assert cubin.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
@pytest.mark.parametrize("flags", [["--mask"], ["--bias", "full"], ["--mask", "--bias", "key"]],
                         ids=["mask", "full_bias", "mask_key_bias"])
def test_forward_with_masks_at_head_dim_256_fits_shared_memory(flags):
    """the Triton forward at head dim 256 (and 192, padded to it) with a mask or bias, through tensor
    descriptors: its tiles fit the H100's 227 KB of shared memory (three stages did not)."""
    out = _run_tool("--kernel", "fwd", "--head-dim", "256", "--seqlen", "256", *flags)
    report = dict(re.findall(r"(\w+)=(\w+)", out))
    assert int(report["shared_bytes"]) <= 232448, report


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
@pytest.mark.parametrize("kernel, flags, head_dim, name", [
    ("gluon-fwd", ["--mask", "--bias", "key"], 128, "_fwd_hopper_kernel"),
    ("gluon-bwd", ["--mask", "--bias", "full"], 128, "_bwd_hopper_kernel"),
    # three dS buffers (beside the mask's TMA ring the launcher keeps two), the bias tiles in them
    ("gluon-bwd", ["--bias", "full"], 128, "_bwd_hopper_kernel"),
    # the row sums of a one-column dbias: their scratch takes the third dS buffer's room (and
    # sits beside the mask's TMA ring)
    ("gluon-bwd", ["--mask", "--bias", "column"], 128, "_bwd_hopper_kernel"),
    ("gluon-bwd", ["--bias", "column"], 128, "_bwd_hopper_kernel"),
    ("gluon-fwd", ["--mask", "--bias", "key"], 256, "_fwd_hopper_kernel"),
    ("gluon-bwd", [], 256, "_bwd_wide_kernel"),
])
def test_gluon_kernels_fit_in_shared_memory(kernel, flags, head_dim, name):
    """The Gluon kernels with issue #4's element mask and biases (tiles by TMA, their rings in
    shared memory; at head dim 256 the forward's 64 query rows per consumer and two 64-key K/V
    buffers, the backward's K, V and two q / dO buffers of 64 x 256, without masks) compile
    for sm_90a within the H100's 232,448 bytes per block (a launch past it fails only on the
    GPU)."""
    out = _run_tool("--kernel", kernel, "--causal", *flags, "--seqlen", "256", "--head-dim",
                    str(head_dim))
    report = dict(re.findall(r"(\w+)=(\w+)", out))
    assert report["kernel"] == name
    # above the K/V (forward) or q / dO (backward) rings alone, at most the H100's limit
    assert 160 * 1024 < int(report["shared_bytes"]) <= 232448


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
@pytest.mark.parametrize("flags", [["--causal"], ["--window", "1024,0", "--heads-k", "4"]])
def test_gluon_forward_at_head_dim_64_runs_three_consumers(flags):
    """A plain D64 forward takes three consumer warpgroups (`configs._FWD_HOPPER_PLAIN`): their
    q tiles beside four 128-key K/V buffers, more than two consumers' would take, without
    spills."""
    out = _run_tool("--kernel", "gluon-fwd", *flags, "--seqlen", "384", "--head-dim", "64")
    report = dict(re.findall(r"(\w+)=(\w+)", out))
    assert report["kernel"] == "_fwd_hopper_kernel"
    assert int(report["shared_bytes"]) >= 3 * 64 * 64 * 2 + 4 * 2 * 128 * 64 * 2
    assert (report["spill_store_bytes"], report["spill_load_bytes"]) == ("0", "0")


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton build has no bundled cuobjdump")
@pytest.mark.parametrize("kernel, flags", [
    # the three calls whose backward hung under 8 concurrent processes on an H100 before its
    # unused bias barriers went uninitialised (4 / 12 / 12 bytes overwritten)
    ("gluon-bwd", []),
    ("gluon-bwd", ["--causal", "--heads-k", "4"]),
    ("gluon-bwd", ["--bias", "key", "--window", "1024,0", "--heads-k", "4"]),
    ("gluon-bwd", ["--causal", "--mask", "--bias", "full"]),
    ("gluon-bwd", ["--lists"]),
    ("gluon-fwd", ["--causal", "--heads-k", "4"]),
    ("gluon-fwd", ["--mask", "--bias", "full"]),
    ("gluon-bwd", ["--causal", "--head-dim", "256"]),
    ("gluon-bwd", ["--head-dim", "64"]),
    # three consumers: each skips the leading key tiles only the others need
    ("gluon-fwd", ["--window", "1024,0", "--head-dim", "64"]),
    # per-row key lengths: the forward's q_ready barriers go uninitialised (q is gathered)
    ("gluon-fwd", ["--row-lengths"]),
    ("gluon-bwd", ["--row-lengths"]),
    # packed sequences: each program's bounds from cu_seqlens, out / dK / dV of cut tiles
    # stored without TMA
    ("gluon-fwd", ["--packed", "--causal"]),
    ("gluon-bwd", ["--packed", "--causal", "--heads-k", "4"]),
])
def test_gluon_kernels_keep_their_barriers_to_themselves(kernel, flags):
    """No plain shared store (warp_specialize's captures) lands on an initialised mbarrier: the
    SASS of each Gluon kernel form, as the tool reads it."""
    out = _run_tool("--kernel", kernel, "--seqlen", "256", *flags)
    report = dict(re.findall(r"(\w+)=(\w+)", out))
    # the SASS was read: every form initialises its rings' barriers
    assert int(report["barriers"]) >= 8, out
    assert report["barrier_bytes_overwritten"] == "0", out


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton build has no bundled cuobjdump")
@pytest.mark.parametrize("flags", [[], ["--causal", "--bias", "full"]])
def test_gluon_backward_takes_p_and_ds_from_registers(tmp_path, flags):
    """The D128 backward's dV += P^T dO and dK += dS^T Q (the wgmmas whose N is the head dim)
    read their A operand from registers, not from shared memory: through shared memory each
    took a store, a fence and a warpgroup barrier per step (backward kernel 6-10% slower on an
    H100). In the SASS: `HGMMA.64x128x16... R<acc>, R<a>, gdesc[...]`."""
    cubin = tmp_path / "bwd.cubin"
    _run_tool("--kernel", "gluon-bwd", "--seqlen", "256", "--cubin", str(cubin), *flags)
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    head_dim_wide = re.findall(r"HGMMA\.64x128x16\S* ([^;]*);", sass)
    assert head_dim_wide, "no wgmma with N = 128 in the SASS"
    from_smem = [operands for operands in head_dim_wide
                 if not re.match(r"R\d+, R\d+, gdesc", operands)]
    assert not from_smem, f"dK / dV wgmmas with A from shared memory: {from_smem[:3]}"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
@pytest.mark.parametrize("topk", [[], ["--topk", "head"]], ids=["plain", "topk"])
def test_decode_kernels_compile_without_spills(topk):
    """Split-KV decoding over pages with a key bias and a causal window (GQA 16/4, 8k keys),
    and with a top-k term over scores per query head (each packed row its own score row): the
    split kernel and the combine compile for sm_90a, with no spills, the K / V tiles
    double-buffered (the paged configs' extra stages)."""
    out = _run_tool("--kernel", "decode", "--heads-k", "4", "--seqlen", "8192", "--page-size",
                    "256", "--bias", "key", "--causal", "--window", "1000,-1", *topk)
    reports = [dict(re.findall(r"(\w+)=(\w+)", line)) for line in out.splitlines()]
    assert [r["kernel"] for r in reports] == ["decode_split_kernel", "decode_combine_kernel"]
    for report in reports:
        assert report["spill_store_bytes"] == "0" and report["spill_load_bytes"] == "0"
    # two stages of 64 x 128 bf16 K and V tiles
    assert int(reports[0]["shared_bytes"]) >= 2 * 2 * 64 * 128 * 2
