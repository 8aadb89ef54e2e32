"""Block-Sparse-Attention (mit-han-lab) façade: per-head dense, streaming and block-sparse
attention over packed (varlen) sequences, forward AND backward, as thin wrappers over
`omniattn.attention`.

Shapes, as in the original:
- q (total_q, H, D); k, v (total_k, Hk, D) with H % Hk == 0; cu_seqlens_q / cu_seqlens_k int32
  (B + 1,); max_seqlen_q_ / max_seqlen_k_ ints, at least the longest sequence.
- head_mask_type int (H,), one entry per query head: 0 dense, negative (-1) streaming, positive
  block-sparse. As in the original, the entries equal to 1 are first numbered in head order (the
  n-th 1 becomes n), then a head of value k > 0 uses base_blockmask[:, k - 1]; base_blockmask
  holds one mask per entry equal to 1 (so [1, 1] gives two heads two masks).
- streaming_info int (2 * H,) = [sink_0, local_0, sink_1, local_1, ...], read for streaming
  heads only: in blocks for block streaming, in tokens for token streaming. head_mask_type and
  streaming_info are read on the host (one sync, as the original's mask count check).
- base_blockmask (B, n_blocksparse_heads, ceil(max_seqlen_q_ / m_block_dim),
  ceil(max_seqlen_k_ / n_block_dim)), bool or integer, nonzero = keep; each sequence's blocks
  are counted from its own start, blocks past its length are ignored.
- returns out (total_q, H, D), or (out, softmax_lse (H, total_q) float32, None) when
  return_attn_probs.

Visibility, per sequence b with lengths (Sq_b, Sk_b), d_b = Sk_b - Sq_b, query i and key j
counted inside the sequence, blocks m_block_dim x n_block_dim (qb = i // m, kb = j // n):
- causal (is_causal): j <= i + d_b, bottom-right aligned, as in the original; ANDed with every
  head type below.
- dense: every key. block-sparse: key blocks kb with base_blockmask[b, k - 1, qb, kb] != 0.
- block streaming (mask type -1 without exact_streaming): kb < sink, or D - local < kb <= D. With
  is_causal, D is the key block holding the last key the last row of query block qb sees,
  D = (min((qb + 1) * m, Sq_b) - 1 + d_b) // n (floor); without it, D is the sequence's last key
  block, so every query block sees the last `local` key blocks.
- token streaming (token_streaming_attn_func, or exact_streaming=True, always causal):
  j <= i + d_b and (j < sink or j > i + d_b - local): `local` tokens up to and including the
  diagonal.

Differences from the original:
- block_sparse_attn_func takes m_block_dim / n_block_dim (trailing, default 128): any positive
  multiples of 16; the original fixes 128 x 128.
- block streaming: for m == n the rule above is the original's on every full query block. On a
  sequence's last, partial, query block with Sq_b != Sk_b the original counts a full-sized block,
  which can put its local window one block past the block of the rows' diagonal (past the last
  key: with Sq_b = 1, decoding, local = 1 then sees only the sink blocks); here D is the block of
  the actual last row's diagonal.
- the backward pass works for every head type, token streaming included (the original raises).
- softmax_lse is (H, total_q), not (B, H, max_seqlen_q_ rounded up to 128); a row that sees no
  key gets output 0 and lse -inf (the original writes +inf) and zero gradients.
- return_attn_probs returns (out, softmax_lse, None): probabilities are never materialised (the
  original returns them only when p_dropout > 0, an empty tensor otherwise).
"""
from __future__ import annotations

import torch

from ..api import attention
from ..predicate import FULL, HIDDEN, PARTIAL, RelativePredicate
from ..masks import BlockMask, block_mask_from_predicate

