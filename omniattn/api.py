"""`omniattn.attention`: validate, normalise, choose the schedule, dispatch to a backend."""
from __future__ import annotations

import math

import torch

from .autograd import triton_attention
from .kernels.configs import backward_config, forward_config, interpreting
from .kernels.elementwise import Elementwise, mask_schedule, mask_tile_states
from .kernels.schedule import KernelArgs, RelativePredicate, Schedule, coarsen_states
from .masks.block_mask import BlockMask
from .reference import attention_reference

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.uint8, *SUPPORTED_DTYPES)
MAX_HEAD_DIM = 256

# argument -> the feature (issue) that brings it; until then passing it raises NotImplementedError
_PENDING_FEATURES = {
    "seqlens_k_per_row": "per-row key lengths (issue #5)",
    "cu_seqlens_q": "varlen (issue #5)",
    "cu_seqlens_k": "varlen (issue #5)",
    "max_seqlen_q": "varlen (issue #5)",
    "max_seqlen_k": "varlen (issue #5)",
}


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 "
                            f"or torch.float32")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got "
                             f"{_describe(t)} (3-D packed inputs need cu_seqlens_q/k, issue #5)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, _, num_heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Sk, Hk, D), got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k/v have head_dim {k.shape[3]} but q has {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim} "
                         f"(q {_describe(q)})")
    num_heads_k = k.shape[2]
    if num_heads_k == 0 or num_heads % num_heads_k != 0:
        raise ValueError(f"the number of query heads ({num_heads}) must be a multiple of the "
                         f"number of key/value heads ({num_heads_k}) for GQA/MQA")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got "
                             f"strides {t.stride()}; call {name}.contiguous() first")


def _check_options(causal, window, softmax_scale, softcap, dropout_p) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
            raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
        if any(w < -1 for w in window):
            raise ValueError(f"window offsets must be >= 0, or -1 for unbounded, got {tuple(window)}")
    if softmax_scale is not None:
        if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0:
        raise NotImplementedError("dropout_p > 0 is not implemented yet: dropout (issue #5)")


def _check_block_mask(block_mask, q, k) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be an omniattn.BlockMask, got {type(block_mask).__name__}"
                        f" (a FlexAttention BlockMask converts with omniattn.BlockMask.from_flex)")
    batch, seqlen_q, num_heads = q.shape[:3]
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if block_mask.seq_lengths != (seqlen_q, k.shape[1]):
        raise ValueError(f"block_mask was built for (Sq, Sk) = {block_mask.seq_lengths}, but q/k "
                         f"have Sq = {seqlen_q}, Sk = {k.shape[1]}")
    if mask_batch not in (1, batch) or mask_heads not in (1, num_heads):
        raise ValueError(f"block_mask lists have batch/head dims ({mask_batch}, {mask_heads}); "
                         f"expected (1 or {batch}, 1 or {num_heads})")
    if block_mask.kv_indices.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.kv_indices.device} but q is on {q.device}")


def _check_elementwise(name: str, t, dtypes, q: torch.Tensor, k: torch.Tensor) -> None:
    """attn_mask / attn_bias: 4-D, each dim 1 or full, heads in {1, Hk, H}; never expanded."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    batch, seqlen_q, num_heads = q.shape[:3]
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    if (t.dim() != 4 or t.shape[0] not in (1, batch) or t.shape[1] not in (1, num_heads_k, num_heads)
            or t.shape[2] not in (1, seqlen_q) or t.shape[3] not in (1, seqlen_k)):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, not broadcastable to (B={batch}, "
                         f"H in {{1,{num_heads_k},{num_heads}}}, Sq={seqlen_q}, Sk={seqlen_k}); "
                         f"size-1 dims broadcast")


def _kernel_tile(block: int, preferred: int) -> int:
    """Largest power-of-two tile <= preferred (>= 16) dividing the mask's block."""
    tile = preferred
    while block % tile:
        tile //= 2
    return tile


