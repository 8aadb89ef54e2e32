"""Tile configurations, in one place.

Each GPU entry carries the measurement that chose it (H100 SXM, bf16, triton 3.6; see
benchmarks/results/). Under TRITON_INTERPRET=1 tiles are 16 so tiny test shapes span many tiles.
"""
from __future__ import annotations

import functools
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
    """The Gluon kernels (fwd_hopper.py, bwd_hopper.py) where they apply; OMNIATTN_GLUON=0 keeps
    every call on fwd.py / bwd.py (the A/B switch of the GPU tests and benchmarks)."""
    return switch_on("OMNIATTN_GLUON")


_INTERPRETER = TileConfig(16, 16, 1, 1)
# the interpreter runs the atomic dQ path (test_deterministic_backward the other one)
_INTERPRETER_BWD = BwdTileConfig(16, 16, 16, 16, 1, 1, atomic_dq=True)

# forward, keyed by (padded head dim, masked = causal or window). Numbers: H200, bf16, H16,
# 4k (dense B2 / causal B2), benchmarks/tune_tiles.py; D32 has not been swept and follows D64.
_FWD = {
    (32, False): TileConfig(128, 128, 4, 3),
    (32, True): TileConfig(64, 64, 4, 3),
    (64, False): TileConfig(128, 128, 4, 3),  # 0.336 ms; (128, 128, 8, 3) 0.407
    (64, True): TileConfig(64, 64, 4, 3),  # 0.215 ms; (128, 64, 4, 3) 0.231
    (128, False): TileConfig(128, 128, 8, 3),  # 0.587 ms; (128, 64, 4, 3) 1.13
    (128, True): TileConfig(64, 64, 4, 3),  # 0.338-0.360 ms; (128, 128, 8, 3) 0.361
    (256, False): TileConfig(128, 64, 8, 2),  # 1.22 ms; (64, 64, 4, 2) 2.2
    (256, True): TileConfig(128, 64, 8, 2),  # 0.697 ms; (64, 64, 4, 3) 0.804
}
# Hopper, q/k/v/out through tensor descriptors (TMA), keyed like _FWD. H100, bf16, B2 H16 4k
# (D128 dense also B1 H16 16k), scratch sweep at 2026-11-22; "pointers" is _FWD's entry without
# descriptors. Warp specialisation (tl.range(warp_specialize=True), 128x128, 4 warps, 2 stages)
# left lse rows unwritten when lse was stored through pointers (triton 3.6); stored through a
# descriptor it is complete but no faster overall: D128 0.501 vs 0.527 ms at 4k, 3.842 vs 3.764
# at 16k, D64 0.372 vs 0.322 (2026-11-23): not used.
_FWD_TMA = {
    (64, False): TileConfig(128, 128, 4, 3),  # 0.437 ms; pointers 0.509, (128, 128, 8, 3) 0.439
    (64, True): TileConfig(64, 64, 4, 3),  # 0.253 ms; pointers 0.399, (128, 64, 4, 3) 0.379
    (128, False): TileConfig(128, 128, 8, 3),  # 0.547 / 4.29 ms (16k); pointers 0.580 / 4.25
    (128, True): TileConfig(64, 64, 4, 3),  # 0.336 ms; pointers 0.346, (128, 128, 8, 3) 0.378
    (256, False): TileConfig(128, 64, 8, 2),  # 1.149 ms; pointers 1.272, (64,64,4,2) specialised 1.81
    (256, True): TileConfig(64, 64, 4, 3),  # 0.640 ms; pointers 0.730, (128, 64, 8, 2) 0.668
}
# backward, keyed like _FWD: (block_m1, block_n1, block_m2, block_n2, warps, stages). Pointer
# loads: through tensor descriptors (and dQ by TMA reduce-add) the H100 took 1.914 vs 1.733 ms
# dense 4k, 1.046 vs 0.967 causal (docs/perf/backward.md, "The backward on TMA")
_BWD = {
    (32, False): BwdTileConfig(32, 64, 64, 32, 4, 3),
    (32, True): BwdTileConfig(32, 64, 64, 32, 4, 3),
    # D64, H100 backward call ms (profiler, 2026-11-23), dense / causal: (32, 64, 64, 32, 4, 3)
    # 0.965-0.975 / 0.514-0.516, (64, 64, 64, 64, 4, 3) 0.914-0.922 / 0.519, 4 stages 0.953-0.961
    # / 0.520-0.525, (64, 64, 64, 64, 4, 2) 1.03-1.04 / 0.61, (64, 128, 128, 64, 8, 3) 1.12 / 0.62
    (64, False): BwdTileConfig(64, 64, 64, 64, 4, 3),
    (64, True): BwdTileConfig(32, 64, 64, 32, 4, 3),
    (128, False): BwdTileConfig(64, 128, 128, 64, 8, 3),  # 1.764 ms; (64, 64, 64, 64, 4, 2) 2.36
    # 1.007 ms; (64, 64, 64, 64, 4, 2) 1.07. Top-k mask + key bias (2026-11-24): 1.28 ms (16
    # spills); 2 stages 1.47, (32, 128, 128, 64, 8, 3) 1.37, 64x64x4w 1.43, atomic dQ 1.32
    (128, True): BwdTileConfig(64, 128, 128, 64, 8, 3),
    # D256, H100 backward kernel ms (profiler, B2 H16 4k, 2026-11-23), dense / causal: dV and dK
    # programs apart, (32, 64, 64, 32, 4, 3) 4.94-5.03 / 3.65-3.71; together (64, 32, 32, 64,
    # 4, 2) 7.69-7.95 / 3.87-3.99 (dQ tiles (64, 32) there 10.2 / 5.5). Apart, (32, 128, 64,
    # 32, 8, 3) 6.45-6.51 / 3.42 needs 234-312 KB of shared memory with ragged masked tiles or
    # atomic dQ; with (32, 64) dQ tiles: (32, 64, 4, 3) 6.52-6.65 / 4.46-4.50, (64, 32, 4, 2)
    # 8.30-8.43 / 4.96-4.99, 8 warps >= 9.8 dense
    (256, False): BwdTileConfig(32, 64, 64, 32, 4, 3, dkdv_apart=True),
    (256, True): BwdTileConfig(32, 64, 64, 32, 4, 3, dkdv_apart=True),
}
# calls whose only mask is causal (no explicit schedule, bias, left window, softcap, dropout,
# lengths or packing), keyed by padded head dim: D256's 8-warp tiles take 229,888 bytes of
# shared memory there, ragged lengths included (ptxas, sm_90a). H100, B2 H16 4k causal, backward
# kernel 3.44-3.49 ms against 3.645 (profiler, 2026-11-24), fwd+bwd 4.15-4.18 against 4.28
_BWD_CAUSAL = {
    256: BwdTileConfig(32, 128, 64, 32, 8, 3, dkdv_apart=True),
}
# element mask and/or bias (explicit mask schedules, bias loads), keyed by padded head dim; other
# head dims use the masked entries above. H100, bf16, B2 H16 4k, causal top-k mask (52% tiles)
# + bias, forward kernel (profiler, 2026-11-24), key / full bias:
_FWD_ELEMENTWISE = {
    # 0.541 / 0.602 ms; (128, 64, 8, 3) 0.552 / 0.589, (128, 128, 8, 2) 0.570 / 0.640,
    # (64, 64, 4, 3) 0.639 / 0.646 (the mask tile per stage costs a CTA per SM), (128, 64, 8, 2)
    # 0.658 / 0.726, (64, 128, 4, 2) 0.733 / 0.732
    128: TileConfig(64, 64, 4, 2),
}
# the same through tensor descriptors at head dims above 128: _FWD_TMA's three stages of
# 64 x 256 K / V tiles beside a mask or bias tile need 238-263 KB of shared memory (sm_90a,
# benchmarks/kernel_resources.py), over the H100's 227 KB; two stages take 165-185 KB
_FWD_TMA_ELEMENTWISE = {
    256: TileConfig(64, 64, 4, 2),
}
# a bias spanning (Sq, Sk): its tiles are loaded and its gradient stored in every visited tile.
# H100, bf16, B2 H16 4k causal top-k (52% tiles), backward kernel (2026-11-24, profiler); the
# dK/dV programs spill at 255 registers with 64-query tiles (44 spills; 84-100 with atomic dQ)
_BWD_FULL_BIAS = {
    # 2.05 ms; with atomic dQ 2.27-2.58. 32-query dK/dV tiles: 1.96 (no spills), 1.93 at 3
    # stages, but the mask pre-pass then runs at 32-row tiles: 0.077 -> 0.137 ms, forward-only
    # calls included (fwd+bwd 2.91-2.93 ms either way). (32, 128, 128, 32) 2.22, 4 warps >= 3.1
    128: BwdTileConfig(64, 128, 128, 64, 8, 2),
}
# query heads per dK/dV program under GQA: one (the group's heads in separate programs, fp32
# partials summed after by _sum_kv_parts) keeps the program MHA's; a loop over the heads raised
# its spills from 176 to 932 B (ptxas). H200 backward kernels, ms (2026-11-23): GQA 32/8 causal
# 8k 4.24-4.26 -> 3.24 + 0.08 (sum), dense 8k 7.32-7.38 -> 6.34-6.47 + 0.08, 16/2 causal 4k
# 1.55-1.57 -> 0.94 + 0.04; 2 heads per program (a loop of 2) 4.39 at 8k causal
DKDV_HEADS_PER_PROGRAM = 1
# dropout regroups its 16-bit draws (join / reshape) through shared memory: at 3 stages the
# D128 dense forward asked for 245,760 of 232,448 bytes on the H100
DROPOUT_MAX_STAGES = 2
# fp32 inputs use IEEE dots (exact fp32, no tensor cores): small tiles keep registers in budget
_FP32 = TileConfig(32, 32, 4, 1)
_FP32_BWD = BwdTileConfig(32, 32, 32, 32, 4, 1)


