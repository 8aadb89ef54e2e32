"""Tile configurations of the Gluon kernels (forward.py, backward.py, backward_wide.py) and
the backward's schedule choices.

Each entry keeps one line of why, with the number that chose it (H100, bf16, triton 3.6); the
sweeps behind them are in docs/perf/tiles.md.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HopperTileConfig:
    """Tiles of the Gluon kernels. Forward (forward.py): block_m query rows per program
    (block_m / consumers per consumer warpgroup), block_n keys per K/V buffer, num_buffers K/V
    buffers in the ring.
    Backward (backward.py): block_n keys per program (half per consumer warpgroup), block_m
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


# Gluon forward, keyed by head dim (exact: no padding; D64's two-consumer form tied the Triton
# forward, 0.319 against 0.330 ms). H100, B2 H16 4k, forward kernel ms
_FWD_HOPPER = {
    # dense 0.433 ms, the Triton forward 0.546; a mask by TMA leaves room for 2 K/V buffers: 0.410
    # against 0.437 with the consumers' loads at 3
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
    128: HopperTileConfig(128, 64, 3, 232, 40, mask_buffers=3),  # 0.450 ms; Triton 0.601
}


# Gluon backward, keyed by head dim (`hopper_backward_refusal` says which calls). D64 / D128
# (backward.py): 64-row q tiles, S^T and dP^T [64 keys, 64 rows] per consumer beside dK and dV;
# D256 (backward_wide.py): 64 keys per program, two q / dO buffers (224 KB of shared memory with
# K and V). H100, B2 H16 4k dense, backward ms
_BWD_HOPPER = {
    # D128's tiles, no spills; 4 q / dO buffers alike (causal fwd+bwd 0.754 ms against 0.742)
    64: HopperTileConfig(64, 128, 2, 240, 24),
    128: HopperTileConfig(64, 128, 2, 240, 24),  # call 1.545 ms; the Triton backward 1.720
    256: HopperTileConfig(64, 64, 2, 240, 24),  # kernel 3.50 ms; the Triton backward 5.08
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
    """Whether the Gluon backward (backward.py, head dims 64 and 128) computes each step's dQ in
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
