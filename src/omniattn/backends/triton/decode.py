"""Split-KV decoding: the launcher of decode_kernels.py's split and combine kernels, for calls
with a few query rows per sequence (decoding, speculative decoding), where the forward's grid
(query tiles x batch x heads) would leave most SMs idle. Forward only."""
from __future__ import annotations

import torch

from ...kernels.elementwise import Elementwise, TopkTerm
from ...kernels.schedule import KernelArgs
from ...kernels.sequences import PagedKeys, lse_strides, placeholder, row_strides
from ...kernels.sizes import cdiv, next_power_of_2, padded_head_dim
from ...runtime.launch import launch
from ...runtime.switches import interpreting, sm_count
from .configs import DECODE_COMBINE_WARPS, decode_config, decode_splits
from .decode_kernels import decode_combine_kernel, decode_split_kernel


def visible_key_span(args: KernelArgs, seqlen_q: int, seqlen_k: int) -> int:
    """The most keys one (batch, KV head) row tile sees: Sk, or a window's width."""
    if not args.has_left:
        return seqlen_k
    return min(seqlen_k, args.window_left + seqlen_q + max(args.window_right, 0))


def _tile_form(t: Elementwise | None, group: int) -> tuple[bool, bool]:
    """(given, one row for every packed row of a tile) of a mask, bias or top-k scores: one row
    serves the tile when the tensor has one query row and its heads do not tell a group's query
    heads apart."""
    return t is not None, t is not None and t.rows_shared and t.head_div % group == 0


def _elementwise_operands(t: Elementwise | None, group: int, device) -> tuple:
    """(tensor, (b, h, row, key strides, head divisor), `_tile_form`)."""
    if t is None:
        return placeholder(device, torch.float32), (0, 0, 0, 0, 1), (False, False)
    return t.tensor, (*t.strides, t.head_div), _tile_form(t, group)


def triton_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs,
                  out: torch.Tensor, lse: torch.Tensor, mask: Elementwise | None = None,
                  bias: Elementwise | None = None, row_lens: torch.Tensor | None = None,
                  paged: PagedKeys | None = None, num_splits: int = 0,
                  topk: TopkTerm | None = None) -> None:
    """Writes out (like q) and lse ((B, H, Sq) float32, contiguous rows) of q (B, Sq, H, D)
    over k/v (B, Sk, Hk, D), or pages (num_pages, page_size, Hk, D) with `paged` (its block
    table, seqused_k); 0 and -inf on rows that see no key. mask / bias: (B|1, Hm, Sq|1, Sk|1)
    over the keys a sequence can hold; row_lens int32 (B, Sq). num_splits: programs per (batch,
    KV head, row tile) along the keys, 0 = configs.decode_splits's choice. topk: the rows'
    threshold pairs (2, B, Hs, Sq|1) over each sequence's used keys, and the scores they select
    by, laid out like the bias; the keys a row's pair drops are masked."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_heads_k = k.shape[2]
    group = num_heads // num_heads_k
    seqlen_k = paged.seqlen_k if paged is not None else k.shape[1]
    rows = seqlen_q * group
    cfg = decode_config(head_dim, q.dtype, rows, paged is not None and paged.page_size > 0)
    row_tiles = cdiv(rows, cfg.block_m)
    if num_splits <= 0:
        key_tiles = cdiv(visible_key_span(args, seqlen_q, seqlen_k), cfg.block_n)
        sms = None if interpreting() else sm_count(q.device)
        num_splits = decode_splits(batch * num_heads_k * row_tiles, key_tiles, cfg.block_n, sms)
    if num_splits > 1:
        out_part = torch.empty((num_splits, batch, num_heads_k, rows, head_dim),
                               device=q.device, dtype=torch.float32)
        lse_part = torch.empty((num_splits, batch, num_heads_k, rows), device=q.device,
                               dtype=torch.float32)
    else:  # written straight to out / lse
        out_part = lse_part = placeholder(q.device, torch.float32)
    part_strides = (*out_part.stride()[:4], *lse_part.stride()[:3]) if num_splits > 1 \
        else (0,) * 7
    paged = paged if paged is not None else PagedKeys(None, None, 0, seqlen_k)
    table, table_stride, seqused = paged.operands(q.device)
    mask_tensor, mask_strides, mask_form = _elementwise_operands(mask, group, q.device)
    bias_tensor, bias_strides, bias_form = _elementwise_operands(bias, group, q.device)
    topk_scores, topk_pairs, topk_layout = topk.operands(num_heads) if topk is not None \
        else TopkTerm.placeholder_operands(q.device)
    lens, lens_stride = (row_lens, row_lens.stride(0)) if row_lens is not None \
        else (placeholder(q.device), 0)
    k_strides = (k.stride(0), k.stride(1), k.stride(2))
    v_strides = (v.stride(0), v.stride(1), v.stride(2))
    form = (args.has_right, args.has_left, args.softcap > 0, paged.seqused_k is not None,
            row_lens is not None, num_splits > 1)
    launch(decode_split_kernel, (batch * num_heads_k, row_tiles, num_splits),
           q, k, v, out, lse, out_part, lse_part, table, seqused, lens, mask_tensor, bias_tensor,
           topk_scores, topk_pairs,
           row_strides(q), k_strides, v_strides, row_strides(out), lse_strides(lse),
           part_strides, table_stride, lens_stride, mask_strides, bias_strides, topk_layout,
           (seqlen_q, seqlen_k, num_heads_k, group, num_splits),
           (args.window_left, args.window_right),
           (args.qk_scale_log2, args.softcap_inv_scaled, args.softcap_log2),
           FORM=form, MASK_FORM=mask_form, BIAS_FORM=bias_form,
           TOPK_FORM=_tile_form(topk.scores if topk is not None else None, group),
           HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=cfg.block_m,
           BLOCK_N=cfg.block_n, PAGE_SIZE=paged.page_size,
           DOT_PRECISION=KernelArgs.dot_precision(q.dtype),
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        launch(decode_combine_kernel, (batch * num_heads_k, row_tiles),
               out_part, lse_part, out, lse, part_strides, row_strides(out), lse_strides(lse),
               (seqlen_q, num_heads_k, group, num_splits),
               HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=cfg.block_m,
               BLOCK_S=next_power_of_2(num_splits), num_warps=DECODE_COMBINE_WARPS)