# the block size of the original's streaming functions (its only supported block size)
ORIGINAL_BLOCK = 128


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_block_dim(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, got {value}")


def _int_values(name: str, t, length: int, layout: str) -> list[int]:
    """The values of a 1-D integer tensor of the given length (read on the host: H is small)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor {layout}, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) {layout}, got {tuple(t.shape)}")
    return t.tolist()


def _number_blocksparse_heads(head_types: list[int]) -> list[int]:
    """The original's renumbering: the n-th entry equal to 1 becomes n."""
    numbered, ones = [], 0
    for kind in head_types:
        if kind == 1:
            ones += 1
            kind = ones
        numbered.append(kind)
    return numbered


def _head_types(head_mask_type, num_heads: int, base_blockmask, caller: str) -> list[int]:
    head_types = _int_values("head_mask_type", head_mask_type, num_heads,
                             "(one entry per query head: 0 dense, -1 streaming, 1 block-sparse)")
    if base_blockmask is None:
        sparse = [head for head, kind in enumerate(head_types) if kind > 0]
        if sparse:
            raise ValueError(f"head_mask_type[{sparse[0]}] = {head_types[sparse[0]]} is a "
                             f"block-sparse head (values > 0) but {caller} got no base_blockmask "
                             f"(only block_sparse_attn_func takes one)")
        return head_types
    numbered = _number_blocksparse_heads(head_types)
    n_masks = head_types.count(1)
    if base_blockmask.shape[1] != n_masks:
        raise ValueError(f"base_blockmask has {base_blockmask.shape[1]} masks in dim 1 (shape "
                         f"{tuple(base_blockmask.shape)}), but head_mask_type has {n_masks} "
                         f"entries equal to 1: one mask per block-sparse head")
    past = [head for head, kind in enumerate(numbered) if kind > n_masks]
    if past:
        raise ValueError(f"head_mask_type[{past[0]}] = {head_types[past[0]]} refers to mask "
                         f"{numbered[past[0]]} (after numbering the entries equal to 1), but "
                         f"base_blockmask has {n_masks}")
    return numbered


def _streaming_windows(streaming_info, head_types: list[int]) -> tuple[list[int], list[int]]:
    """(sink, local) per head; 0 for heads that do not stream."""
    num_heads = len(head_types)
    if not any(kind < 0 for kind in head_types):
        return [0] * num_heads, [0] * num_heads
    if streaming_info is None:
        head = next(head for head, kind in enumerate(head_types) if kind < 0)
        raise ValueError(f"head_mask_type[{head}] = {head_types[head]} is a streaming head but "
                         f"streaming_info is None; expected (2 * H,) = ({2 * num_heads},) ints "
                         f"[sink_0, local_0, sink_1, local_1, ...]")
    values = _int_values("streaming_info", streaming_info, 2 * num_heads,
                         "= [sink_0, local_0, sink_1, local_1, ...]")
    sinks, locals_ = values[0::2], values[1::2]
    for head, (kind, sink, local) in enumerate(zip(head_types, sinks, locals_)):
        if kind < 0 and (sink < 0 or local < 0):
            raise ValueError(f"streaming_info of streaming head {head} is (sink={sink}, "
                             f"local={local}); both must be >= 0")
    return ([s if kind < 0 else 0 for kind, s in zip(head_types, sinks)],
            [n if kind < 0 else 0 for kind, n in zip(head_types, locals_)])


def _check_blockmask(base_blockmask, batch: int, n_q_blocks: int, n_k_blocks: int,
                     device) -> None:
    if not isinstance(base_blockmask, torch.Tensor):
        raise TypeError(f"base_blockmask must be a torch.Tensor or None, got "
                        f"{type(base_blockmask).__name__}")
    if base_blockmask.dtype.is_floating_point or base_blockmask.dtype.is_complex:
        raise TypeError(f"base_blockmask must be bool or integer (nonzero = keep), got "
                        f"{base_blockmask.dtype}")
    if (base_blockmask.dim() != 4 or base_blockmask.shape[0] != batch
            or tuple(base_blockmask.shape[2:]) != (n_q_blocks, n_k_blocks)):
        raise ValueError(f"base_blockmask has shape {tuple(base_blockmask.shape)}; expected "
                         f"(B={batch}, n_blocksparse_heads, ceil(max_seqlen_q_ / m_block_dim)="
                         f"{n_q_blocks}, ceil(max_seqlen_k_ / n_block_dim)={n_k_blocks})")
    if base_blockmask.device != device:
        raise ValueError(f"base_blockmask is on {base_blockmask.device} but q is on {device}")


class _SequenceBlocks:
    """Block geometry of each packed sequence, as (B, 1, n_q_blocks | 1, n_k_blocks | 1) int64
    tensors on the device (no host sync): first / last row of each query block and first / last
    key of each key block inside the sequence, and the causal offset d_b = Sk_b - Sq_b."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, n_q_blocks, n_k_blocks, block_m, block_n):
        seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[:, None, None, None]
        seqlen_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None, None, None]
        device = seqlen_q.device
        q_block = torch.arange(n_q_blocks, device=device)[None, None, :, None]
        self.k_block = torch.arange(n_k_blocks, device=device)[None, None, None, :]
        self.q_first = q_block * block_m
        self.q_last = torch.minimum(self.q_first + block_m, seqlen_q) - 1
        self.k_first = self.k_block * block_n
        self.k_last = torch.minimum(self.k_first + block_n, seqlen_k) - 1
        self.offset = seqlen_k - seqlen_q
        self.last_k_block = (seqlen_k + block_n - 1) // block_n - 1
        self.in_sequence = (self.q_first < seqlen_q) & (self.k_first < seqlen_k)
        self.block_n = block_n

    def block_streaming(self, sink: torch.Tensor, local: torch.Tensor,
                        causal: bool) -> torch.Tensor:
        """bool (B, H, nQ, nK) of sink (H,) / local (H,) key blocks around each block diagonal."""
        if causal:
            diagonal = torch.div(self.q_last + self.offset, self.block_n, rounding_mode="floor")
        else:
            diagonal = self.last_k_block
        sink, local = sink[None, :, None, None], local[None, :, None, None]
        in_window = (self.k_block <= diagonal) & (self.k_block > diagonal - local)
        return (self.k_block < sink) | in_window

    def token_streaming_states(self, sink: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """int8 (B, H, nQ, nK) states of causal token streaming: FULL only where every element is
        visible, HIDDEN only where none is, PARTIAL otherwise (the predicate decides there)."""
        sink, local = sink[None, :, None, None], local[None, :, None, None]
        diagonal_first, diagonal_last = self.q_first + self.offset, self.q_last + self.offset
        causal_all = self.k_last <= diagonal_first
        causal_none = self.k_first > diagonal_last
        sink_all, sink_none = self.k_last < sink, self.k_first >= sink
        local_all = self.k_first > diagonal_last - local
        local_none = self.k_last <= diagonal_first - local
        full = causal_all & (sink_all | local_all)
        hidden = causal_none | (sink_none & local_none) | ~self.in_sequence
        return torch.where(hidden, HIDDEN, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _token_streaming_mask(blocks: _SequenceBlocks, states: torch.Tensor, head_types: list[int],
                          sinks: list[int], locals_: list[int], block_size, seq_lengths
                          ) -> BlockMask:
    """BlockMask of `states` (B, H, nQ, nK) whose token-streaming heads get element-exact
    windows. The predicate runs once per distinct (sink, local) pair, not once per head; the
    other heads' PARTIAL blocks are causal diagonals, which attention's causal handles."""
    device = states.device
    windows = sorted({(sink, local) for kind, sink, local in zip(head_types, sinks, locals_)
                      if kind < 0})
    window_of_head = torch.tensor([windows.index((sink, local)) if kind < 0 else 0
                                   for kind, sink, local in zip(head_types, sinks, locals_)],
                                  device=device)
    sink = torch.tensor([window[0] for window in windows], device=device)
    local = torch.tensor([window[1] for window in windows], device=device)
    offset = blocks.offset.flatten()

    def visible_element(b, w, q_idx, kv_idx):
        diagonal = q_idx + offset[b]
        in_window = (kv_idx < sink[w]) | (kv_idx > diagonal - local[w])
        return (kv_idx <= diagonal) & in_window

    window_mask = block_mask_from_predicate(
        visible_element, states.shape[0], len(windows), *seq_lengths, block_size=block_size,
        device=device, block_states=blocks.token_streaming_states(sink, local))
    streaming_head = torch.tensor([kind < 0 for kind in head_types],
                                  device=device)[None, :, None, None]
    states = torch.where(streaming_head, window_mask.states[:, window_of_head], states)
    if window_mask.element_bits is None:
        return BlockMask.from_states(states, block_size, seq_lengths)
    slots = torch.where(streaming_head, window_mask.element_slots[:, window_of_head], -1)
    return BlockMask.from_states(states, block_size, seq_lengths,
                                 element_bits=window_mask.element_bits, element_slots=slots)


def _check_options(p_dropout, flags: dict, block_m, block_n) -> None:
    for name, flag in flags.items():
        _check_flag(name, flag)
    _check_block_dim("m_block_dim", block_m)
    _check_block_dim("n_block_dim", block_n)
    if flags["exact_streaming"] and not flags["is_causal"]:
        raise ValueError("exact_streaming (token streaming) is causal: pass is_causal=True")
    if not isinstance(p_dropout, (int, float)) or isinstance(p_dropout, bool):
        raise TypeError(f"p_dropout must be a float, got {type(p_dropout).__name__}")
    if not 0.0 <= p_dropout < 1.0:
        raise ValueError(f"p_dropout must be in [0, 1), got {p_dropout}")


def _check_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """What the block states need; attention() checks the rest (dtypes, k/v, sequence bounds)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be a packed (total_q, H, D) tensor, got {got}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2:
            got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be an int32 tensor (B + 1,), got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be (B + 1,), got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int (the longest sequence), got "
                            f"{type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1 (the longest sequence), got {value}")


