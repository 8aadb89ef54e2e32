"""Call plans: a replayed call gives what the call itself gives, bit for bit, and only calls
with the recorded signature replay."""
import functools
import gc
import weakref

import pytest
import torch
from triton import knobs

import omniattn
from omniattn import api
from omniattn.runtime import call_plans

GPU = torch.cuda.is_available()


def _inputs(seqlen, heads, heads_k, head_dim, dtype=torch.bfloat16, mask=None, bias=None):
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    q, k, v = randn(2, seqlen, heads, head_dim), randn(2, seqlen, heads_k, head_dim), \
        randn(2, seqlen, heads_k, head_dim)
    extra = {}
    if mask is not None:
        extra["attn_mask"] = torch.rand(*mask(seqlen), device="cuda") > 0.4
    if bias is not None:
        extra["attn_bias"] = randn(*bias(seqlen))
    return q, k, v, extra


CASES = {
    "causal": dict(heads=4, heads_k=4, head_dim=128, options=dict(causal=True)),
    "gqa_window_lse": dict(heads=4, heads_k=2, head_dim=64,
                           options=dict(window=(40, 7), return_lse=True)),
    "softcap_d256": dict(heads=2, heads_k=2, head_dim=256, options=dict(softcap=20.0)),
    "mask_key_bias": dict(heads=4, heads_k=4, head_dim=128, options=dict(causal=True),
                          mask=lambda s: (2, 4, s, s), bias=lambda s: (2, 4, 1, s)),
    "mask_full_bias_lse": dict(heads=4, heads_k=2, head_dim=128,
                               options=dict(return_lse=True), mask=lambda s: (2, 1, s, s),
                               bias=lambda s: (2, 4, s, s)),
    "query_mask": dict(heads=2, heads_k=2, head_dim=64, options={}, mask=lambda s: (2, 1, s, 1)),
}


def _replays(monkeypatch) -> list:
    """Records each call's path: 'plan' where a plan replayed it."""
    paths = []
    replay = call_plans._Plan.replay
    monkeypatch.setattr(call_plans._Plan, "replay",
                        lambda self, inputs: paths.append("plan") or replay(self, inputs))
    return paths


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seqlen", [113, 256])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_replayed_calls_match_the_calls(monkeypatch, name, seqlen):
    case = CASES[name]
    paths = _replays(monkeypatch)
    for call in range(5):
        q, k, v, extra = _inputs(seqlen, case["heads"], case["heads_k"], case["head_dim"],
                                 mask=case.get("mask"), bias=case.get("bias"))
        with torch.no_grad():
            got = omniattn.attention(q, k, v, **case["options"], **extra)
        expected = api._attention(q, k, v, case["options"].get("causal", False),
                                  case["options"].get("window"), None,
                                  case["options"].get("softcap", 0.0), extra.get("attn_mask"),
                                  extra.get("attn_bias"), None, None, None, None, None, None, 0.0,
                                  False, case["options"].get("return_lse", False), True)
        for g, e in zip(got if isinstance(got, tuple) else (got,),
                        expected if isinstance(expected, tuple) else (expected,)):
            assert torch.equal(g, e), (name, call)
        # the first call runs, the second is recorded, the later ones replay
        assert paths == ["plan"] * max(call - 1, 0), (name, call)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_plans_follow_storage_sharing_and_alignment(monkeypatch):
    """q, k, v as views of one projection replay with another projection's views; separate
    tensors, or a misaligned q, are other signatures."""
    paths = _replays(monkeypatch)

    def packed():
        qkv = torch.randn(1, 200, 3, 2, 64, device="cuda", dtype=torch.float16)
        return qkv.unbind(2)

    def call(q, k, v):
        with torch.no_grad():
            out = omniattn.attention(q, k, v, causal=True)
        expected = api._attention(q, k, v, True, None, None, 0.0, None, None, None, None, None,
                                  None, None, None, 0.0, False, False, True)
        assert torch.equal(out, expected)

    for _ in range(3):
        call(*packed())
    assert paths == ["plan"]
    separate = [t.clone() for t in packed()]  # same shapes, other strides and storages
    for _ in range(3):
        call(*separate)
    assert paths == ["plan"] * 2
    storage = torch.randn(200 * 2 * 64 + 1, device="cuda", dtype=torch.float16)
    misaligned = storage[1:].view(1, 200, 2, 64)
    for _ in range(3):
        call(misaligned, separate[1], separate[2])
    assert paths == ["plan"] * 3
    assert len([p for p in call_plans._plans.values() if isinstance(p, call_plans._Plan)]) == 3


