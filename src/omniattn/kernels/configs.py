"""Tile configurations, in one place.

Each GPU entry keeps one line of why, with the number that chose it (bf16, triton 3.6); the
sweeps behind them are in docs/perf/tiles.md. Under TRITON_INTERPRET=1 tiles are 16 so tiny test
shapes span many tiles.
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

# forward (fwd.py), keyed by (padded head dim, masked = causal or window). H200, B2 H16 4k,
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
# backward (bwd.py), keyed like _FWD: (block_m1, block_n1, block_m2, block_n2, warps, stages),
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
# query heads per dK/dV program under GQA: one (the group's heads in separate programs, fp32
# partials summed after by sum_kv_parts) keeps the program MHA's; a loop over the heads raised
# its spills from 176 to 932 B. H200, GQA 32/8 causal 8k backward kernel 3.24 ms + 0.08 (sum)
# against 4.24
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


# Gluon forward, keyed by head dim (exact: no padding; D64's two-consumer form tied fwd.py, 0.319
# against 0.330 ms). H100, B2 H16 4k, forward kernel ms
_FWD_HOPPER = {
    # dense 0.433 ms, fwd.py 0.546; a mask by TMA leaves room for 2 K/V buffers: 0.410 against
    # 0.437 with the consumers' loads at 3
    128: HopperTileConfig(128, 128, 3, 232, 40, mask_buffers=2),
    256: HopperTileConfig(128, 64, 2, 240, 24),  # dense 0.726 ms; 32-key tiles in 4 buffers 0.98
}
# Gluon forward of plain calls only (`hopper_forward_config`): three consumer warpgroups of 64
# rows at D64, where a step's matmuls are half D128's beside the same softmax. H100, B2 H16 4k
# dense, forward kernel ms
_FWD_HOPPER_PLAIN = {
    64: HopperTileConfig(192, 128, 4, 160, 24, consumers=3),  # 0.308 ms; two consumers 0.313
}
# Gluon forward with a 2-byte bias spanning (Sq, Sk): its tiles (and a byte mask's) come by TMA
# with K; 3 stages of 64 keys take 200 KB of shared memory (2 of 128 keys would need 256). H100,
# B2 H16 4k causal top-k mask + full bias, forward kernel ms
_FWD_HOPPER_FULL_BIAS = {
    128: HopperTileConfig(128, 64, 3, 232, 40, mask_buffers=3),  # 0.450 ms; fwd.py 0.601
}


# Gluon backward, keyed by head dim (`hopper_backward_refusal` says which calls). D64 / D128
# (bwd_hopper.py): 64-row q tiles, S^T and dP^T [64 keys, 64 rows] per consumer beside dK and dV;
# D256 (bwd_hopper_wide.py): 64 keys per program, two q / dO buffers (224 KB of shared memory
# with K and V). H100, B2 H16 4k dense, backward ms
_BWD_HOPPER = {
    # D128's tiles, no spills; 4 q / dO buffers alike (causal fwd+bwd 0.754 ms against 0.742)
    64: HopperTileConfig(64, 128, 2, 240, 24),
    128: HopperTileConfig(64, 128, 2, 240, 24),  # call 1.545 ms; bwd.py 1.720
    256: HopperTileConfig(64, 64, 2, 240, 24),  # kernel 3.50 ms; bwd.py 5.08
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
    step's dS), where shared memory holds the third buffer. pairs_per_group: that of a
    longest-first causal grid (`causal_pairs_per_group`), else None. Three where they won (H100,
    backward kernel ms, three / two buffers: dense B2 H16 4k 1.312 / 1.383): at D64 always
    (nothing spills); at D128 not with a left bound (ptxas spills loop invariants: GQA 16/4
    (1024, 0) 0.449 / 0.419), and under causal MHA only where a wave holds one pair's programs
    (B1 16k 5.21 / 5.36, B2 4k 0.770 / 0.743) and there is no full bias (B1 H8 16k 6.04 /
    5.51). docs/perf/tiles.md, "hopper_backward_dq_trails"."""
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
    112 bytes). Taken (H100, backward kernel ms, 0 / 1 / 2): 0 for a key bias with two dS
    buffers (mask .5 + key bias 4k 1.370 / 1.423 / 1.475), 2 where the dQ trails without lists
    or a full bias (dense 4k 1.258 / 1.233 / 1.192), 1 elsewhere (full bias 4k 2.421 / 2.114 /
    2.287). docs/perf/tiles.md, "hopper_backward_p_rounding"."""
    if key_bias and not dq_trails:
        return 0
    return 2 if dq_trails and not listed and not full_bias else 1


def hopper_backward_splits_head_dim(head_dim: int) -> bool:
    """Whether the Gluon backward at this head dim is bwd_hopper_wide's (dK / dV / dQ split by
    head dim between the consumers; no lists, masks or biases)."""
    return head_dim > 128


def causal_pairs_per_group(num_tiles_n: int, num_pairs: int, num_sms: int) -> int:
    """(batch, KV head) pairs whose causal backward programs (num_tiles_n each) the Gluon
    backward runs as a group, longest first within it: about one wave of programs per group
    (H100, GQA 32/8 causal 8k backward kernel 2.74 ms against 3.07 with one group for all;
    docs/perf/backward.md, "The causal backward's program groups")."""
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
