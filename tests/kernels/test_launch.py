"""kernels.launch: the compiled kernel of an earlier launch is reused only where Triton would
pick the same one."""
import pytest
import torch
import triton
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from omniattn.runtime import launch as launch_module
from omniattn.runtime.launch import arguments_key, launch

GPU = torch.cuda.is_available()


@triton.jit
def _scaled_copy_kernel(src, dst, n, scale, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=keep) * scale + SHIFT, mask=keep)


def test_key_tells_apart_what_triton_specialises():
    storage = torch.zeros(64, dtype=torch.float16)
    aligned, misaligned = storage[:32], storage[1:33]  # 2 bytes apart
    key = arguments_key((aligned, 17, 0.5, None))
    assert key == arguments_key((storage[8:40], 17, 0.5, None))  # 16 bytes apart: same kernel
    for other in ((misaligned, 17, 0.5, None), (aligned.float(), 17, 0.5, None),
                  (aligned, 1, 0.5, None), (aligned, 16, 0.5, None), (aligned, 17, 0.5, aligned),
                  (aligned, 17.0, 0.5, None), (aligned, 17, 0.5, False)):
        assert arguments_key(other) != key, other
    assert arguments_key((True,)) != arguments_key((1,)) != arguments_key((1.0,))
    # grouped arguments: each leaf keyed as an argument of its own
    assert arguments_key(((17, 1),)) == arguments_key(((17, 1),))
    for other in (((17, True),), ((17, 16),), ((17.0, 1),), ((17, (1,)),), (17, 1)):
        assert arguments_key(other) != arguments_key(((17, 1),)), other
    assert arguments_key(((aligned, 1),)) == arguments_key(((storage[8:40], 1),))
    assert arguments_key(((aligned, 1),)) != arguments_key(((misaligned, 1),))
    parameter = torch.nn.Parameter(aligned.clone())
    assert arguments_key((parameter,)) != arguments_key((parameter.detach(),))


@pytest.mark.parametrize("descriptor_type", [TensorDescriptor, GluonTensorDescriptor])
def test_key_of_descriptors(descriptor_type):
    storage = torch.zeros(65 * 64, dtype=torch.float16)
    tensor = storage[:4096].view(64, 64)

    def key(base, block):
        desc = object.__new__(descriptor_type)
        desc.base, desc.shape, desc.strides = base, list(base.shape), list(base.stride())
        desc.block_shape, desc.padding, desc.layout = list(block), "zero", None
        return arguments_key((desc,))

    assert key(tensor, (16, 64)) == key(tensor.clone(), (16, 64))
    assert key(tensor, (16, 64)) != key(tensor, (32, 64))
    assert key(tensor, (16, 64)) != key(tensor[:32], (16, 64))
    assert key(tensor, (16, 64)) != key(storage[1:4097].view(64, 64), (16, 64))


def test_unhashable_arguments_are_not_cached():
    with pytest.raises(launch_module._Uncacheable):
        arguments_key((torch.zeros(2), [1, 2]))


def test_empty_hook_chains_are_no_hooks():
    chain = knobs.HookChain()
    assert launch_module._no_hook(None) and launch_module._no_hook(chain)
    chain.add(print)
    assert not launch_module._no_hook(chain) and not launch_module._no_hook(print)


def _run_copy(src, n, scale, **constexprs):
    dst = torch.full_like(src, float("nan"))
    launch(_scaled_copy_kernel, (triton.cdiv(max(n, 1), 64),), src, dst, n, scale, BLOCK=64,
           **constexprs)
    return dst


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="interpreter case runs where there is no GPU")
def test_launch_under_the_interpreter():
    src = torch.randn(100)
    torch.testing.assert_close(_run_copy(src, 100, 2.0, SHIFT=1), src * 2 + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_launches_reuse_only_matching_kernels(monkeypatch):
    """Launches alternate between keys (alignment, an int equal to 1, a constexpr, the scalar);
    each result is checked, and Triton's run compiles or picks a kernel once per key."""
    runs = []
    run = type(_scaled_copy_kernel).run
    monkeypatch.setattr(type(_scaled_copy_kernel), "run",
                        lambda self, *a, **kw: runs.append(1) or run(self, *a, **kw))
    monkeypatch.setattr(launch_module, "_compiled", {})
    storage = torch.randn(4096 + 8, device="cuda", dtype=torch.float16)
    cases = [(storage[:4096], 4096, 2.0, {}), (storage[1:4097], 4096, 2.0, {}),
             (storage[:1], 1, 2.0, {}), (storage[:4096], 4096, 2.0, {"SHIFT": 3}),
             (storage[:4096], 4096, 0.5, {})]
    for repeat in range(3):
        for src, n, scale, constexprs in cases:
            expected = src.float() * scale + constexprs.get("SHIFT", 0)
            torch.testing.assert_close(_run_copy(src, n, scale, **constexprs).float(), expected,
                                       rtol=1e-3, atol=1e-3)
        assert len(runs) == len(cases), repeat
    assert len(launch_module._compiled[id(_scaled_copy_kernel)]) == len(cases)
    # a profiler's hook sees every launch: those go through Triton's run
    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        src, n, scale, _ = cases[0]
        torch.testing.assert_close(_run_copy(src, n, scale), src * scale)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert names == ["_scaled_copy_kernel"] and len(runs) == len(cases) + 1


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_cache_keeps_the_newest_entries(monkeypatch):
    """Scalars that change every launch (dropout seeds) miss every time: the oldest entries
    go, results stay right."""
    monkeypatch.setattr(launch_module, "_compiled", {})
    monkeypatch.setattr(launch_module, "MAX_ENTRIES_PER_KERNEL", 3)
    src = torch.randn(300, device="cuda")
    for scale in (1.0, 2.0, 3.0, 4.0, 5.0, 4.0):
        torch.testing.assert_close(_run_copy(src, 300, scale), src * scale)
    entries = launch_module._compiled[id(_scaled_copy_kernel)]
    assert [key[3][1][3] for key in entries] == [3.0, 4.0, 5.0]
