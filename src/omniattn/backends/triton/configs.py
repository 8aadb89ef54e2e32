"""Tile configurations of the Triton kernels (forward.py, backward.py, decode.py).

Each GPU entry keeps one line of why, with the number that chose it (bf16, triton 3.6); the
sweeps behind them are in docs/perf/tiles.md. Under TRITON_INTERPRET=1 tiles are 16 so tiny test
shapes span many tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.sizes import next_power_of_2, padded_head_dim
from ...runtime.switches import interpreting
from ..gluon_sm90.configs import hopper_forward_config


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
    dQ programs hold block_m2 queries and walk block_n2 keys at a time. atomic_dq: unless the
    caller asks for determinism, the dK/dV programs add dQ into an fp32 buffer (atomics) and no
    dQ programs run. dkdv_apart: dV and dK of a key tile come from two programs (one fp32
    accumulator each; the dK program recomputes S and P)."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    atomic_dq: bool = False
    dkdv_apart: bool = False


_INTERPRETER = TileConfig(16, 16, 1, 1)
# the interpreter runs the atomic dQ path (test_deterministic_backward the other one)
_INTERPRETER_BWD = BwdTileConfig(16, 16, 16, 16, 1, 1, atomic_dq=True)
# forward (forward.py), keyed by (padded head dim, masked = causal or window). H200, B2 H16 4k,
# forward ms (benchmarks/tune_tiles.py); D32 has not been swept and follows D64.
_FWD = {
    (32, False): TileConfig(128, 128, 4, 3),
    (32, True): TileConfig(64, 64, 4, 3),
    (64, False): TileConfig(128, 128, 4, 3),  # 0.336 ms; (128, 128, 8, 3) 0.407
    (64, True): TileConfig(64, 64, 4, 3),  # 0.215 ms; (128, 64, 4, 3) 0.231
    (128, False): TileConfig(128, 128, 8, 3),  # 0.587 ms; (128, 64, 4, 3) 1.13
    (128, True): TileConfig(64, 64, 4, 3),  # 0.338 ms; (128, 128, 8, 3) 0.361
    (256, False): TileConfig(128, 64, 8, 2),  # 1.22 ms; (64, 64, 4, 2) 2.2
    (256, True): TileConfig(128, 64, 8, 2),  # 0.697 ms; (64, 64, 4, 3) 0.804
}
# Hopper, q/k/v/out through tensor descriptors (TMA), keyed like _FWD. H100, B2 H16 4k (D128
# dense also B1 H16 16k), forward ms; "pointers": _FWD's entry without descriptors
_FWD_TMA = {
    (64, False): TileConfig(128, 128, 4, 3),  # 0.437 ms; pointers 0.509, (128, 128, 8, 3) 0.439
    (64, True): TileConfig(64, 64, 4, 3),  # 0.253 ms; pointers 0.399, (128, 64, 4, 3) 0.379
    (128, False): TileConfig(128, 128, 8, 3),  # 0.547 / 4.29 ms (16k); pointers 0.580 / 4.25
    (128, True): TileConfig(64, 64, 4, 3),  # 0.336 ms; pointers 0.346, (128, 128, 8, 3) 0.378
    (256, False): TileConfig(128, 64, 8, 2),  # 1.149 ms; pointers 1.272, (64,64,4,2) specialised 1.81
    (256, True): TileConfig(64, 64, 4, 3),  # 0.640 ms; pointers 0.730, (128, 64, 8, 2) 0.668
}
# backward (backward.py), keyed like _FWD: (block_m1, block_n1, block_m2, block_n2, warps, stages),
# pointer loads (through descriptors the H100 took 1.914 against 1.733 ms dense 4k). B2 H16 4k,
# backward ms (D128: the first sweep, H200; D64 / D256: H100, by profiler)
_BWD = {
    (32, False): BwdTileConfig(32, 64, 64, 32, 4, 3),
    (32, True): BwdTileConfig(32, 64, 64, 32, 4, 3),
    (64, False): BwdTileConfig(64, 64, 64, 64, 4, 3),  # 0.914 ms; (32, 64, 64, 32, 4, 3) 0.965
    (64, True): BwdTileConfig(32, 64, 64, 32, 4, 3),  # 0.514 ms; (64, 64, 64, 64, 4, 3) 0.519
    (128, False): BwdTileConfig(64, 128, 128, 64, 8, 3),  # 1.764 ms; (64, 64, 64, 64, 4, 2) 2.36
    (128, True): BwdTileConfig(64, 128, 128, 64, 8, 3),  # 1.007 ms; (64, 64, 64, 64, 4, 2) 1.07
    # dV and dK programs apart: 4.94 ms dense; together (64, 32, 32, 64, 4, 2) 7.69
    (256, False): BwdTileConfig(32, 64, 64, 32, 4, 3, dkdv_apart=True),
    (256, True): BwdTileConfig(32, 64, 64, 32, 4, 3, dkdv_apart=True),  # 3.65 ms; together 3.87
}
# calls whose only mask is causal (no explicit schedule, bias, left window, softcap, dropout,
# lengths or packing), keyed by padded head dim: there D256's 8-warp tiles fit shared memory
# (229,888 bytes, ragged lengths included). H100, B2 H16 4k causal, backward kernel ms
_BWD_CAUSAL = {
    256: BwdTileConfig(32, 128, 64, 32, 8, 3, dkdv_apart=True),  # 3.44 ms; _BWD's 3.645
}
# element mask and/or bias (explicit mask schedules, bias loads), keyed by padded head dim; other
# head dims use the masked entries above. H100, B2 H16 4k, causal top-k mask (52% tiles) + key
# bias, forward kernel ms
_FWD_ELEMENTWISE = {
    128: TileConfig(64, 64, 4, 2),  # 0.541 ms; (128, 64, 8, 3) 0.552
}
# the same through tensor descriptors at head dims above 128: three stages of _FWD_TMA's 64 x 256
# K / V tiles beside a mask or bias tile need 238-263 KB of shared memory (the H100 has 227)
_FWD_TMA_ELEMENTWISE = {
    256: TileConfig(64, 64, 4, 2),  # two stages: 165-185 KB
}
# a bias spanning (Sq, Sk): its tiles are loaded and its gradient stored in every visited tile.
# H100, B2 H16 4k causal top-k (52% tiles) + full bias, backward kernel ms
_BWD_FULL_BIAS = {
    128: BwdTileConfig(64, 128, 128, 64, 8, 2),  # 2.05 ms; atomic dQ (spills) 2.27
}
# query heads per dK/dV program under GQA: one (the group's heads in separate programs adding
# fp32 dK/dV by atomics, or deterministic, partials summed after by sum_kv_parts) keeps the
# program MHA's; a loop over the heads raised its spills from 176 to 932 B. H200, GQA 32/8 causal 8k backward kernel 3.24 ms + 0.08 (sum)
# against 4.24
DKDV_HEADS_PER_PROGRAM = 1
# dropout regroups its 16-bit draws (join / reshape) through shared memory: at 3 stages the
# D128 dense forward asked for 245,760 of 232,448 bytes on the H100
DROPOUT_MAX_STAGES = 2
# fp32 inputs use IEEE dots (exact fp32, no tensor cores): small tiles keep registers in budget
_FP32 = TileConfig(32, 32, 4, 1)
_FP32_BWD = BwdTileConfig(32, 32, 32, 32, 4, 1)


def _key(head_dim: int, masked: bool) -> tuple[int, bool]:
    return max(32, padded_head_dim(head_dim)), masked


def forward_config(head_dim: int, dtype: torch.dtype, masked: bool = False,
                   elementwise: bool = False, tma: bool = False,
                   gluon: bool = False, full_bias: bool = False) -> TileConfig:
    """masked: causal / window / explicit schedule; elementwise: an element mask or a bias;
    tma: K/V tiles come through tensor descriptors; gluon: the Gluon forward takes the call
    (its schedule is built at the Gluon tiles), full_bias: with a bias spanning (Sq, Sk)."""
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    hopper = hopper_forward_config(head_dim, full_bias)
    if gluon and hopper is not None:
        # the Triton launch of those lists where the Gluon kernel declines (TMA alignment):
        # top-k mask + key bias 0.570 ms at (128, 128, 8, 2)
        return TileConfig(hopper.block_m, hopper.block_n, 8, 2)
    key = _key(head_dim, masked or elementwise)
    if elementwise and key[0] in _FWD_ELEMENTWISE:
        return _FWD_ELEMENTWISE[key[0]]
    if elementwise and tma and key[0] in _FWD_TMA_ELEMENTWISE:
        return _FWD_TMA_ELEMENTWISE[key[0]]
    if tma and key in _FWD_TMA:
        return _FWD_TMA[key]
    return _FWD[key]


def backward_config(head_dim: int, dtype: torch.dtype, masked: bool = False,
                    full_bias: bool = False, causal_only: bool = False) -> BwdTileConfig:
    """masked: causal / window / explicit schedule; full_bias: a bias spanning (Sq, Sk);
    causal_only: causal is the call's only mask or option (see _BWD_CAUSAL)."""
    if interpreting():
        return _INTERPRETER_BWD
    if dtype == torch.float32:
        return _FP32_BWD
    key = _key(head_dim, masked or full_bias)
    if causal_only and key[0] in _BWD_CAUSAL:
        return _BWD_CAUSAL[key[0]]
    if full_bias and key[0] in _BWD_FULL_BIAS:
        return _BWD_FULL_BIAS[key[0]]
    return _BWD[key]