@dataclass(frozen=True)
class HopperTileConfig:
    """Tiles of the Gluon kernels. Forward (fwd_hopper.py): block_m query rows per program
    (block_m / consumers per consumer warpgroup), block_n keys per K/V buffer, num_buffers K/V
    buffers in the ring.
    Backward (bwd_hopper.py): block_n keys per program (half per consumer warpgroup), block_m
    query rows per q / dO buffer, num_buffers of those. Registers per thread of the consumer and
    producer partitions. mask_buffers: the forward's K/V buffers when the producer also loads
    the element mask's tiles (a [block_m, block_n] byte tile per buffer; 0: the consumers load
    them)."""

    block_m: int
    block_n: int
    num_buffers: int
    consumer_regs: int
    producer_regs: int
    mask_buffers: int = 0
    consumers: int = 2


# Gluon forward, keyed by head dim (exact: no padding). H100, bf16, do_bench, against fwd.py and
# cuDNN in the same process (2026-11-23), ms: dense B2 H16 4k 0.433-0.453 (fwd.py 0.546, cuDNN
# 0.439), B1 H16 16k 3.47-3.49 (4.015, 3.555), causal 4k 0.266 (0.330, 0.271), causal 16k
# 1.79-1.90 (2.246, 1.969), GQA 32/8 causal 8k 0.943 (1.202, 0.990). 2 buffers: dense 4k 0.509;
# 128-key tiles beat 64 under causal (4k 0.284, 16k 1.93-1.98); registers (240, 24) or (200, 56)
# change nothing (D64: see below). With an element mask (issue #4's causal top-k keeping 1024
# keys, B2 H16 4k), kernel call: key bias 0.433 ms (fwd.py 0.542); 128x64 tiles with 3 / 4 / 5
# buffers 0.500 / 0.509 / 0.501. A bias spanning (Sq, Sk) spills at 128x128 (616 B; 0.81 ms) and
# ties fwd.py at 128x64 (0.614 against 0.610): such calls stay in fwd.py. The mask's tiles by TMA
# through the producer (one byte per element, spanning (Sq, Sk)) leave room for 2 K/V buffers:
# 0.410-0.412 ms against 0.437-0.454 loaded by the consumers at 3 (profiler, 2026-11-23); a 3rd
# buffer would need 272 KB of shared memory. D256 (2026-11-24, forward kernel ms by profiler, B2
# H16 4k dense / causal): 64-key tiles in 2 buffers 0.726 / 0.430 (fwd.py 1.13 / 0.61, cuDNN 0.748
# / 0.450); before K's buffer went back ahead of V's 1.05 / 0.60, 32-key tiles in 3 / 4 / 5
# buffers 1.00 / 0.98 / 1.00. D64 at (128, 128, 4): 0.319 / 0.209 against fwd.py's 0.330 / 0.205
# (3 / 6 buffers 0.349 / 0.334 dense): stays in fwd.py
_FWD_HOPPER = {
    128: HopperTileConfig(128, 128, 3, 232, 40, mask_buffers=2),
    256: HopperTileConfig(128, 64, 2, 240, 24),
}
# Gluon forward of plain calls only (`hopper_forward_config`): three consumer warpgroups of 64
# rows at D64, where a step's matmuls are half D128's beside the same softmax. H100, bf16, forward
# kernel ms (profiler, 2026-11-25, two rounds; fwd.py / this): dense B2 H16 4k 0.330-0.335 /
# 0.308-0.320, causal 4k 0.205-0.207 / 0.195-0.197, dense B1 H16 16k 2.42-2.60 / 2.08-2.34, causal
# 16k 1.28-1.36 / 1.15-1.20. Two consumers (128, 128, 4, 240, 24): 0.313-0.315, 0.200-0.202,
# 2.29-2.47, 1.25-1.42. Dense 4k at 3 / 5 buffers 0.312-0.317 / 0.310-0.311; registers (168, 24)
# 0.349-0.352, (152, 24) 0.340-0.345, (144, 24) 0.366-0.368, (160, 40) 0.351-0.356; 64-key tiles
# in 6 buffers 0.349-0.351. Same, three rounds: GQA 16/4 causal 4k 0.205-0.208 / 0.195-0.196, dense
# 0.327-0.328 / 0.308, GQA 32/8 causal B1 8k 0.673-0.676 / 0.617-0.618; windows (1024, 0) and
# (512, 512) at B2 8k tie (0.231-0.234 / 0.232-0.233)
_FWD_HOPPER_PLAIN = {
    64: HopperTileConfig(192, 128, 4, 160, 24, consumers=3),
}
# Gluon forward with a 2-byte bias spanning (Sq, Sk): its tiles (and a byte mask's) come by TMA
# with K, [64, 64] boxes per consumer: 3 stages of 64 keys take 200 KB of shared memory (at 128
# keys one stage of bias and mask is 48 KB: 2 K/V buffers would need 256 KB). H100, issue #4's
# top-k mask + full bias, forward kernel 0.450-0.452 ms against fwd.py's 0.601-0.604
# (profiler, 2026-11-23); consumer loads at these tiles tied fwd.py (0.614 against 0.610)
_FWD_HOPPER_FULL_BIAS = {
    128: HopperTileConfig(128, 64, 3, 232, 40, mask_buffers=3),
}


