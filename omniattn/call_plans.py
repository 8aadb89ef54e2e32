"""Call plans: forward calls that record no graph, replayed per call signature.

The Python of a call (validation, tile configs, schedule views, descriptors, launch arguments)
depends only on its signature: the inputs' shapes, strides, dtypes, devices and alignment, and
the options. A plan records, on the second call of a signature, what the call did on the device:
its allocations (empty or zeroed) and its launches, each tensor argument located in an input,
an allocation of the call or a tensor cached outside it. Later calls with the signature replay
it: the allocations, then each compiled kernel's launcher with the new pointers (H100 host,
top-k mask + key bias forward, B1 S512 H2: 134-143 us per call against 342-392; causal D64
forward 52-62 against 149-162; benchmarks/NOTES.md). Calls with block masks, per-row lengths,
packed sequences or dropout (whose host work reads values or draws a seed) are not planned.

A call is recorded under a TorchDispatchMode that lets through only allocations and views: a
call that computes anything else with torch, or launches a kernel past `kernels.launch`'s cache,
is marked as not replayable and keeps the ordinary path.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs

from .kernels import launch as launch_module
from .kernels.configs import gluon_enabled, interpreting, switch_on, tma_enabled
from .kernels.sequences import descriptor_workspace

aten = torch.ops.aten
_EMPTY = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
          aten.empty_strided.default}
_ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}
# plans kept; the oldest goes first
MAX_PLANS = 128
_SEEN, _NOT_REPLAYABLE = object(), object()
_plans: dict[tuple, object] = {}


def plans_enabled() -> bool:
    """OMNIATTN_CALL_PLANS=0 runs every call through the ordinary path (the A/B switch)."""
    return switch_on("OMNIATTN_CALL_PLANS")


def clear() -> None:
    """Forget every plan (tests that patch configs or kernels call this)."""
    _plans.clear()


def _tensor_key(t: torch.Tensor | None):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _typed(value):
    """value with the type of every element beside it: True and 1 (which hash alike) apart, as
    validation tells them apart."""
    if type(value) is tuple:
        return tuple(_typed(element) for element in value)
    return type(value), value


def signature(inputs: tuple, options: tuple) -> tuple | None:
    """The key of an eager call that records no graph, every input a plain tensor on a GPU:
    shapes, strides, dtypes, devices, 16-byte alignment, which inputs share a storage and where
    (views of one qkv projection), the options and the switches that change the path. None for
    other calls."""
    if interpreting() or torch.compiler.is_compiling() \
            or torch._C._are_functorch_transforms_active() or not plans_enabled():
        return None
    storages = {}
    sharing = []
    for t in inputs:
        if t is None:
            sharing.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_cuda:
            return None
        if t.requires_grad and torch.is_grad_enabled():  # a graph to record
            return None
        base = t.untyped_storage().data_ptr()
        first = storages.setdefault(base, (len(sharing), t.data_ptr()))
        sharing.append((first[0], t.data_ptr() - first[1]))
    try:
        key = (torch.cuda.current_device(), gluon_enabled(), tma_enabled(inputs[0].device),
               knobs.runtime.debug, tuple(sharing),
               tuple(_tensor_key(t) for t in inputs),
               _typed(options))
        hash(key)
    except TypeError:  # an option of a type validation will refuse
        return None
    return key


class _Recorder(TorchDispatchMode):
    """Allocations (zeroed or not) in call order; any other torch computation spoils the plan."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self.allocations: list[torch.Tensor] = []
        self.replayable = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if launch_module.inside_launch():  # a launcher's own workspace
            return out
        if func in _EMPTY or func in _ZEROS:
            self.events.append((tuple(out.shape), out.stride(), out.dtype, out.device,
                                func in _ZEROS))
            self.allocations.append(out)
        elif not func.is_view:
            self.replayable = False
        return out


class _Base:
    """The base of a rebuilt descriptor: all Triton's launcher reads of it is the pointer."""
    __slots__ = ("pointer", "dtype")

    def __init__(self, pointer: int, dtype: torch.dtype):
        self.pointer, self.dtype = pointer, dtype

    def data_ptr(self) -> int:
        return self.pointer