def _block_sparse_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info,
                            base_blockmask, max_seqlen_q, max_seqlen_k, p_dropout, deterministic,
                            softmax_scale, is_causal, exact_streaming, return_attn_probs,
                            block_m, block_n, caller):
    _check_options(p_dropout, dict(deterministic=deterministic, is_causal=is_causal,
                                   exact_streaming=exact_streaming,
                                   return_attn_probs=return_attn_probs), block_m, block_n)
    _check_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    batch, num_heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    n_q_blocks, n_k_blocks = -(-max_seqlen_q // block_m), -(-max_seqlen_k // block_n)
    if base_blockmask is not None:
        _check_blockmask(base_blockmask, batch, n_q_blocks, n_k_blocks, q.device)
    head_types = _head_types(head_mask_type, num_heads, base_blockmask, caller)
    sinks, locals_ = _streaming_windows(streaming_info, head_types)

    device = q.device
    blocks = _SequenceBlocks(cu_seqlens_q, cu_seqlens_k, n_q_blocks, n_k_blocks, block_m, block_n)
    kinds = torch.tensor(head_types, device=device)[None, :, None, None]
    # block-level visibility of each head, ANDed below with causal (per sequence)
    visible = torch.ones(batch, num_heads, n_q_blocks, n_k_blocks, dtype=torch.bool,
                         device=device)
    if base_blockmask is not None and any(kind > 0 for kind in head_types):
        mask_of_head = torch.tensor([max(kind, 1) - 1 for kind in head_types], device=device)
        visible = torch.where(kinds > 0, base_blockmask[:, mask_of_head] != 0, visible)
    streaming = any(kind < 0 for kind in head_types)
    if streaming and not exact_streaming:
        sink, local = (torch.tensor(values, device=device) for values in (sinks, locals_))
        visible = torch.where(kinds < 0, blocks.block_streaming(sink, local, is_causal), visible)
    # FULL where every element is visible, PARTIAL where causal cuts a block, HIDDEN above the
    # diagonal and past each sequence's end: (B, 1, nQ, nK)
    by_causal = RelativePredicate.make(is_causal).classify(
        max_seqlen_q, max_seqlen_k, block_m, block_n, device=device,
        lengths=(cu_seqlens_q[1:] - cu_seqlens_q[:-1], cu_seqlens_k[1:] - cu_seqlens_k[:-1]))
    states = torch.where(visible, by_causal[:, None], HIDDEN)
    block_size, seq_lengths = (block_m, block_n), (max_seqlen_q, max_seqlen_k)

    if streaming and exact_streaming:
        block_mask = _token_streaming_mask(blocks, states, head_types, sinks, locals_,
                                           block_size, seq_lengths)
    else:
        block_mask = BlockMask.from_states(states, block_size, seq_lengths)

    out, lse = attention(q, k, v, causal=is_causal, softmax_scale=softmax_scale,
                         block_mask=block_mask, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, dropout_p=float(p_dropout),
                         deterministic=deterministic, return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def block_sparse_attn_func(q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info,
                           base_blockmask, max_seqlen_q_, max_seqlen_k_, p_dropout,
                           deterministic=False, softmax_scale=None, is_causal=False,
                           exact_streaming=False, return_attn_probs=False, m_block_dim=128,
                           n_block_dim=128):
    """Per-head dense (0) / streaming (-1) / block-sparse (1) attention over packed sequences.
    Streaming heads stream by blocks of m_block_dim x n_block_dim, or by tokens when
    exact_streaming (which needs is_causal). See the module docstring for shapes and masks."""
    return _block_sparse_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info, base_blockmask,
        max_seqlen_q_, max_seqlen_k_, p_dropout, deterministic, softmax_scale, is_causal,
        exact_streaming, return_attn_probs, m_block_dim, n_block_dim, "block_sparse_attn_func")


def block_streaming_attn_func(q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type,
                              streaming_info, max_seqlen_q, max_seqlen_k, p_dropout,
                              deterministic=False, softmax_scale=None, is_causal=True,
                              return_attn_probs=False):
    """Dense (0) and block-streaming (-1) heads; streaming_info in blocks of 128 tokens."""
    return _block_sparse_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info, None, max_seqlen_q,
        max_seqlen_k, p_dropout, deterministic, softmax_scale, is_causal, False,
        return_attn_probs, ORIGINAL_BLOCK, ORIGINAL_BLOCK, "block_streaming_attn_func")


def token_streaming_attn_func(q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type,
                              streaming_info, max_seqlen_q, max_seqlen_k, deterministic=False,
                              softmax_scale=None, return_attn_probs=False):
    """Causal dense (0) and token-streaming (-1) heads; streaming_info in tokens; no dropout (as
    in the original)."""
    return _block_sparse_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, head_mask_type, streaming_info, None, max_seqlen_q,
        max_seqlen_k, 0.0, deterministic, softmax_scale, True, True, return_attn_probs,
        ORIGINAL_BLOCK, ORIGINAL_BLOCK, "token_streaming_attn_func")


__all__ = ["block_sparse_attn_func", "block_streaming_attn_func", "token_streaming_attn_func"]