TRAINING_CASES = {
    **CASES,
    "gqa_shared_full_bias": dict(heads=4, heads_k=2, head_dim=64, options={},
                                 bias=lambda s: (1, 2, s, s)),
    "deterministic_causal": dict(heads=2, heads_k=2, head_dim=128,
                                 options=dict(causal=True, deterministic=True)),
}
# forwards that are not planned (host work reading values): their backward still is
UNPLANNED_FORWARDS = {
    "block_mask": lambda s: dict(block_mask=omniattn.masks.window_block_mask(
        s, s, (70, 0), block_size=64, device="cuda")),
    "row_lengths": lambda s: dict(seqlens_k_per_row=torch.randint(
        0, s + 1, (2, s), device="cuda", dtype=torch.int32)),
}


def _training_step(q, k, v, extra, options, dout, dlse):
    """(out, lse or None, dq, dk, dv, dbias or None) of one call and its backward."""
    leaves = [q, k, v] + ([extra["attn_bias"]] if "attn_bias" in extra else [])
    result = omniattn.attention(q, k, v, **options, **extra)
    out, lse = result if isinstance(result, tuple) else (result, None)
    loss = (out.float() * dout).sum() + ((lse * dlse).sum() if lse is not None else 0)
    grads = torch.autograd.grad(loss, leaves)
    return out, lse, *grads, *([None] * (4 - len(grads)))


