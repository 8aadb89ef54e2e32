"""Tile configurations, in one place.

Each GPU entry carries the measurement that chose it (H100 SXM, bf16, triton 3.6; see
benchmarks/results/). Under TRITON_INTERPRET=1 tiles are 16 so tiny test shapes span many tiles.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_INTERPRETER = TileConfig(16, 16, 1, 1)

# forward, keyed by padded head dim: (block_m, block_n, warps, stages)
_FWD = {
    32: TileConfig(128, 64, 4, 3),
    64: TileConfig(128, 64, 4, 3),
    128: TileConfig(128, 64, 4, 3),
    256: TileConfig(64, 64, 4, 2),
}
# backward (dK/dV and dQ programs of one launch share it)
_BWD = {
    32: TileConfig(64, 64, 4, 2),
    64: TileConfig(64, 64, 4, 2),
    128: TileConfig(64, 64, 4, 2),
    256: TileConfig(32, 32, 4, 1),
}
# fp32 inputs use IEEE dots (exact fp32, no tensor cores): smaller tiles keep registers in budget
_FP32 = TileConfig(32, 32, 4, 1)


def padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def forward_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    return _FWD[max(32, padded_head_dim(head_dim))]


def backward_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    return _BWD[max(32, padded_head_dim(head_dim))]
