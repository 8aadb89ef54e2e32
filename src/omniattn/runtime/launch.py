"""Kernel launches with Triton's per-launch host work cut to one dictionary lookup.

`kernel[grid](*args)` binds and specialises every argument in Python (JITFunction.run: the
binder, the cache key, the launch metadata) before the compiled launcher runs: 55-65 us per
launch on an H100 host, of which the launcher is 17-21 (docs/perf/host-overhead.md). `launch` keys the
compiled kernel on a tuple finer than Triton's specialisation (every scalar by value, every
tensor by dtype and 16-byte alignment, every descriptor by all its fields), so a hit is the
kernel Triton itself would pick, and calls its launcher directly.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from triton import knobs
from triton.backends.nvidia.driver import make_tensordesc_arg
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime import _allocation, driver
from triton.tools.tensor_descriptor import TensorDescriptor

from .switches import interpreting

_PLAIN = frozenset((int, float, bool, type(None), str, torch.dtype))
_DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)
# a kernel's oldest entry goes beyond this: calls whose scalars change every time (dropout
# seeds) miss, and would otherwise grow the cache without end
MAX_ENTRIES_PER_KERNEL = 256
# CUtensorMaps a FlatLaunch keeps per descriptor, one per base pointer seen (a model's layers
# each bring their own); all are dropped past this
MAX_TENSOR_MAPS_PER_DESCRIPTOR = 64


class _Uncacheable(Exception):
    pass


def _other_key(value):
    """Key of an argument that is neither a plain scalar nor a plain tensor."""
    if type(value) is tuple:  # grouped arguments (strides, forms): each leaf as on its own
        types = tuple(map(type, value))
        if _PLAIN.issuperset(types):  # the common case, no recursion
            return types, value
        return arguments_key(value)
    if isinstance(value, torch.Tensor):  # subclasses (nn.Parameter)
        return (type(value), value.dtype, value.data_ptr() & 15)
    if isinstance(value, _DESCRIPTORS):
        base = value.base
        return (type(value), base.dtype, base.data_ptr() & 15, tuple(value.shape),
                tuple(value.strides), tuple(value.block_shape), value.padding,
                getattr(value, "layout", None))
    try:
        hash(value)
    except TypeError:
        raise _Uncacheable from None
    return value


def arguments_key(values) -> tuple:
    """A tuple that tells apart every two argument lists Triton would specialise differently
    (it is finer: scalars by type and value, so True, 1 and 1.0 differ). Raises _Uncacheable
    for an unhashable argument."""
    return tuple(map(type, values)), tuple([
        (value.dtype, value.data_ptr() & 15) if type(value) is torch.Tensor
        else value if type(value) in _PLAIN else _other_key(value) for value in values])


def tensors_then_tuple(operands: tuple, tensors: int) -> tuple:
    """A launcher's operands, `tensors` tensors then their strides (and sizes), as the Triton
    kernels take them: each tensor an argument of its own (`FlatLaunch` replays set only
    top-level pointers), the rest one tuple argument."""
    return (*operands[:tensors], operands[tensors:])


def _tail(kernel, args: tuple, kwargs: dict) -> tuple | None:
    """The parameters after the positional ones in signature order (keywords, then defaults),
    as the launcher takes them; None when one is a tensor (it would change between calls)."""
    tail = []
    for param in kernel.params[len(args):]:
        value = kwargs[param.name] if param.name in kwargs else param.default
        if isinstance(value, (torch.Tensor,) + _DESCRIPTORS):
            return None
        tail.append(value)
    return tuple(tail)


def _no_hook(hook) -> bool:
    """Triton 3.6's launch hooks are chains, empty unless a profiler (proton) adds to them."""
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)


def hooks_empty() -> bool:
    return _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)


_compiled: dict[int, dict[tuple, tuple]] = {}
_recording = threading.local()


def recording() -> list | None:
    """The launches being recorded on this thread (`record_launches`), or None."""
    return getattr(_recording, "launches", None)