@pytest.mark.parametrize("name", [*TRAINING_CASES, *UNPLANNED_FORWARDS])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_replayed_training_steps_match_the_calls(monkeypatch, name):
    """Forward (with its graph) and backward replayed from plans give what the calls give with
    plans off: bitwise, but for gradients summed by atomics (the Gluon backward's dQ, sums
    over keys), whose order varies run to run."""
    case = TRAINING_CASES.get(name, dict(heads=4, heads_k=2, head_dim=64,
                                         options=dict(causal=True)))
    paths = _replays(monkeypatch)
    seqlen = 200
    atomics = not case["options"].get("deterministic") and case["head_dim"] == 128
    for call in range(5):
        q, k, v, extra = _inputs(seqlen, case["heads"], case["heads_k"], case["head_dim"],
                                 mask=case.get("mask"), bias=case.get("bias"))
        extra.update(UNPLANNED_FORWARDS[name](seqlen) if name in UNPLANNED_FORWARDS else {})
        for t in (q, k, v, extra.get("attn_bias")):
            if t is not None:
                t.requires_grad_()
        dout = torch.randn(q.shape, device="cuda")
        dlse = torch.randn(2, case["heads"], seqlen, device="cuda")
        got = _training_step(q, k, v, extra, case["options"], dout, dlse)
        monkeypatch.setenv("OMNIATTN_CALL_PLANS", "0")
        expected = _training_step(q, k, v, extra, case["options"], dout, dlse)
        monkeypatch.delenv("OMNIATTN_CALL_PLANS")
        for label, g, e in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, expected):
            if e is None:
                assert g is None, (name, call, label)
            elif atomics and label in ("dq", "dbias"):
                torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2, msg=(name, call, label))
            else:
                assert torch.equal(g, e), (name, call, label)
        # forward and backward: the first call runs, the second is recorded, the later replay
        replays_per_call = 1 if name in UNPLANNED_FORWARDS else 2
        assert paths == ["plan"] * replays_per_call * max(call - 1, 0), (name, call)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_backward_plans_tell_apart_what_the_forward_key_does_not(monkeypatch):
    """A planned forward's backward is keyed on the forward's key and what is new beside it:
    dout's layout (contiguous, strided, or a view into the bias's storage) and whether the bias
    is learned. Four forms of one forward signature, interleaved after the form whose dout
    shares the bias's storage was recorded (a plan that located the bias from dout would give
    the others wrong pointers): each gets a backward key of its own, and every call gives what
    it gives with plans off."""
    q, k, v, extra = _inputs(200, 2, 2, 64, bias=lambda s: (2, 2, 1, s))
    q.requires_grad_()
    bias_size = extra["attn_bias"].numel()
    storage = torch.randn(bias_size + q.numel(), device="cuda", dtype=torch.bfloat16)
    biases = {False: extra["attn_bias"], True: storage[:bias_size].view(2, 2, 1, 200)}
    douts = {"contiguous": torch.randn_like(q),
             "strided": torch.randn(2, 2, 200, 64, device="cuda",
                                    dtype=torch.bfloat16).transpose(1, 2),
             "in the bias's storage": storage[bias_size:].view(q.shape)}
    forms = [("in the bias's storage", True), ("contiguous", True), ("strided", True),
             ("contiguous", False)]

    def step(dout_name, learned):
        bias = biases[dout_name == "in the bias's storage"].detach().requires_grad_(learned)
        out = omniattn.attention(q, k, v, causal=True, attn_bias=bias)
        return (out, *torch.autograd.grad(out, [q, bias] if learned else [q], douts[dout_name]))

    paths = _replays(monkeypatch)
    step(*forms[0])
    step(*forms[0])  # recorded: dout and the bias in one storage
    for call in range(3):
        for form in forms:
            got = step(*form)
            monkeypatch.setenv("OMNIATTN_CALL_PLANS", "0")
            expected = step(*form)
            monkeypatch.delenv("OMNIATTN_CALL_PLANS")
            for g, e in zip(got, expected):
                assert torch.equal(g, e), (call, form)
    backward_keys = [key for key in call_plans._plans if isinstance(key[0], tuple)]
    assert len(backward_keys) == len(forms)
    assert all(isinstance(call_plans._plans[key], call_plans._Plan) for key in backward_keys)
    # forwards: 14 calls, 12 replayed; backwards: the first form's 5 calls, 3 replayed, and
    # the other forms' 3 calls, 1 replayed each
    assert len(paths) == 12 + 3 + 3 * 1


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_replayed_packed_calls_match_the_calls(monkeypatch, head_dim):
    """Packed sequences, unchecked with their maxima given, are planned with cu_seqlens as
    inputs: replays with other offsets (same batch and maxima) give what the calls give with
    plans off. Checked calls read the offsets on the host: never planned."""
    paths = _replays(monkeypatch)
    total, heads, heads_k = 300, 4, 2
    for call, lengths in enumerate(([100, 150, 50], [7, 200, 93], [0, 120, 180], [200, 1, 99],
                                    [150, 150, 0])):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                          dtype=torch.int32)
        q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(total, heads_k, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        dout = torch.randn_like(q)
        results = []
        for plans in ("1", "0"):
            monkeypatch.setenv("OMNIATTN_CALL_PLANS", plans)
            out, lse = omniattn.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=200, max_seqlen_k=200, return_lse=True,
                                          check_inputs=False)
            results.append((out, lse, *torch.autograd.grad(out, leaves, dout)))
        for label, g, e in zip(("out", "lse", "dq", "dk", "dv"), *results):
            if label == "dq" and head_dim == 128:  # the Gluon backward's atomics
                torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2, msg=(call, label))
            else:
                assert torch.equal(g, e), (head_dim, call, label)
        # forward and backward: the first call runs, the second is recorded, the later replay
        assert paths == ["plan"] * 2 * max(call - 1, 0), (head_dim, call)
    monkeypatch.delenv("OMNIATTN_CALL_PLANS")
    with torch.no_grad():
        for _ in range(3):
            omniattn.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=200, max_seqlen_k=200)
    assert paths == ["plan"] * 6


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_replays_encode_each_descriptor_for_its_own_pointers(monkeypatch):
    """Replays alternating between three sets of inputs (other pointers each call) give each
    call its own tensor maps: kept per pointer (fewer encodes), or encoded again each time when
    one map per descriptor is kept; both match the calls without plans."""
    from omniattn.runtime import launch as launch_module

    encodes = []
    encode = launch_module.make_tensordesc_arg
    monkeypatch.setattr(launch_module, "make_tensordesc_arg",
                        lambda *args: encodes.append(1) or encode(*args))
    sets = [_inputs(256, 4, 4, 128)[:3] for _ in range(3)]
    monkeypatch.setenv("OMNIATTN_CALL_PLANS", "0")
    with torch.no_grad():
        expected = [omniattn.attention(*qkv, causal=True) for qkv in sets]
    monkeypatch.delenv("OMNIATTN_CALL_PLANS")
    paths = _replays(monkeypatch)
    counts = {}
    for maps_kept in (64, 1):
        monkeypatch.setattr(launch_module, "MAX_TENSOR_MAPS_PER_DESCRIPTOR", maps_kept)
        call_plans.clear()
        encodes.clear()
        for call in range(12):
            with torch.no_grad():
                out = omniattn.attention(*sets[call % 3], causal=True)
            assert torch.equal(out, expected[call % 3]), (maps_kept, call)
        counts[maps_kept] = len(encodes)
    assert paths == ["plan"] * 20
    assert 0 < counts[64] < counts[1], counts


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_no_plans_under_launch_hooks_or_the_switch(monkeypatch):
    paths = _replays(monkeypatch)
    q, k, v, _ = _inputs(128, 2, 2, 64)
    with torch.no_grad():
        for _ in range(3):
            omniattn.attention(q, k, v)
    assert paths == ["plan"]
    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    q.requires_grad_()
    try:
        with torch.no_grad():
            omniattn.attention(q, k, v)
        for _ in range(3):  # launches under a hook go past the cache: no plan
            omniattn.attention(q, k, v).sum().backward()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert paths == ["plan"] and len(names) >= 7, names
    monkeypatch.setenv("OMNIATTN_CALL_PLANS", "0")
    q.requires_grad_(False)
    with torch.no_grad():
        for _ in range(3):
            omniattn.attention(q, k, v)  # the planned signature, now run as it is
    assert paths == ["plan"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_plans_keep_no_tensor_of_their_calls_alive():
    refs = []
    for _ in range(4):
        q, k, v, extra = _inputs(256, 2, 2, 128, mask=lambda s: (2, 2, s, s),
                                 bias=lambda s: (2, 2, 1, s))
        with torch.no_grad():
            out = omniattn.attention(q, k, v, causal=True, **extra)
        refs += [weakref.ref(t) for t in (q, k, v, out, *extra.values())]
        del q, k, v, extra, out
    gc.collect()
    assert any(isinstance(p, call_plans._Plan) for p in call_plans._plans.values())
    assert all(ref() is None for ref in refs)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_a_plan_never_skips_validation():
    """Options that hash alike (True and 1) are other signatures: validation still refuses."""
    q, k, v, _ = _inputs(64, 2, 2, 64)
    with torch.no_grad():
        for _ in range(3):
            omniattn.attention(q, k, v, causal=True, window=(1, 0))
        with pytest.raises(TypeError, match="causal must be a bool"):
            omniattn.attention(q, k, v, causal=1, window=(1, 0))
        with pytest.raises(TypeError, match="window must be"):
            omniattn.attention(q, k, v, causal=True, window=(True, 0))


def test_no_signature_off_the_gpu():
    """CPU tensors (the reference path, or the kernels under the interpreter) are never
    planned."""
    q = torch.randn(1, 16, 2, 16)
    assert call_plans.signature((q, q, q, None, None), (False,)) is None


class _FakeKernel:
    """Stands for a JITFunction: its compiled kernel's launcher records the arguments it gets
    (tensors as data pointers), so the test runs without a GPU."""

    class _Param:
        def __init__(self, name, default=None):
            self.name, self.default = name, default

    params = [_Param("src"), _Param("dst"), _Param("counts"), _Param("n"), _Param("BLOCK", 16)]
    used_global_vals = {}

    def __init__(self):
        self.launched = []
        kernel = self

        def record(leading, *args):
            kernel.launched.append([a.data_ptr() if isinstance(a, torch.Tensor) else a
                                    for a in args[leading:]])

        class CudaLauncher:  # Triton's, for a kernel without descriptors
            launch_cooperative_grid = launch_pdl = False
            num_ctas = 1
            global_scratch_size = profile_scratch_size = 0
            # the launcher module's function (13 arguments before the kernel's), code-less as a
            # compiled one is
            launch = functools.partial(record, 13)

            def __call__(self, *args):  # the launcher itself (9 arguments before the kernel's)
                record(9, *args)

        class Compiled:
            function = packed_metadata = None
            run = CudaLauncher()

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append([a.data_ptr() if isinstance(a, torch.Tensor) else a
                                  for a in args] + [kwargs.get("BLOCK", 16)])
            return self.compiled
        return launch


@pytest.fixture
def fake_kernel(monkeypatch):
    """A stand-in kernel, launched through `kernels.launch` as on a GPU."""
    import types

    from omniattn.runtime import launch as launch_module

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_stream=lambda device: 0)))
    monkeypatch.setattr(launch_module, "_compiled", {})
    return _FakeKernel()