def _explicit_schedule(q, k, args: KernelArgs, block_mask, attn_mask, attn_bias=None):
    """Schedule of a block mask and/or an element mask, each pass at its own tiles, and the
    kernel arguments whose predicate its PARTIAL tiles apply (attention's ANDed with the mask's).
    The element mask is read once, by the pre-pass, at the finest tile any pass uses."""
    head_dim, seqlen_q, num_heads = q.shape[-1], q.shape[1], q.shape[2]
    seqlen_k = k.shape[1]
    elementwise = attn_mask is not None or attn_bias is not None
    full_bias = attn_bias is not None and Elementwise.of(attn_bias, num_heads).spans_queries_and_keys
    # the tiles must be those the launchers pick for the same call
    fwd = forward_config(head_dim, q.dtype, masked=True, elementwise=elementwise)
    bwd = backward_config(head_dim, q.dtype, masked=True, full_bias=full_bias)
    tiles = [(fwd.block_m, fwd.block_n), (bwd.block_m2, bwd.block_n2), (bwd.block_m1, bwd.block_n1)]
    outer_args = args
    outer = RelativePredicate(args.window_left, args.window_right)
    if block_mask is not None:
        block_q, block_k = block_mask.block_size
        tiles = [(_kernel_tile(block_q, m), _kernel_tile(block_k, n)) for m, n in tiles]
        merged = outer & block_mask.predicate
        # PARTIAL tiles apply attention's predicate ANDed with the mask's own
        args = KernelArgs(args.softmax_scale, args.softcap, merged.left, merged.right)
        if attn_mask is None:
            return block_mask.kernel_schedule(*tiles, outer, num_heads), args
    mask = Elementwise.of(attn_mask, num_heads)
    if block_mask is None:
        return mask_schedule(mask, seqlen_q, seqlen_k, num_heads, outer_args, *tiles), args
    # both: the element states join the block mask's on the host (tile-granular tensors)
    fine_m, fine_n = math.gcd(*(m for m, _ in tiles)), math.gcd(*(n for _, n in tiles))
    mask_states = mask_tile_states(mask, seqlen_q, seqlen_k, fine_m, fine_n, outer_args)

    def states_at(block_m: int, block_n: int) -> torch.Tensor:
        element = coarsen_states(mask_states, block_m // fine_m, block_n // fine_n)
        return block_mask.kernel_states(block_m, block_n, outer, element)

    return Schedule.build(states_at, *tiles, num_heads), args


def _use_kernels(q: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors too under TRITON_INTERPRET=1."""
    return q.is_cuda or interpreting()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    block_mask=None,
    seqlens_k_per_row: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact attention with every mask on one kernel core, forward and backward.

    Args:
        q: (B, Sq, H, D); k, v: (B, Sk, Hk, D) with H % Hk == 0 (GQA/MQA). fp16, bf16 or fp32,
            contiguous in the last dimension, D <= 256.
        causal: key j is visible to query i iff j <= i + Sk - Sq (bottom-right aligned).
        window: (left, right): key j visible iff i + Sk - Sq - left <= j <= i + Sk - Sq + right;
            -1 = unbounded on that side. ANDed with causal.
        softmax_scale: defaults to 1 / sqrt(D).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax.
        attn_mask: bool (True = keep) or numeric (nonzero = keep), broadcastable to
            (B, Hm, Sq, Sk) with Hm in {1, Hk, H}; size-1 dims are read with stride 0.
        attn_bias: fp16/bf16/fp32, broadcastable like attn_mask, added to the scores after the
            softcap; differentiable, its gradient comes back in its own shape (summed over the
            dims it broadcasts, inside the backward pass). The mask is classified per tile by a
            pre-pass: all-kept tiles skip the mask load, all-masked tiles are never loaded.
        block_mask: an omniattn.BlockMask for (Sq, Sk): only its listed blocks are computed; its
            PARTIAL blocks apply its own causal/window predicate; ANDed with causal/window.
        deterministic: the backward pass is always deterministic (no atomics); accepted for
            compatibility.
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log), -inf for a row
            that sees no key. It is differentiable.

    Returns:
        out (B, Sq, H, D) in q's dtype (0 on rows that see no key), or (out, lse).

    seqlens_k_per_row, cu_seqlens_*, max_seqlen_* and dropout_p > 0 belong to later features and
    raise NotImplementedError until they land.
    """
    pending = {"seqlens_k_per_row": seqlens_k_per_row, "cu_seqlens_q": cu_seqlens_q,
               "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
               "max_seqlen_k": max_seqlen_k}
    for name, value in pending.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not implemented yet: {_PENDING_FEATURES[name]}")
    _check_qkv(q, k, v)
    _check_options(causal, window, softmax_scale, softcap, dropout_p)
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

    if block_mask is not None:
        _check_block_mask(block_mask, q, k)
    if attn_mask is not None:
        _check_elementwise("attn_mask", attn_mask, MASK_DTYPES, q, k)
    if attn_bias is not None:
        _check_elementwise("attn_bias", attn_bias, SUPPORTED_DTYPES, q, k)

    if _use_kernels(q):
        args = KernelArgs.make(q.shape[-1], causal, window, softmax_scale, softcap)
        schedule = None
        if block_mask is not None or attn_mask is not None:
            schedule, args = _explicit_schedule(q, k, args, block_mask, attn_mask, attn_bias)
        out, lse = triton_attention(q, k, v, args, schedule, attn_mask, attn_bias)
    else:
        out, lse = attention_reference(q, k, v, causal=causal, window=window,
                                       softmax_scale=softmax_scale, softcap=float(softcap),
                                       attn_mask=attn_mask, attn_bias=attn_bias,
                                       block_mask=block_mask, return_lse=True)
    return (out, lse) if return_lse else out
