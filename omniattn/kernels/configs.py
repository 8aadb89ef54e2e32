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
    """Forward tiles: query rows x key columns per program."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdTileConfig:
    """Backward tiles: dK/dV programs hold block_n1 keys and walk block_m1 query rows at a time;
    dQ programs hold block_m2 queries and walk block_n2 keys at a time."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_INTERPRETER = TileConfig(16, 16, 1, 1)
_INTERPRETER_BWD = BwdTileConfig(16, 16, 16, 16, 1, 1)

# forward, keyed by (padded head dim, masked = causal or window)
_FWD = {
    (32, False): TileConfig(128, 128, 8, 3),
    (32, True): TileConfig(64, 64, 4, 3),
    (64, False): TileConfig(128, 128, 8, 3),
    (64, True): TileConfig(64, 64, 4, 3),
    (128, False): TileConfig(128, 128, 8, 3),  # H200 dense 4k: 0.579 ms vs 1.13 for (128,64,4,3)
    (128, True): TileConfig(64, 64, 4, 3),  # H200 causal 4k: 0.338 ms vs 0.363 for (128,128,8,3)
    (256, False): TileConfig(64, 64, 4, 2),
    (256, True): TileConfig(64, 64, 4, 2),
}
# backward (dK/dV and dQ programs of one launch), keyed like _FWD
_BWD = {
    (32, False): BwdTileConfig(64, 64, 64, 64, 4, 2),
    (32, True): BwdTileConfig(64, 64, 64, 64, 4, 2),
    (64, False): BwdTileConfig(64, 64, 64, 64, 4, 2),
    (64, True): BwdTileConfig(64, 64, 64, 64, 4, 2),
    (128, False): BwdTileConfig(64, 64, 64, 64, 4, 2),  # H200 dense 4k: 2.26 ms, best square tile
    (128, True): BwdTileConfig(64, 64, 64, 64, 4, 2),  # H200 causal 4k: 1.08 ms
    (256, False): BwdTileConfig(32, 32, 32, 32, 4, 1),
    (256, True): BwdTileConfig(32, 32, 32, 32, 4, 1),
}
# fp32 inputs use IEEE dots (exact fp32, no tensor cores): small tiles keep registers in budget
_FP32 = TileConfig(32, 32, 4, 1)
_FP32_BWD = BwdTileConfig(32, 32, 32, 32, 4, 1)


def padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _key(head_dim: int, masked: bool) -> tuple[int, bool]:
    return max(32, padded_head_dim(head_dim)), masked


def forward_config(head_dim: int, dtype: torch.dtype, masked: bool = False) -> TileConfig:
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    return _FWD[_key(head_dim, masked)]


def backward_config(head_dim: int, dtype: torch.dtype, masked: bool = False) -> BwdTileConfig:
    if interpreting():
        return _INTERPRETER_BWD
    if dtype == torch.float32:
        return _FP32_BWD
    return _BWD[_key(head_dim, masked)]