class _Plan:
    """Allocations, then launches with each tensor argument located (see `locate`)."""

    def __init__(self, recorder: _Recorder, inputs: tuple, launches: list):
        self.keep_alive = []  # tensors cached outside the call that launches point into
        self._inputs, self._allocations = inputs, recorder.allocations
        self._owners = {t.untyped_storage().data_ptr(): ("alloc", i)
                        for i, t in enumerate(recorder.allocations)}
        for i, t in reversed(list(enumerate(inputs))):  # the first input of a shared storage
            if t is not None:
                self._owners[t.untyped_storage().data_ptr()] = ("input", i)
        self.allocations = recorder.events  # (shape, strides, dtype, device, zeroed)
        self.launches = [(compiled, grid, *self._templates(args), tail)
                         for compiled, grid, args, tail in launches]

    def locate(self, t: torch.Tensor) -> tuple:
        """(kind, index, where) of a tensor: at a byte offset from an input's data pointer, an
        allocation of the call itself or a view of one (storage offset, shape, strides, dtype),
        or a tensor cached outside the call (kept alive, its pointer fixed)."""
        kind, index = self._owners.get(t.untyped_storage().data_ptr(), ("pointer", None))
        if kind == "input":
            return (kind, index, t.data_ptr() - self._inputs[index].data_ptr())
        if kind == "pointer":
            self.keep_alive.append(t)
            return (kind, t.data_ptr(), None)
        base = self._allocations[index]
        if (t.data_ptr(), t.shape, t.stride(), t.dtype) == \
                (base.data_ptr(), base.shape, base.stride(), base.dtype):
            return ("alloc", index, None)
        return ("alloc_view", index, (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype))

    def _templates(self, args: tuple) -> tuple[list, list, list]:
        """(fixed arguments, [(position, location)] of tensor pointers, [(position, location of
        the base, (type, fields but the base, base dtype))] of tensor descriptors)."""
        fixed, pointers, descriptors = list(args), [], []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                pointers.append((position, self.locate(arg)))
                fixed[position] = None
            elif isinstance(arg, launch_module._DESCRIPTORS):
                # its fields but the base: the plan keeps no tensor of the recorded call alive
                fields = {name: value for name, value in vars(arg).items() if name != "base"}
                descriptors.append((position, self.locate(arg.base),
                                    (type(arg), fields, arg.base.dtype)))
                fixed[position] = None
        return fixed, pointers, descriptors

    def finish(self, outputs: tuple) -> bool:
        """Locates the call's outputs; False where one is not an allocation of the call (or a
        view of one in its dtype)."""
        self.outputs = tuple(self.locate(t) for t in outputs)
        del self._inputs, self._allocations, self._owners
        return all(kind == "alloc" or (kind == "alloc_view" and where[3] == self.allocations[
            index][2]) for kind, index, where in self.outputs)

    def replay(self, inputs: tuple) -> tuple:
        allocations = []
        for shape, stride, dtype, device, zero in self.allocations:
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            allocations.append(t.zero_() if zero else t)
        stream = launch_module.driver.active.get_current_stream(torch.cuda.current_device())
        with descriptor_workspace():
            self._launch(inputs, allocations, stream)
        return tuple(_output(location, allocations) for location in self.outputs)

    def _launch(self, inputs: tuple, allocations: list, stream: int) -> None:
        for compiled, grid, fixed, pointers, descriptors, tail in self.launches:
            args = list(fixed)
            for position, location in pointers:
                args[position] = _pointer(location, inputs, allocations)
            for position, location, (descriptor_type, fields, dtype) in descriptors:
                rebuilt = object.__new__(descriptor_type)
                vars(rebuilt).update(fields)
                rebuilt.base = _Base(_pointer(location, inputs, allocations), dtype)
                args[position] = rebuilt
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None,
                         None, *args, *tail)


def _pointer(location: tuple, inputs: tuple, allocations: list) -> int:
    kind, index, where = location
    if kind == "input":
        return inputs[index].data_ptr() + where
    if kind == "alloc":
        return allocations[index].data_ptr()
    if kind == "alloc_view":
        return allocations[index].data_ptr() + where[0] * where[3].itemsize
    return index


def _output(location: tuple, allocations: list) -> torch.Tensor:
    kind, index, where = location
    if kind == "alloc":
        return allocations[index]
    storage_offset, shape, stride, _ = where
    return allocations[index].as_strided(shape, stride, storage_offset)


def run(key: tuple, inputs: tuple, call):
    """call() (which returns a tensor or a tuple of tensors), replayed from the plan of `key`
    when there is one. The first call of a key runs as it is (it compiles kernels and fills
    lazy caches); the second is recorded."""
    plan = _plans.get(key)
    if isinstance(plan, _Plan):
        if launch_module.hooks_empty():  # a profiler's hooks see every launch
            out = plan.replay(inputs)
            return out if len(out) > 1 else out[0]
        return call()
    if plan is None:
        _remember(key, _SEEN)
        return call()
    if plan is _NOT_REPLAYABLE or launch_module.recording() is not None:
        return call()
    recorder = _Recorder()
    with launch_module.record_launches() as launches, recorder:
        result = call()
    outputs = result if isinstance(result, tuple) else (result,)
    plan = None
    if recorder.replayable and None not in launches:
        plan = _Plan(recorder, inputs, launches)
        if not plan.finish(outputs):
            plan = None
    _remember(key, plan if plan is not None else _NOT_REPLAYABLE)
    return result


def _remember(key: tuple, plan) -> None:
    if key not in _plans and len(_plans) >= MAX_PLANS:
        del _plans[next(iter(_plans))]
    _plans[key] = plan
