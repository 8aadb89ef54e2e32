"""Call plans: calls replayed per call signature, past their Python.

The Python of a call (validation, tile configs, schedule views, descriptors, launch arguments)
depends only on its signature: the inputs' shapes, strides, dtypes, devices and alignment, and
the options. A plan records, on the second call of a signature, what the call did on the device:
its allocations (empty or zeroed), its launches and the few torch operations a replay may repeat
(copies, fills, sums, casts), each tensor located in an input, a tensor the call created or a
tensor cached outside it. Later calls with the signature replay it: the allocations and
operations, and each launch with its arguments flattened once (`launch.FlatLaunch`) and the new
pointers set (H100 host, top-k mask + key bias forward, B1 S512 H2: 134-143 us per call against
342-392; docs/perf/host-overhead.md). The forward of a call
that records a graph and its backward are planned apart, each inside the autograd Function
(autograd.py).

A call is recorded under a TorchDispatchMode that lets through only allocations, views and those
operations: a call that computes anything else with torch (reading a value on the host
included), or launches a kernel past `kernels.launch`'s cache, is marked as not replayable and
keeps the ordinary path. Callers leave out calls whose host work draws random numbers
(dropout seeds).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs

from . import launch as launch_module
from .switches import gluon_enabled, interpreting, switch_on, tma_enabled

aten = torch.ops.aten
_EMPTY = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
          aten.empty_strided.default}
_ZEROS = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}
# operations whose result depends only on their operands' values: replayed as recorded
_REPLAYED = {aten.copy_.default, aten.zero_.default, aten.sum.dim_IntList,
             aten._to_copy.default}
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
              torch.memory_format)
# plans kept; the oldest goes first
MAX_PLANS = 128
_SEEN, _NOT_REPLAYABLE = object(), object()
_ALLOCATE, _OPERATE, _LAUNCH = range(3)  # the kinds of a plan's steps
_INPUT, _CREATED, _OUTSIDE = range(3)  # where a tensor of a recorded call lies
_COPIED = "copied"  # the layout of a list or dict of constants: a copy per replay
_plans: dict[tuple, object] = {}


def plans_enabled() -> bool:
    """OMNIATTN_CALL_PLANS=0 runs every call through the ordinary path (the A/B switch)."""
    return switch_on("OMNIATTN_CALL_PLANS")


def clear() -> None:
    """Forget every plan (tests that patch configs or kernels call this)."""
    _plans.clear()


def _typed(value):
    """value with the type of every element beside it: True and 1 (which hash alike) apart, as
    validation tells them apart."""
    if type(value) is tuple:
        return tuple(_typed(element) for element in value)
    return type(value), value


def _plannable() -> bool:
    return not (interpreting() or torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active()) and plans_enabled()


def _tensor_keys(inputs: tuple, positions, storages: dict) -> list | None:
    """Per input at `positions` (a tensor or None): its shape, strides, dtype, device, 16-byte
    alignment and where its storage is first shared (`storages`: storage pointer -> (position,
    pointer), filled as it goes). None if one is not a plain tensor on a GPU."""
    keys = []
    for position in positions:
        t = inputs[position]
        if t is None:
            keys.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_cuda:
            return None
        pointer = t.data_ptr()
        first, first_pointer = storages.setdefault(t.untyped_storage().data_ptr(),
                                                   (position, pointer))
        keys.append((t.shape, t.stride(), t.dtype, t.device, pointer & 15, first,
                     pointer - first_pointer))
    return keys


def _key(leading, tensors: list | None, first: torch.Tensor, options: tuple) -> tuple | None:
    """`leading`, the switches that change the path (on `first`'s device), the tensors' keys
    and the options typed; None where tensors is None or an option cannot be hashed (validation
    will refuse it)."""
    if tensors is None:
        return None
    try:
        key = (leading, torch.cuda.current_device(), gluon_enabled(), tma_enabled(first.device),
               knobs.runtime.debug, tuple(tensors), _typed(options))
        hash(key)
    except TypeError:
        return None
    return key


def signature(inputs: tuple, options: tuple) -> tuple | None:
    """The key of an eager call whose inputs (tensors or None) are plain tensors on a GPU:
    shapes, strides, dtypes, devices, 16-byte alignment, which inputs share a storage and where
    (views of one qkv projection), the options (which must also say whether the call records
    a graph) and the switches that change the path. None for other calls."""
    if not _plannable():
        return None
    return _key(None, _tensor_keys(inputs, range(len(inputs)), {}), inputs[0], options)


def signature_after(forward_key: tuple, inputs: tuple, fresh: tuple[int, ...],
                    options: tuple) -> tuple | None:
    """The key of a backward whose inputs are the inputs of the forward keyed `forward_key` and
    tensors that forward made, whose layouts and shared storages follow from that key, but for
    those at positions `fresh` (the gradients of its outputs): those are keyed as `signature`
    keys them, with any storage they share with another input. The switches are read again.
    Cheaper than `signature` of all inputs (a planned fwd+bwd's host time: docs/perf/host-overhead.md).
    """
    if not _plannable():
        return None
    storages = {}
    for position, t in enumerate(inputs):
        if t is not None and position not in fresh:
            storages.setdefault(t.untyped_storage().data_ptr(), (position, t.data_ptr()))
    return _key(forward_key, _tensor_keys(inputs, fresh, storages), inputs[fresh[0]], options)


class _Recorder(TorchDispatchMode):
    """The call's allocations (zeroed or not) and replayable operations in call order, each
    with the number of launches before it; any other torch computation spoils the plan."""

    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches
        self.events: list[tuple] = []  # (launches before, _ALLOCATE or _OPERATE, details)
        self.created: list[torch.Tensor] = []  # allocations and operations' new results
        self.replayable = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launch_module.inside_launch():  # a launcher's own workspace
            return out
        if func in _EMPTY or func in _ZEROS:
            self.events.append((len(self.launches), _ALLOCATE, (
                tuple(out.shape), out.stride(), out.dtype, out.device, func in _ZEROS)))
            self.created.append(out)
        elif func in _REPLAYED:
            creates = not any(out is arg for arg in args)  # not in place
            self.events.append((len(self.launches), _OPERATE, (func, args, kwargs, creates)))
            if creates:
                self.created.append(out)
        elif not func.is_view:
            self.replayable = False
        return out


class _Unplannable(Exception):
    """Something of the recorded call a replay could not rebuild."""


class _Plan:
    """The call's steps in order: allocations, operations and launches, each tensor located
    (see `locate` and `_layout`), and the layout of its result."""

    def __init__(self, recorder: _Recorder, inputs: tuple, launches: list, result):
        self.keep_alive = []  # tensors cached outside the call that launches point into
        self._inputs, self._created = inputs, recorder.created
        self._owners = {t.untyped_storage().data_ptr(): (_CREATED, i)
                        for i, t in enumerate(recorder.created)}
        for i, t in reversed(list(enumerate(inputs))):  # the first input of a shared storage
            if t is not None:
                self._owners[t.untyped_storage().data_ptr()] = (_INPUT, i)
        self.steps = []
        launched = 0
        for before, kind, details in recorder.events:
            self.steps.extend(self._launch_step(*entry) for entry in launches[launched:before])
            launched = before
            if kind == _ALLOCATE:
                self.steps.append((_ALLOCATE, *details))
            else:
                func, args, kwargs, creates = details
                self.steps.append((_OPERATE, func, self._layout(args), self._layout(kwargs),
                                   creates))
        self.steps.extend(self._launch_step(*entry) for entry in launches[launched:])
        self.result = self._layout(result, outputs=True)
        del self._inputs, self._created, self._owners

    def _owner(self, t: torch.Tensor) -> tuple:
        """(where, index, the input or created tensor whose storage t is in), or (_OUTSIDE,
        None, None) for a tensor cached outside the call (kept alive by the plan)."""
        where, index = self._owners.get(t.untyped_storage().data_ptr(), (_OUTSIDE, None))
        if where == _OUTSIDE:
            self.keep_alive.append(t)
            return where, None, None
        return where, index, self._inputs[index] if where == _INPUT else self._created[index]

    def locate(self, t: torch.Tensor) -> tuple:
        """(where, index, byte offset from its owner's data pointer), or (_OUTSIDE, the
        pointer, None)."""
        where, index, owner = self._owner(t)
        if where == _OUTSIDE:
            return where, t.data_ptr(), None
        return where, index, t.data_ptr() - owner.data_ptr()

    def _launch_step(self, compiled, grid, args, tail) -> tuple:
        """(_LAUNCH, the launch flattened, [(index in its values, location)] of tensor
        pointers, [(index, location of the base, encoder)] of tensor descriptors)."""
        try:
            flat = launch_module.FlatLaunch(compiled, grid, args, tail)
        except launch_module.Unflattenable as error:
            raise _Unplannable(f"a launcher of type {error}") from None
        pointers, descriptors = [], []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                pointers.append((flat.index(position), self.locate(arg)))
            elif isinstance(arg, launch_module._DESCRIPTORS):
                descriptors.append((flat.index(position), self.locate(arg.base),
                                    flat.encoder(position)))
        return (_LAUNCH, flat, pointers, descriptors)

    def _layout(self, value, outputs: bool = False):
        """How a replay rebuilds `value` (operation arguments, or the call's result): tensors
        as inputs, tensors the call created or views of either; lists, tuples and dicts of
        them; constants. Raises _Unplannable for anything else (a result in a tensor cached
        outside the call included: each call must get its own)."""
        if isinstance(value, torch.Tensor):
            return (torch.Tensor, self._tensor_layout(value, outputs))
        if type(value) in (tuple, list, dict):
            items = value.items() if type(value) is dict else enumerate(value)
            layouts = {where: self._layout(v, outputs) for where, v in items}
            if all(kind is None for kind, _ in layouts.values()):  # constants: copied whole
                return (None, value) if type(value) is tuple else (_COPIED, value.copy())
            if type(value) is dict:
                return (dict, layouts)
            return (type(value), list(layouts.values()))
        if isinstance(value, _CONSTANTS):
            return (None, value)
        raise _Unplannable(type(value).__name__)

    def _tensor_layout(self, t: torch.Tensor, output: bool) -> tuple:
        """(where, index, None) for an input or created tensor itself, (where, index, (storage
        offset from the owner's, shape, strides)) for a view of one, (_OUTSIDE, t, None)."""
        if output and t.untyped_storage().data_ptr() not in self._owners:
            raise _Unplannable("a result in a tensor from outside the call")
        where, index, owner = self._owner(t)
        if where == _OUTSIDE:
            return where, t, None
        if t is owner:
            return where, index, None
        if t.dtype != owner.dtype:
            raise _Unplannable("a view in another dtype")
        return where, index, (t.storage_offset() - owner.storage_offset(), tuple(t.shape),
                              t.stride())

    def replay(self, inputs: tuple):
        created = []
        stream = launch_module.driver.active.get_current_stream(torch.cuda.current_device())
        with launch_module.descriptor_workspace():
            for step in self.steps:
                kind = step[0]
                if kind == _LAUNCH:
                    _replay_launch(step, inputs, created, stream)
                elif kind == _ALLOCATE:
                    _, shape, stride, dtype, device, zero = step
                    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    created.append(t.zero_() if zero else t)
                else:
                    _, func, args, kwargs, creates = step
                    out = func(*_rebuilt(args, inputs, created),
                               **_rebuilt(kwargs, inputs, created))
                    if creates:
                        created.append(out)
        return _rebuilt(self.result, inputs, created)


def _replay_launch(step: tuple, inputs: tuple, created: list, stream: int) -> None:
    _, flat, pointers, descriptors = step
    values = flat.values.copy()
    for index, location in pointers:
        values[index] = _pointer(location, inputs, created)
    for index, location, encode in descriptors:
        values[index] = encode(_pointer(location, inputs, created))
    flat.run(stream, values)


def _pointer(location: tuple, inputs: tuple, created: list) -> int:
    where, index, offset = location
    if where == _OUTSIDE:
        return index
    return (inputs[index] if where == _INPUT else created[index]).data_ptr() + offset


def _rebuilt(layout: tuple, inputs: tuple, created: list):
    kind, value = layout
    if kind is torch.Tensor:
        where, index, view = value
        if where == _OUTSIDE:
            return index
        owner = inputs[index] if where == _INPUT else created[index]
        if view is None:
            return owner
        offset, shape, stride = view
        return owner.as_strided(shape, stride, owner.storage_offset() + offset)
    if kind is None:
        return value
    if kind is _COPIED:
        return value.copy()
    if kind is dict:
        return {name: _rebuilt(v, inputs, created) for name, v in value.items()}
    return kind(_rebuilt(v, inputs, created) for v in value)


def run(key: tuple, inputs: tuple, call):
    """call() (which returns tensors, constants, and lists, tuples or dicts of them), replayed
    from the plan of `key` when there is one. The first call of a key runs as it is (it
    compiles kernels and fills lazy caches); the second is recorded."""
    plan = _plans.get(key)
    if isinstance(plan, _Plan):
        if launch_module.hooks_empty():  # a profiler's hooks see every launch
            return plan.replay(inputs)
        return call()
    if plan is None:
        _remember(key, _SEEN)
        return call()
    if plan is _NOT_REPLAYABLE or launch_module.recording() is not None:
        return call()
    with launch_module.record_launches() as launches, _Recorder(launches) as recorder:
        result = call()
    plan = _NOT_REPLAYABLE
    if recorder.replayable and None not in launches:
        try:
            plan = _Plan(recorder, inputs, launches, result)
        except _Unplannable:
            pass
    _remember(key, plan)
    return result


def _remember(key: tuple, plan) -> None:
    if key not in _plans and len(_plans) >= MAX_PLANS:
        del _plans[next(iter(_plans))]
    _plans[key] = plan
