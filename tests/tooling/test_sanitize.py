"""tools/sanitize.py (compute-sanitizer over every kernel family), its log reader
tools/sanitizer_log.py and tools/racecheck_minimal.py (race-free warp-specialised kernels): the
log reader on canned sanitizer output, the run orchestration with a stand-in sanitizer, and the
minimal kernels' sm_90a compile."""
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import triton

from helpers import GPU

TOOLS = pathlib.Path(__file__).parents[2] / "tools"
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sanitize = _load("sanitize")
sanitizer_log = _load("sanitizer_log")

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at 0x1a30 in /repo/omniattn/kernels/fwd.py:201:_fwd_kernel
=========     by thread (96,0,0) in block (1,0,0)
=========     Address 0x7f0000001000 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2fe3a1] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
=========     at 0x1a30 in /repo/omniattn/kernels/fwd.py:201:_fwd_kernel
=========     by thread (97,0,0) in block (1,0,0)
=========     Address 0x7f0000001010 is out of bounds
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cuStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

# analysis and hazard reports (--racecheck-report all), both location formats
RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Potential RAW hazard detected at __shared__ 0x38118 in block (0,1,0) :
=========     Write Thread (0,0,0) at 0x3c0 in /repo/omniattn/kernels/fwd_hopper.py:706:_fwd_hopper_kernel
=========     Read Thread (256,0,0) at 0x5f40 in /repo/omniattn/kernels/fwd_hopper.py:599:_fwd_hopper_kernel
=========     Current Value : 67372036, Incoming Value : 0
=========
========= Error: Potential RAW hazard detected at __shared__ 0x38118 in block (1,1,0) :
=========     Write Thread (100,0,0) at 0x3c0 in /repo/omniattn/kernels/fwd_hopper.py:706:_fwd_hopper_kernel
=========     Read Thread (300,0,0) at 0x5f40 in /repo/omniattn/kernels/fwd_hopper.py:599:_fwd_hopper_kernel
=========     Current Value : 67372036, Incoming Value : 0
=========
========= Error: Race reported between Write access at 0x3c0 in /repo/omniattn/kernels/fwd_hopper.py:706:_fwd_hopper_kernel
=========     and Read access at 0x5f40 in /repo/omniattn/kernels/fwd_hopper.py:599:_fwd_hopper_kernel [8 hazards]
=========     and Read access at _fwd_hopper_kernel+0x5f80 in /repo/omniattn/kernels/fwd_hopper.py:599 [4 hazards]
=========
========= Warning: Race reported between Read access at 0x100 in /repo/tools/racecheck_minimal.py:60:_ws_bare_kernel
=========     and Write access at 0x180 in /repo/tools/racecheck_minimal.py:63:_ws_bare_kernel [2 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
"""

SYNCCHECK_ERROR = """\
========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at 0x7d0 in /repo/omniattn/kernels/bwd_hopper.py:433:_bwd_hopper_kernel
=========     by thread (1,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""

CHILD = 'sanitize-child: {"family": "gluon-dense", "kernels": ["_fwd_hopper_kernel"], ' \
    '"seconds": 1.5, "skipped": null}\n'


def test_summary_counts():
    """ERROR SUMMARY and RACECHECK SUMMARY, singular and plural; a log without them: None."""
    assert sanitizer_log.parse_log(MEMCHECK_CLEAN).errors == 0
    assert sanitizer_log.parse_log(SYNCCHECK_ERROR).errors == 1
    report = sanitizer_log.parse_log(RACECHECK)
    assert (report.hazards, report.hazard_errors, report.hazard_warnings) == (3, 2, 1)
    assert report.count() == 3
    assert sanitizer_log.parse_log("Error: unrecognized option '--bogus'\n").count() is None


def test_memcheck_messages_grouped_by_kernel_and_line():
    report = sanitizer_log.parse_log(MEMCHECK_ERRORS)
    reads = [f for f in report.messages if f.what.startswith("Invalid __global__ read")]
    assert len(reads) == 1 and reads[0].count == 2  # addresses differ, message and line match
    assert (reads[0].kernel, reads[0].where) == ("_fwd_kernel", "fwd.py:201")
    assert any(f.what.startswith("Program hit cudaErrorLaunchFailure") for f in report.messages)
    assert not any("Target application" in f.what for f in report.messages)


def test_racecheck_analysis_and_hazards():
    """Pairs of source lines with their hazard counts; each hazard's threads as warps."""
    report = sanitizer_log.parse_log(RACECHECK)
    pairs = {(f.severity, f.kernel, f.what, f.where): f.count for f in report.analysis}
    assert pairs == {
        ("ERROR", "_fwd_hopper_kernel", "Write / Read", "fwd_hopper.py:706 / fwd_hopper.py:599"): 12,
        ("WARNING", "_ws_bare_kernel", "Read / Write",
         "racecheck_minimal.py:60 / racecheck_minimal.py:63"): 2,
    }
    [hazard] = report.hazard_reports
    assert (hazard.kernel, hazard.what, hazard.count) == ("_fwd_hopper_kernel", "RAW", 2)
    assert hazard.where == "Write fwd_hopper.py:706 / Read fwd_hopper.py:599"
    assert hazard.warps == "warps 0,3 / 8-9"


@pytest.mark.parametrize("text, expected", [
    ("0x3c0 in /a/b/fwd_hopper.py:599:_fwd_hopper_kernel", ("_fwd_hopper_kernel",
                                                           "fwd_hopper.py:599")),
    ("_fwd_hopper_kernel+0x5f80 in /a/fwd_hopper.py:707", ("_fwd_hopper_kernel",
                                                          "fwd_hopper.py:707")),
    ("conv(float const*, int)+0x98 in k.cu:13", ("conv", "k.cu:13")),
    ("0x98 in _bwd_kernel", ("_bwd_kernel", "")),
])
def test_locations(text, expected):
    assert sanitizer_log.where(text) == expected


def test_verdicts():
    clean = sanitize.verdict("gluon-dense", "memcheck", MEMCHECK_CLEAN, CHILD, 0, 3.0)
    assert (clean.status, clean.verdict, clean.kernels) == ("clean", "clean",
                                                           ["_fwd_hopper_kernel"])
    racy = sanitize.verdict("gluon-dense", "racecheck", RACECHECK, CHILD, 0, 3.0)
    assert racy.status == "found" and racy.count == 3
    assert racy.verdict.startswith("3 hazards (2 errors, 1 warnings): _fwd_hopper_kernel: "
                                   "Write / Read fwd_hopper.py:706 / fwd_hopper.py:599 [12]")
    assert "RAW warps 0,3 / 8-9 [2]" in racy.verdict
    # the call died on memcheck's errors: both said
    crashed = sanitize.verdict("triton-causal", "memcheck", MEMCHECK_ERRORS,
                               "Traceback ...\nRuntimeError: CUDA error\n", 1, 3.0)
    assert crashed.status == "found" and crashed.verdict.startswith("3 errors: _fwd_kernel")
    assert "call failed (exit 1)" in crashed.verdict
    assert sanitize.verdict("x", "memcheck", "", "", None, 240.0).verdict \
        == "error: timed out after 240 s"
    missing = sanitize.verdict("x", "memcheck", "", "unrecognized option", 1, 1.0)
    assert missing.status == "error" and "no sanitizer summary" in missing.verdict
    skipped = sanitize.verdict("minimal", "racecheck", MEMCHECK_CLEAN,
                               CHILD.replace("null", '"no sm90"'), 0, 1.0)
    assert (skipped.status, skipped.verdict) == ("skipped", "skipped: no sm90")


def test_families():
    names = [f.name for f in sanitize.FAMILIES]
    assert len(names) == len(set(names)) and "minimal" in names
    assert all(f.expects and callable(f.run) for f in sanitize.FAMILIES)
    assert [f.name for f in sanitize.select_families("minimal,gluon-d*")] == \
        ["minimal", "gluon-dense", "gluon-d64", "gluon-d256"]
    with pytest.raises(ValueError, match="'nope' matches no family"):
        sanitize.select_families("nope")
    # `minimal` launches every variant of racecheck_minimal.py; `minimal-VARIANT` one alone
    minimal = _load("racecheck_minimal")
    assert tuple(sanitize.MINIMAL_KERNELS) == minimal.VARIANTS
    assert {v: k.fn.__name__ for v, k in minimal.KERNELS.items()} == sanitize.MINIMAL_KERNELS
    families = {f.name: f for f in sanitize.FAMILIES}
    assert families["minimal"].expects == tuple(sanitize.MINIMAL_KERNELS.values())
    assert [f.name for f in sanitize.select_families("minimal-*")] == \
        [f"minimal-{v}" for v in minimal.VARIANTS]
    assert families["minimal-forward"].expects == ("_ws_forward_kernel",)


HOST_SIDE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tools_sanitize", sys.argv[1])
sanitize = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sanitize
spec.loader.exec_module(sanitize)
sanitize.DEVICE, sanitize.SEQLEN, sanitize.TMA_SEQLEN = "cpu", 40, 32
for family in sanitize.FAMILIES:
    try:
        family.run()
        print("ran", family.name)
    except sanitize.Skip:
        print("skipped", family.name)
"""


def test_family_calls_are_valid():
    """Every family's call on CPU tensors, shorter (the exact reference, without the
    interpreter): attention accepts its arguments and its outputs and gradients are finite; `minimal` skips
    without an sm90 GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", HOST_SIDE, str(TOOLS / "sanitize.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("ran ")]
    assert ran == [f.name for f in sanitize.FAMILIES if not f.name.startswith("minimal")]