@contextlib.contextmanager
def record_launches():
    """Collects this thread's launches as (compiled kernel, 3-d grid, arguments, tail), None for
    a launch that went past the cache (call_plans cannot replay those)."""
    _recording.launches = launches = []
    try:
        yield launches
    finally:
        _recording.launches = None


def _grid_3d(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), through the compiled kernel of an earlier launch with the
    same key when there is one. The first launch of a key (and every launch under the
    interpreter or with a launch hook, as profilers add) goes through Triton."""
    launches = recording()
    if launches is None:
        _launch(kernel, grid, args, kwargs)
        return
    _recording.inside = True
    try:
        launches.append(_launch(kernel, grid, args, kwargs))
    finally:
        _recording.inside = False


def inside_launch() -> bool:
    """Whether this thread is inside a recorded launch (whose launcher may allocate a workspace
    of its own: not part of the call)."""
    return getattr(_recording, "inside", False)


def _launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict) -> tuple | None:
    """(compiled kernel, 3-d grid, arguments, tail) of a launch made or cached through the
    compiled kernel; None for one Triton's run made alone."""
    # without CUDA (the interpreter, or tools that compile in place of each launch): Triton's run
    if interpreting() or not torch.cuda.is_available() or not hooks_empty():
        kernel[grid](*args, **kwargs)
        return None
    device = torch.cuda.current_device()
    try:
        # the two knobs Triton's run adds to the compile options
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               arguments_key(args), tuple(kwargs), arguments_key(kwargs.values()))
    except _Uncacheable:
        kernel[grid](*args, **kwargs)
        return None
    entries = _compiled.setdefault(id(kernel), {})
    entry = entries.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        tail = _tail(kernel, args, kwargs)
        if compiled is None or tail is None:
            return None
        if len(entries) >= MAX_ENTRIES_PER_KERNEL:
            del entries[next(iter(entries))]
        entries[key] = (compiled, tail)
        return compiled, _grid_3d(grid), args, tail
    compiled, tail = entry
    # Triton refuses a kernel whose module globals changed since it compiled: so do we
    for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, _Uncacheable) != value:
            kernel[grid](*args, **kwargs)  # raises Triton's error
            return None
    grid = _grid_3d(grid)
    run_compiled(compiled, grid, driver.active.get_current_stream(device), args, tail)
    return compiled, grid, args, tail


def run_compiled(compiled, grid: tuple[int, int, int], stream: int, args, tail: tuple) -> None:
    """The compiled kernel's launcher on `stream`, with no launch metadata and no hooks."""
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


# the cells of Triton 3.6's descriptor-expanding wrapper around its launcher module's launch
_DESCRIPTOR_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")


class Unflattenable(Exception):
    """A compiled kernel whose launcher is not Triton 3.6's CUDA launcher as FlatLaunch knows it."""


def _holds_tensor(group: tuple) -> bool:
    """Whether a tuple argument holds a tensor or descriptor (replays set only top-level
    pointers, so kernels take tensors as arguments of their own)."""
    return any(_holds_tensor(item) if type(item) is tuple
               else isinstance(item, (torch.Tensor,) + _DESCRIPTORS) for item in group)


class _Pointer:
    """A descriptor's base as Triton's descriptor encoder reads it: only its pointer."""
    __slots__ = ("pointer",)

    def __init__(self, pointer: int):
        self.pointer = pointer

    def data_ptr(self) -> int:
        return self.pointer


