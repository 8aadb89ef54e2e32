"""Switches and device facts every layer reads: the interpreter, compute capability and SM
count (asked once per device), and the environment switches of A/B runs and tests."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, asked once (torch's query was 5% of a launch's host
    time)."""
    return _capability(_device_index(device))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once."""
    return _sm_count(_device_index(device))


def tma_enabled(device: torch.device) -> bool:
    """K/V tiles through tensor descriptors (TMA on sm90+; the interpreter emulates them).
    OMNIATTN_TMA=0 turns them off (the pointer path stays tested)."""
    if not switch_on("OMNIATTN_TMA"):
        return False
    if interpreting():
        return True
    return device.type == "cuda" and compute_capability(device)[0] >= 9


# environment switches of A/B runs and tests: "0" turns the feature off (see each user)
SWITCHES = ("OMNIATTN_GLUON", "OMNIATTN_TMA", "OMNIATTN_CALL_PLANS")


def switch_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def switches() -> dict[str, bool]:
    """Each environment switch: whether its feature is on (what benchmark records carry)."""
    return {name: switch_on(name) for name in SWITCHES}


def gluon_enabled() -> bool:
    """The Gluon kernels (backends/gluon_sm90) where they apply; OMNIATTN_GLUON=0 keeps every call
    on the Triton kernels (the A/B switch of the GPU tests and benchmarks)."""
    return switch_on("OMNIATTN_GLUON")