# Gluon backward, keyed by head dim. H100, bf16, backward call (delta pre-pass, kernel, dQ
# conversion), do_bench, against bwd.py in the same process (2026-11-23), ms: dense B2 H16 4k
# 1.545-1.551 (bwd.py 1.720), causal 4k 0.853-0.863 (0.963), dense B1 H16 16k 11.3-12.2 (13.08),
# GQA 32/8 causal 8k 3.19-3.21 (3.65). 64-row q tiles: S^T and dP^T [64 keys, 64 rows] per
# consumer beside dK and dV (128 registers); S^T and dP^T in flight together spilled at 240
# registers (dense 4k 1.87-2.03). P^T and dS^T as register operands of dV and dK, not through
# shared memory (2026-11-25, backward kernel ms by profiler, shared / registers): dense 4k 1.346
# / 1.258, causal 4k 0.745 / 0.687, dense 16k 10.81 / 9.69, causal 16k 5.20 / 4.90
# D256 (bwd_hopper_wide.py): 64 keys per program, 64-row q tiles, two q / dO buffers (224 KB of
# shared memory with K and V); S and dP split by keys between the consumers, dK / dV / dQ by head
# dim (one consumer's registers cannot hold dK and dV of 64 keys at D256). H100, B2 H16 4k,
# backward kernel ms (profiler, 2026-11-24) dense / causal / GQA 16/4 causal: 3.50 / 1.86 / 1.96
# against bwd.py's 5.08 / 3.46 / 3.49 (cuDNN's whole backward about 3.85 / 2.10 dense / causal)
# D64: the D128 tiles (no spills; four q / dO buffers measured alike, dense 16k 9.48 against
# 9.59 ms of fwd+bwd, causal 4k 0.754 / 0.742); `hopper_backward_refusal` says which calls
_BWD_HOPPER = {
    64: HopperTileConfig(64, 128, 2, 240, 24),
    128: HopperTileConfig(64, 128, 2, 240, 24),
    256: HopperTileConfig(64, 64, 2, 240, 24),
}