class FlatLaunch:
    """One launch of a compiled kernel with its arguments flattened once as Triton's launcher
    module takes them (each tensor descriptor expanded into its CUtensorMap, or its base, then
    its shape and strides), for launches repeated with new pointers (call plans). Triton's
    CudaLauncher redoes that flattening per launch: a pass over every argument and a CUtensorMap
    encoded per descriptor; here a replay sets only the pointers, and a descriptor's map is
    encoded once per base pointer. Tensors in the arguments are left as None in `values`:
    the caller sets them (`index` of the argument) before each `run`."""

    def __init__(self, compiled, grid: tuple[int, int, int], args: tuple, tail: tuple):
        launcher = compiled.run
        wrapped = getattr(launcher, "launch", None)
        code = getattr(wrapped, "__code__", None)  # None: the launcher module's own function
        if type(launcher).__name__ != "CudaLauncher" or wrapped is None or (
                code is not None and code.co_freevars != _DESCRIPTOR_WRAPPER_CELLS):
            raise Unflattenable(type(launcher).__name__)
        if code is None:  # no descriptor among the kernel's parameters
            self._launch, descriptor_positions, metas = wrapped, (), ()
        else:  # Triton's wrapper that expands descriptors (wrap_handle_tensordesc)
            self._launch, descriptor_positions, metas = (
                cell.cell_contents for cell in wrapped.__closure__)
        self._launcher = launcher
        self._grid = grid
        self._function = (compiled.function, launcher.launch_cooperative_grid,
                          launcher.launch_pdl)
        self._programs = grid[0] * grid[1] * grid[2] * launcher.num_ctas
        self._packed_metadata = compiled.packed_metadata
        self.values = []
        self._starts = []  # per kernel argument, its first index in values
        self._descriptors = {}  # per descriptor's position: (it without its base, metadata)
        for position, arg in enumerate((*args, *tail)):
            if type(arg) is tuple and _holds_tensor(arg):
                raise Unflattenable("a tensor inside a tuple argument")
            self._starts.append(len(self.values))
            if position in descriptor_positions:
                meta = metas[len(self._descriptors)]
                self.values.extend(make_tensordesc_arg(arg, meta))
                unbased = object.__new__(type(arg))
                vars(unbased).update(vars(arg), base=None)
                self._descriptors[position] = (unbased, meta)
            else:
                self.values.append(arg)
        # the plan keeps no tensor of the recorded call alive: the caller sets them per run
        self.values = [None if isinstance(value, torch.Tensor) else value
                       for value in self.values]

    def index(self, position: int) -> int:
        """Where the kernel argument at `position` goes in values (a descriptor: its map or
        base)."""
        return self._starts[position]

    def encoder(self, position: int):
        """pointer -> what the launcher takes for the descriptor at `position` with that base:
        its CUtensorMap (cached per pointer) or, for a descriptor Triton lowered to pointer,
        shape and strides, the pointer itself."""
        unbased, meta = self._descriptors[position]
        if meta is None:
            return int
        tensor_maps = {}

        def encode(pointer: int):
            tensor_map = tensor_maps.get(pointer)
            if tensor_map is None:
                if len(tensor_maps) >= MAX_TENSOR_MAPS_PER_DESCRIPTOR:
                    tensor_maps.clear()
                based = object.__new__(type(unbased))
                vars(based).update(vars(unbased), base=_Pointer(pointer))
                tensor_map = tensor_maps[pointer] = make_tensordesc_arg(based, meta)[0]
            return tensor_map

        return encode

    def run(self, stream: int, values: list) -> None:
        """The launch on `stream` with these values (`self.values` with the tensors set), as
        CudaLauncher.__call__ makes it, workspaces included."""
        launcher = self._launcher
        global_scratch = profile_scratch = None
        if launcher.global_scratch_size:
            global_scratch = _allocation._allocator.get()(
                self._programs * launcher.global_scratch_size, launcher.global_scratch_align,
                stream)
        if launcher.profile_scratch_size:
            profile_scratch = _allocation._profile_allocator.get()(
                self._programs * launcher.profile_scratch_size, launcher.profile_scratch_align,
                stream)
        self._launch(*self._grid, stream, *self._function, global_scratch, profile_scratch,
                     self._packed_metadata, None, None, None, *values)


def _workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


@contextlib.contextmanager
def descriptor_workspace():
    """Kernels that build tensor descriptors on the device get their global workspace from
    torch's allocator during the launch; the caller's own Triton allocator comes back after."""
    token = _allocation._allocator.set(_workspace)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