def test_recorded_launches_point_into_each_calls_tensors(fake_kernel):
    """Record (second call) and replay (later calls) on the CPU with a stand-in kernel: every
    pointer a replay passes is the one the call itself would pass, at the same offsets into
    its inputs and its own (fresh, zeroed where the call zeroed) buffers."""
    from omniattn.runtime.launch import launch

    kernel = fake_kernel
    buffers = []

    def call(x):
        out = torch.empty_like(x)
        counts = torch.zeros(4, dtype=torch.int32)
        buffers.append((out, counts))
        launch(kernel, (2,), x[1:], out.view(-1)[2:], counts, 7, BLOCK=32)
        return out

    def expected(x, out, counts):
        return [x.data_ptr() + 4, out.data_ptr() + 8, counts.data_ptr(), 7, 32]

    for i in range(5):
        x = torch.randn(10)
        out = call_plans.run(("key",), (x,), lambda: call(x))
        if i < 2:  # the call itself: the first through Triton's run, the second recorded
            assert kernel.launched[-1] == expected(x, *buffers[-1])
        else:
            assert isinstance(call_plans._plans[("key",)], call_plans._Plan)
            counts_pointer = kernel.launched[-1][2]
            assert kernel.launched[-1] == [x.data_ptr() + 4, out.data_ptr() + 8,
                                           counts_pointer, 7, 32]
            assert out.shape == x.shape and len(buffers) == 2  # call() did not run
    plan = call_plans._plans[("key",)]
    assert [step[-1] for step in plan.steps if step[0] == call_plans._ALLOCATE] == [False, True]