def hopper_forward_config(head_dim: int, full_bias: bool = False,
                          plain: bool = False) -> HopperTileConfig | None:
    """full_bias: with a bias spanning (Sq, Sk); plain: dense, causal or windows alone (no
    schedule lists, mask, bias, per-row lengths or packing), which `_FWD_HOPPER_PLAIN` takes
    too."""
    if full_bias:
        return _FWD_HOPPER_FULL_BIAS.get(head_dim)
    return _FWD_HOPPER.get(head_dim) or (_FWD_HOPPER_PLAIN.get(head_dim) if plain else None)


def hopper_backward_config(head_dim: int) -> HopperTileConfig | None:
    return _BWD_HOPPER.get(head_dim)


def hopper_backward_dq_trails(head_dim: int, has_left: bool, has_right: bool, group: int,
                              pairs_per_group: int | None = None, full_bias: bool = False) -> bool:
    """Whether the Gluon backward (bwd_hopper.py, head dims 64 and 128) computes each step's dQ in
    the next step (three dS buffers: a consumer waits for the other's dS of the step before, so
    they need not meet at every step) rather than in the step itself (two: they meet at each
    step's dS), where shared memory holds the third buffer. H100, bf16, backward kernel ms
    (profiler, min of 3, one process, 2026-11-24), two / three buffers: dense B2 H16 4k 1.383 /
    1.312, B1 16k 11.66 / 11.16, key bias 4k 1.587 / 1.435, full bias 2.570 / 2.531, random
    block masks 16k at density 1 / .11 11.59 / 11.16 and 1.315 / 1.257, GQA 16/4 causal 4k 0.751
    / 0.705, GQA 32/8 causal 8k 2.81 / 2.61; but causal 4k 0.743 / 0.770 (with a key bias 0.877
    / 0.873, a full one 1.487 / 1.607), a (-1, 256) window 0.835 / 0.859, and with left bounds,
    GQA 16/4 (1024, 0) 0.419 / 0.449, (512, 512) 0.416 / 0.450: ptxas spills loop invariants
    there (22 local loads per step, none with two buffers; Nsight Compute). At head dim 64
    nothing spills and three won everywhere: GPU ms of fwd+bwd calls (fwd.py's forward), dense
    4k 1.395 / 1.301, causal 0.791 / 0.742, GQA 16/4 causal 0.776 / 0.715, causal + key bias
    0.839 / 0.810, GQA 16/4 (1024, 0) 0.459 / 0.439, dense 16k 10.33 / 9.59.
    pairs_per_group: that of a longest-first causal grid (`causal_pairs_per_group`), else None.
    Causal MHA takes three where a wave holds one pair's programs, but with a full bias: backward
    kernel ms (profiler, H100, 2026-11-25, two / three, three rounds), one pair per group: B1 H16
    16k 5.36-5.55 / 5.21-5.25, B1 H4 32k 5.32-5.60 / 5.11-5.15, a (-1, 256) window at 16k
    5.47-5.65 / 5.37-5.56, a key bias 6.21-6.27 / 6.19-6.24, a full bias (H8) 5.51-5.64 /
    6.04-6.17; four pairs (B2 4k) 0.736-0.743 / 0.749-0.761; GQA 16/4 causal 4k ties with a full
    bias (1.834-1.852 / 1.839-1.848) and a key bias (0.808-0.812 / 0.809-0.811), a full bias
    without causal gains (2.576-2.613 / 2.542-2.578). Backward calls (do_bench), two
    pairs (8k) 1.583-1.586 / 1.592-1.600; one forced at 4k / 8k (slower for both) 0.915-0.917 /
    0.918-0.920, 1.66-1.68 / 1.66-1.67. Rechecked after P^T and dS^T became register operands
    (2026-11-25, backward kernel ms, two / three): dense 4k 1.336 / 1.261, causal 4k 0.686 /
    0.688, causal 16k 4.906 / 4.882, a full bias with causal 1.412 / 1.517, GQA 16/4 (1024, 0)
    0.406 / 0.435: the picks stand."""
    if head_dim < 128:
        return True
    if has_left:
        return False
    return not has_right or group > 1 or (pairs_per_group == 1 and not full_bias)