@dataclass(frozen=True)
class DecodeConfig:
    """Split-KV decoding tiles (decode.py): block_m packed rows (the query heads of a KV head's
    group x query rows; tl.dot needs 16 or more) x block_n keys per program."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Split-KV decoding. Not yet measured: every number below is a first guess from the kernel's
# shape (K and V tiles streamed once, a 16-row dot per tile), to be replaced by H100 sweeps of
# `omniattn bench --suite decode`.
# query rows per sequence up to which the plan runs split-KV (beyond, the forward's own query
# tiles fill the GPU); not yet measured
DECODE_MAX_QUERY_ROWS = 16
# keyed by padded head dim: K and V tiles of block_n x D stream through num_stages buffers;
# not yet measured
_DECODE = {
    32: DecodeConfig(16, 128, 4, 3),
    64: DecodeConfig(16, 128, 4, 3),
    128: DecodeConfig(16, 64, 4, 3),
    256: DecodeConfig(16, 32, 4, 3),
}
# pages: the block table's entries of a tile are loaded a pipeline stage ahead of its K / V
# tiles, which then get fewer buffers (triton 3.6's TTGIR at D128: 3 stages give K and V one
# buffer each, 5 give two, as 3 do without pages); timings not yet measured
DECODE_PAGED_EXTRA_STAGES = 2
# packed rows per program at most: more rows are more programs along the grid's row axis;
# not yet measured. Head dim 256 at 64 rows spilled (ptxas, sm_90a: 255 registers, 32 bytes)
DECODE_MAX_BLOCK_M = {32: 64, 64: 64, 128: 64, 256: 32}
# packed rows x keys per tile at most: the [rows, keys] pointer tiles of a mask and a bias per
# query head cost registers (D64 at 32 rows x 128 keys, paged, mask + bias + softcap + window:
# 255 registers, 24 bytes spilled; ptxas, sm_90a); timings not yet measured
DECODE_MAX_TILE_ELEMENTS = 16 * 128
# resident programs per SM the split count aims to fill, in whole waves; not yet measured
DECODE_PROGRAMS_PER_SM = 2
# keys per split at least: each split costs a partial write and a share of the combine;
# not yet measured
DECODE_MIN_KEYS_PER_SPLIT = 512
DECODE_MAX_SPLITS = 128
# warps of the kernel that merges the splits (a few rows x D per program); not yet measured
DECODE_COMBINE_WARPS = 4
# a split count whose waves are at least this fraction as full as the best one's is taken if it
# is smaller (fewer partials to combine); not yet measured
DECODE_WAVE_EFFICIENCY = 0.85
# the interpreter: 16-key tiles and up to 3 splits, so tiny caches cross the combine
_INTERPRETER_DECODE = DecodeConfig(16, 16, 1, 1)
INTERPRETER_DECODE_SPLITS = 3


def decode_config(head_dim: int, dtype: torch.dtype, rows: int,
                  paged: bool = False) -> DecodeConfig:
    """Tiles of split-KV decoding for `rows` packed rows per (batch, KV head); paged: K / V
    read through a block table."""
    if interpreting():
        return _INTERPRETER_DECODE
    key = max(32, padded_head_dim(head_dim))
    cfg = _DECODE[key]
    block_m = min(max(16, next_power_of_2(rows)), DECODE_MAX_BLOCK_M[key])
    block_n = min(cfg.block_n, max(16, DECODE_MAX_TILE_ELEMENTS // block_m))
    stages = cfg.num_stages + (DECODE_PAGED_EXTRA_STAGES if paged else 0)
    if dtype == torch.float32:
        # IEEE dots: half the keys on twice the warps (D128 at 32 keys, 4 warps: 255
        # registers, 464 bytes spilled; 8 warps: 64 registers; ptxas, sm_90a)
        return DecodeConfig(block_m, max(16, block_n // 2), 2 * cfg.num_warps, stages - 1)
    return DecodeConfig(block_m, block_n, cfg.num_warps, stages)


def decode_splits(programs: int, key_tiles: int, block_n: int, sm_count: int | None) -> int:
    """How many programs share each (batch, KV head, row tile)'s `key_tiles` key tiles, for
    `programs` such triples: the fewest whose waves over sm_count x DECODE_PROGRAMS_PER_SM slots
    are nearly as full as the best count's (DECODE_WAVE_EFFICIENCY), each split at least
    DECODE_MIN_KEYS_PER_SPLIT keys. sm_count None: the interpreter's fixed count."""
    most = max(1, min(DECODE_MAX_SPLITS, key_tiles * block_n // DECODE_MIN_KEYS_PER_SPLIT))
    if sm_count is None:
        return max(1, min(INTERPRETER_DECODE_SPLITS, key_tiles))
    slots = sm_count * DECODE_PROGRAMS_PER_SM
    if programs >= slots:
        return 1

    def fill(splits: int) -> float:  # how full the last wave leaves the slots, on average
        waves = programs * splits / slots
        return waves / -(-waves // 1)

    best = max(fill(splits) for splits in range(1, most + 1))
    return next(splits for splits in range(1, most + 1)
                if fill(splits) >= DECODE_WAVE_EFFICIENCY * best)