def test_calls_that_compute_with_torch_are_not_replayed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = []

    def call(x):
        calls.append(1)
        return x + 1

    x = torch.randn(3)
    for _ in range(4):
        torch.testing.assert_close(call_plans.run(("sum",), (x,), lambda: call(x)), x + 1)
    assert len(calls) == 4 and call_plans._plans[("sum",)] is call_plans._NOT_REPLAYABLE


def test_replayed_operations_and_structured_results(fake_kernel):
    """A call that copies, sums and casts between launches and returns a structure (an input
    itself, a view of its own buffer, a constant list): a replay repeats the operations on the
    new call's tensors in their place and rebuilds the structure."""
    from omniattn.runtime.launch import launch

    calls = []

    def call(x):
        calls.append(x)
        staged = torch.empty(6)
        launch(fake_kernel, (1,), x, staged, 1, BLOCK=16)
        staged.copy_(x[2:8])
        row_sums = staged.view(2, 3).sum(1).to(torch.float64)
        launch(fake_kernel, (1,), row_sums, staged, 2, BLOCK=16)
        return x, (row_sums, staged[1:3]), [4, 5]

    for i in range(4):
        x = torch.randn(10)
        same, (row_sums, middle), constant = call_plans.run(("ops",), (x,), lambda: call(x))
        assert same is x and constant == [4, 5]
        assert torch.equal(row_sums, x[2:8].view(2, 3).sum(1).double())
        assert torch.equal(middle, x[3:5])
        assert fake_kernel.launched[-1][:3] == [row_sums.data_ptr(), middle.data_ptr() - 4, 2]
    assert len(calls) == 2  # the later calls replayed
    plan = call_plans._plans[("ops",)]
    assert [step[0] for step in plan.steps] == [
        call_plans._ALLOCATE, call_plans._LAUNCH, *[call_plans._OPERATE] * 3, call_plans._LAUNCH]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "fwd+bwd"])