def hopper_backward_p_rounding(dq_trails: bool, listed: bool, key_bias: bool,
                               full_bias: bool) -> int:
    """How the Gluon backward (head dims 64, 128) rounds a step's P^T for the dV matmul, and
    which P^T its dS^T = P^T (dP^T - delta) takes: 0, one conversion per element (ptxas makes
    it a scalar F2F, as slow as the exp2) and dS^T from the rounded values; 1, two elements per
    conversion, dS^T from the rounded values (read back in pairs); 2, two per conversion, dS^T
    from P^T in fp32 (unrounded: closer to exact). listed: the call walks schedule lists (an
    element mask's or a block mask's). 1 and 2 cut the spills of every form (dense 104 -> 4 /
    112 bytes, causal 16k 232 -> 72 / 240, mask + key bias 264 -> 120 / 224). H100, bf16,
    backward kernel ms (profiler, one host, 2026-11-25), 0 / 1 / 2, two rounds: dense B2 H16 4k
    1.258-1.288 / 1.233-1.234 / 1.192-1.194, dense B1 16k 10.25-10.49 / 10.10-10.30 /
    9.76-9.97, causal 16k (dQ trails) 4.91-5.02 / 5.27-5.32 / 4.88-5.06, GQA 32/8 causal 8k
    2.433 / 2.380-2.385 / 2.302-2.319, dense B16 1k 0.696-0.704 / 0.671-0.678 / 0.662-0.669, D64
    dense 4k 0.823-0.833 / 0.792-0.801 / 0.757-0.765; with two dS buffers: causal 4k
    0.684-0.689 / 0.656-0.661 / 0.681-0.686, (1024, 0) window 8k 0.813-0.818 / 0.746-0.753 /
    0.765-0.774, mask .5 + full bias 4k 2.199-2.231 / 2.139-2.173 / 2.195-2.230, mask .5 + key
    bias 4k 1.370-1.378 / 1.423-1.426 / 1.475-1.479. One round: key bias 4k 1.316 / 1.281 /
    1.246, full bias 4k 2.421 / 2.114 / 2.287, with causal 1.409 / 1.305 / 1.398, block masks
    16k at density 1 / .11 10.20 / 9.97 / 9.46 and 1.307 / 1.084 / 1.168, issue #4's top-k mask
    + key bias 0.815 / 0.865 / 0.858, + full bias 1.448 / 1.466 / 1.492, per-row lengths B2 8k,
    uniform / i + 1, 2.577 / 2.538, 2.330 / 2.309, 2.343 / 2.326, packed documents (varlen
    suite) 1 and 2 within 2-5% of each other, 0 3-10% behind. Taken: 0 for a key bias with two
    dS buffers (measured with an element mask), 2 where the dQ trails without lists or a full
    bias, 1 elsewhere."""
    if key_bias and not dq_trails:
        return 0
    return 2 if dq_trails and not listed and not full_bias else 1