FAKE_SANITIZER = """\
#!{python}
# stands in for compute-sanitizer: canned logs per (tool, family), the child not run
import json, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("--tool --log-file --racecheck-report --show-backtrace --print-limit")
    sys.exit(0)
tool, log, family = args[args.index("--tool") + 1], args[args.index("--log-file") + 1], args[-1]
logs = {logs}
with open(log, "w") as f:
    f.write(logs.get(tool + "/" + family, logs["clean"]))
with open(log + ".args", "w") as f:
    f.write(" ".join(args))
print("sanitize-child: " + json.dumps(dict(family=family, kernels=["_k"], seconds=0.1,
                                           skipped=None)))
"""


def test_runs_each_family_and_tool_in_its_own_process(tmp_path):
    """With a stand-in sanitizer: a verdict per (family, tool), the summary, the logs, racecheck's
    report mode passed, and exit status 1 for memcheck errors."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable, logs=repr({
        "clean": MEMCHECK_CLEAN, "memcheck/gluon-dense": MEMCHECK_ERRORS,
        "racecheck/minimal": RACECHECK})))
    fake.chmod(0o755)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(TOOLS / "sanitize.py"), "--sanitizer", str(fake),
                          "--no-warm", "--families", "minimal,gluon-dense", "--jobs", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(re.match(r"minimal\s+racecheck\s+3\s+3 hazards", line) for line in lines)
    assert any(re.match(r"gluon-dense\s+memcheck\s+3\s+3 errors", line) for line in lines)
    assert "memcheck: 1 clean; 1 with errors (gluon-dense)" in run.stdout
    assert "racecheck: 1 clean; 1 with hazards (minimal)" in run.stdout
    assert "racecheck hazards by kernel: _fwd_hopper_kernel (minimal); _ws_bare_kernel " \
        "(minimal)" in run.stdout
    assert "--racecheck-report all" in (out / "minimal.racecheck.log.args").read_text()
    outcomes = json.loads((out / "summary.json").read_text())["outcomes"]
    assert len(outcomes) == 6 and {o["kernels"][0] for o in outcomes} == {"_k"}
    assert "fwd_hopper.py:706" in (out / "summary.txt").read_text()


def test_help_and_list():
    for flag in ("--help", "--list"):
        run = subprocess.run([sys.executable, str(TOOLS / "sanitize.py"), flag],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "gluon-dense" in run.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
def test_minimal_kernels_compile_for_sm90(tmp_path):
    """The minimal kernels compile for sm_90a without a GPU, and their PTX has the
    warp_specialize handover docs/sanitizer.md describes: CTA-wide `barrier.sync 1`; in `bare`
    no shared-memory access but the partition bytes (stored at the kernel's entry and exit,
    loaded by the workers); `captures` adds a stored / loaded capture; `smem` the ring's
    stores and loads; `tma` a TMA copy. The forward-shaped ones (regs, ring, ring_tma_store,
    forward) launch 384 threads with setmaxnreg 232 / 40 as `_fwd_hopper_kernel`; ring and
    after add wgmma and the 4-warp worker's own barrier; ring_tma_store and forward the
    epilogue's stmatrix and TMA store; forward captures nothing."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(TOOLS / "racecheck_minimal.py"), "--ptx",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    minimal = _load("racecheck_minimal")
    ptx = {v: (tmp_path / f"{v}.ptx").read_text() for v in minimal.VARIANTS}
    for variant, text in ptx.items():
        assert len(re.findall(r"\bbarrier\.sync\s+1;", text)) >= 4, variant
    accesses = {v: [op for _, op, _ in minimal.shared_accesses(text)] for v, text in ptx.items()}
    bytes_only = ["ld.shared.b8", "st.shared.b32", "st.shared.b32"]
    assert sorted(accesses["bare"]) == bytes_only
    assert len(accesses["captures"]) == 5
    assert accesses["smem"].count("st.shared.v4.b32") >= 1 \
        and accesses["smem"].count("ld.shared.v4.b32") >= 1
    assert "cp.async.bulk.tensor" in ptx["tma"] and "st.shared.v4" not in ptx["tma"]

    forward_shaped = ("regs", "ring", "ring_tma_store", "forward")
    for variant in forward_shaped:
        text = ptx[variant]
        assert ".reqntid 384" in text, variant
        budgets = set(re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", text))
        assert {"232", "40"} <= budgets, variant
    # the forward's partition bytes: one 8-byte store for warps 4-11 at entry and exit
    assert sorted(accesses["regs"]) == ["ld.shared.b8", "st.shared.v2.b32", "st.shared.v2.b32"]
    for variant in forward_shaped[1:]:
        text = ptx[variant]
        assert "wgmma.mma_async" in text and re.search(r"bar\.sync\s+2, 128;", text), variant
        assert "cp.async.bulk.tensor.2d.shared" in text, variant  # the producer's loads
        tma_store = variant != "ring"
        assert ("cp.async.bulk.tensor.2d.global.shared" in text) == tma_store, variant
        assert any(op.startswith("stmatrix") for op in accesses[variant]) == tma_store, variant
    # ring's captured round count: stored once, loaded by each worker
    assert len([op for op in accesses["ring"] if op.startswith("ld.shared")]) == 3
    assert sorted(op for op in accesses["forward"] if not op.startswith("stmatrix")) == \
        ["ld.shared.b8", "st.shared.v2.b32", "st.shared.v2.b32"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
def test_minimal_kernels_match_their_reference():
    minimal = _load("racecheck_minimal")
    for variant in minimal.VARIANTS:
        minimal.run(variant)