def test_row_lengths_calls_replay_once_checked(monkeypatch, grad):
    """Per-row key lengths (alone: rows in length order) are read on the host by their first
    call's range check; later calls with the same unchanged lengths replay a plan, with the
    call's own results; an in-place change reads them again."""
    paths = _replays(monkeypatch)
    lens = torch.randint(0, 301, (2, 300), device="cuda", dtype=torch.int32)
    for call in range(5):
        q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=grad) for _ in range(3))
        out = omniattn.attention(q, k, v, seqlens_k_per_row=lens)
        expected = api._attention(q, k, v, False, None, None, 0.0, None, None, None, lens, None,
                                  None, None, None, 0.0, False, False, True)
        assert torch.equal(out, expected), call
        if grad:
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), dout)
            want = torch.autograd.grad(expected, (q, k, v), dout)
            # the Gluon backward sums dQ by atomics, in no fixed order
            torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2, msg=str(call))
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), call
    # the first call checks the lengths, the second is seen, the third recorded, the later
    # ones replay
    assert paths.count("plan") >= 2, paths
    lens[0, 0] = 301
    with pytest.raises(ValueError, match="seqlens_k_per_row must lie in"):
        omniattn.attention(q, k, v, seqlens_k_per_row=lens)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("paged", [False, True])
def test_decode_calls_replay(monkeypatch, paged):
    """Split-KV decoding, unchecked (nothing read on the host): the third call on replays its
    allocations and both launches, bit for bit."""
    paths = _replays(monkeypatch)
    for call in range(5):
        q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(64, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        used = torch.randint(1, 4097, (4,), device="cuda", dtype=torch.int32)
        table = torch.randperm(64, device="cuda").view(4, 16).int() if paged else None
        if not paged:
            k, v = k.view(4, 4096, 8, 128), v.view(4, 4096, 8, 128)
        options = dict(causal=True, block_table=table, seqused_k=used, check_inputs=False)
        with torch.no_grad():
            got = omniattn.attention(q, k, v, return_lse=True, **options)
        expected = api._attention(q, k, v, True, None, None, 0.0, None, None, None, None, None,
                                  None, None, None, 0.0, False, True, False, block_table=table,
                                  seqused_k=used)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), call
        assert paths == ["plan"] * max(call - 1, 0), call


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_topk_decode_calls_replay(monkeypatch):
    """A top-k decode step (key bias as the scores, GQA, the split select): the third call of a
    signature on replays its select and decode launches, bit for bit with the call itself; a
    call of other keys or another topk runs its own way first."""
    paths = _replays(monkeypatch)

    def step(seqlen, topk):
        q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        bias = torch.randn(2, 8, 1, seqlen, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = omniattn.attention(q, k, v, attn_bias=bias, topk=topk, return_lse=True)
        expected = api._attention(q, k, v, False, None, None, 0.0, None, bias, None, None, None,
                                  None, None, None, 0.0, False, True, True, topk=topk)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), (seqlen, topk)

    for call in range(4):
        step(8192, 512)
        assert paths == ["plan"] * max(call - 1, 0), call
    step(8000, 512)
    step(8192, 256)
    assert paths == ["plan"] * 2