def hopper_backward_splits_head_dim(head_dim: int) -> bool:
    """Whether the Gluon backward at this head dim is bwd_hopper_wide's (dK / dV / dQ split by
    head dim between the consumers; no lists, masks or biases)."""
    return head_dim > 128


def causal_pairs_per_group(num_tiles_n: int, num_pairs: int, num_sms: int) -> int:
    """(batch, KV head) pairs whose causal backward programs (num_tiles_n each) the Gluon
    backward runs as a group, longest first within it: about one wave of programs per group.
    H100, backward kernel ms in backward-only loops, one group for all pairs / one wave per
    group: GQA 32/8 causal 8k 3.07-3.14 / 2.74-2.80 (3.04-3.16 / 2.80-3.02 between forwards),
    4k B2 1.73-1.74 / 1.43-1.44, 2k B4 1.02 / 0.79-0.81, GQA 32/4 4k B2 2.15-2.17 / 2.00-2.04,
    64/8 8k 7.9-8.2 / 6.8-6.9; MHA causal 4k / 8k / 16k alike; the H200 alike (GQA 8k)."""
    return max(1, min(num_pairs, num_sms // num_tiles_n))


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b): triton.cdiv is a constexpr function, 6 us per host call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side, like triton.next_power_of_2 (also a constexpr function)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


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
        # top-k mask + key / full bias 0.570 / 0.640 ms at (128, 128, 8, 2), 2026-11-24
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
