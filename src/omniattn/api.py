"""`omniattn.attention` and `omniattn.explain`: validate, plan (plan.py), build the schedule the
plan asks for, launch."""
from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch

from .autograd import (attention_with_graph, backward_from_output, decode_attention,
                       decode_inputs, forward_parts, kernel_inputs, records_graph,
                       triton_attention)
from .kernels.elementwise import Elementwise, TopkTerm
from .kernels.select import threshold_pairs
from .kernels.schedule import KernelArgs
from .kernels.sequences import PackedSequences, PagedKeys, batch_shape, length_order
from .passes import DECODE_FORWARD, TRITON_BACKWARD
from .plan import (PER_SEQUENCE, REFERENCE, CallForm, CallPlan, ListTiles,
                   groups_rows_by_length, plan_call, reference_plan, topk_refusal, uses_kernels)
from .reference import attention_reference, per_sequence, reference_backward
from .runtime import call_plans
from .schedules import build_schedule, kernel_block_mask
from .validation import (MASK_DTYPES, SUPPORTED_DTYPES, check_block_mask, check_elementwise,
                         check_gradient_inputs, check_options, check_packed, check_paged,
                         check_qkv, check_row_lens, check_topk, known_checked)

DROPOUT_LEVELS = 2 ** 16  # the kernels' dropout draws are 16-bit


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
    check_inputs: bool = True,
    topk: int | None = None,
    topk_scores: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
):
    """Exact attention with every mask on one kernel core, forward and backward. A forward with
    a few query rows per sequence (decoding) and no gradient runs split-KV decoding.

    Args:
        q: (B, Sq, H, D); k, v: (B, Sk, Hk, D) with H % Hk == 0 (GQA/MQA). fp16, bf16 or fp32,
            contiguous in the last dimension, D <= 256. Packed (varlen, with cu_seqlens_q/k):
            q (total_q, H, D), k/v (total_k, Hk, D).
        causal: key j is visible to query i iff j <= i + Sk - Sq (bottom-right aligned, per
            sequence when packed).
        window: (left, right): key j visible iff i + Sk - Sq - left <= j <= i + Sk - Sq + right;
            -1 = unbounded on that side. ANDed with causal.
        softmax_scale: defaults to 1 / sqrt(D).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax.
        attn_mask: bool (True = keep) or numeric (nonzero = keep), broadcastable to
            (B, Hm, Sq, Sk) with Hm in {1, Hk, H}; size-1 dims are read with stride 0. Packed:
            (total_q|1, Hm, max_seqlen_k|1), row i's columns counting from the first key of its
            sequence (the layout of the seed's varlen API).
        attn_bias: fp16/bf16/fp32, broadcastable like attn_mask, added to the scores after the
            softcap; differentiable, its gradient comes back in its own shape (summed over the
            dims it broadcasts, inside the backward pass). The mask is classified per tile by a
            pre-pass: all-kept tiles skip the mask load, all-masked tiles are never loaded.
        block_mask: an omniattn.BlockMask for (Sq, Sk): only its listed blocks are computed; its
            PARTIAL blocks apply its own causal/window predicate and element bitmaps; ANDed with
            causal/window and the other masks. Packed: built for (max_seqlen_q, max_seqlen_k),
            its batch dim (1 or B) indexes the sequences, blocks count from each sequence's start.
        seqlens_k_per_row: int32 (B, Sq) or (B * Sq,) (packed: (total_q,)): query row i sees
            keys [0, len_i) of its sequence, ANDed with every other mask. Key tiles past a query
            tile's longest row are never loaded; those below its shortest skip the predicate.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) offsets of the packed sequences (varlen);
            max_seqlen_q / max_seqlen_k: their longest lengths (computed, with a host sync, if
            None). Each sequence attends only to itself.
        deterministic: the backward pass without atomics: dQ gets programs of its own (which
            recompute the scores), every gradient is written once in a fixed order,
            bitwise-identical run to run. Otherwise dQ may be summed over key tiles in an fp32
            buffer with atomics (summation order varies by ~1 ulp of fp32): the Gluon backward
            on Hopper always, the Triton backward where a tile config asks for it (none of the
            GPU ones today); and under GQA the Triton backward adds the query heads' dK/dV
            into fp32 buffers of the KV heads with atomics. `omniattn.explain` says which
            backward a call takes.
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log; packed:
            (H, total_q)), -inf for a row that sees no key. It is differentiable.
        check_inputs: validate the values of cu_seqlens_*, seqlens_k_per_row, seqused_k and
            the block table's used entries (this syncs with the host). Pass False under
            CUDA-graph capture; out-of-range lengths then cannot fault (they clamp to
            [0, Sk]) but give unspecified results; block-table entries outside the pages are
            read out of bounds, as in FlashAttention. Packed calls replay call plans only unchecked, with
            max_seqlen_q / max_seqlen_k given.
        topk: each query row keeps only the `topk` keys of largest topk_scores among the keys
            every other mask lets it see (ties to the lower key index); a row seeing at most
            topk keys keeps them all. The rows' selection is computed first (O(B x H x Sq)
            threshold pairs, kernels/select.py), then the Triton kernels apply it in their
            predicate and skip the key tiles no row of a query tile keeps (per-key scores).
        topk_scores: fp16/bf16/fp32 scores laid out like attn_bias (its default), broadcast and
            never expanded; they select only: no gradient reaches them (the bias still gets
            its own). A NaN score ranks above +inf (it is kept and shows in the output).
        block_table: int32 (B, max_pages_per_seq): k and v are pages (num_pages, page_size,
            Hk, D), page_size a multiple of 16, and sequence b's keys are pages
            block_table[b, 0], block_table[b, 1], ... in that order: it holds
            max_pages_per_seq x page_size keys, the key dim of attn_mask / attn_bias.
        seqused_k: int32 (B,): sequence b uses its first seqused_k[b] keys (the pages' or a
            contiguous k's); causal and window align to them (bottom-right: the last query row
            sees key seqused_k[b] - 1). Without a block table k/v stay (B, Sk, Hk, D).
            With few query rows and no gradient these run split-KV decoding, which reads the
            pages in place; otherwise each sequence's used keys are gathered into contiguous
            K/V (seqused_k read on the host) and run apart (`explain` says which).

    Returns:
        out like q, in q's dtype (0 on rows that see no key), or (out, lse).

    dropout_p: probability of zeroing each attention probability (the kept ones are scaled by
        1 / (1 - p)); the lse is that of the undropped softmax. The kernels draw a counter-based
        Philox stream seeded from torch's generator (torch.manual_seed reproduces it) and
        regenerate it in the backward pass (p is rounded to a multiple of 2^-16 there: 16-bit
        draws, 8 per Philox call); the CPU reference path draws from torch.rand, so the two
        backends drop different elements.
    """
    # packed sequences whose host work reads no value of cu_seqlens (unchecked, maxima given):
    # their offsets are inputs of the plan like q's
    plain_layout = cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None \
        and max_seqlen_k is None
    unread_offsets = check_inputs is False and max_seqlen_q is not None \
        and max_seqlen_k is not None
    # per-row key lengths whose values were checked before (and not changed since) need no
    # new read: the call's host work then depends on their layout alone
    unread_lengths = seqlens_k_per_row is None or check_inputs is False or (
        plain_layout and check_inputs is True and known_checked(seqlens_k_per_row, k))
    checks = check_inputs if seqlens_k_per_row is None or not unread_lengths or not plain_layout \
        else False
    # pages or spare keys: their values are read unless unchecked, and only their forward
    # without a graph goes through call plans (a graph's forward is planned per sequence)
    paged = block_table is not None or seqused_k is not None

    def call(graph_parts: bool = False):
        return _attention(q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias,
                          block_mask, seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, dropout_p, deterministic, return_lse,
                          checks, topk, topk_scores, block_table, seqused_k, graph_parts)

    if block_mask is None and unread_lengths and (plain_layout or unread_offsets) \
            and isinstance(dropout_p, (int, float)) and dropout_p == 0 \
            and (not paged or check_inputs is False):
        inputs = (q, k, v, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, seqlens_k_per_row,
                  block_table, seqused_k, topk_scores)
        graph = records_graph(q, k, v, attn_bias)
        key = call_plans.signature(inputs, (graph, causal, window, softmax_scale, softcap,
                                            deterministic, return_lse, checks,
                                            max_seqlen_q, max_seqlen_k, topk))
        # top-k calls that record a graph keep their ordinary path: their backward's plan
        # (keyed after the forward's) has not been checked with the pairs among its tensors
        if key is not None and not (graph and (paged or topk is not None)):
            if not graph:
                return call_plans.run(key, inputs, call)
            # the forward's work (validation and schedule included) planned inside the Function
            out, lse = attention_with_graph(q, k, v, attn_mask, attn_bias,
                                            lambda: call_plans.run(key, inputs,
                                                                   lambda: call(True)), key)
            return (out, lse) if return_lse else out
    return call()


# attention's keyword arguments and defaults, in its order (explain takes the same)
_OPTIONS = {name: parameter.default
            for name, parameter in inspect.signature(attention).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY}


class _Prepared(NamedTuple):
    """A validated call: its plan, and what its launch needs beside the arguments."""

    plan: CallPlan
    form: CallForm | None  # None on the reference path
    lists: ListTiles | None
    row_lens: torch.Tensor | None  # normalised (B, Sq) or packed (total_q,)
    packed: PackedSequences | None
    paged: PagedKeys | None


def _prepare(q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias, block_mask,
             seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             dropout_p, deterministic, return_lse, check_inputs, topk, topk_scores, block_table,
             seqused_k, graph_parts) -> _Prepared:
    """Validate a call (errors before anything is computed) and plan it."""
    packed_layout = cu_seqlens_q is not None or cu_seqlens_k is not None
    check_qkv(q, k, v, packed_layout, paged=block_table is not None)
    check_options(causal, window, softmax_scale, softcap, dropout_p)
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse),
                       ("check_inputs", check_inputs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    packed = None
    if packed_layout:
        packed = check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              check_inputs)
    elif max_seqlen_q is not None or max_seqlen_k is not None:
        raise ValueError("max_seqlen_q / max_seqlen_k belong to packed inputs: pass them with "
                         "cu_seqlens_q and cu_seqlens_k")
    paged, keys = None, k  # keys: what masks and lengths are checked against
    if block_table is not None or seqused_k is not None:
        paged = check_paged(q, k, block_table, seqused_k, packed_layout, check_inputs)
        keys = paged.logical_keys(q, k)
        if block_mask is not None:
            raise ValueError("block_mask with block_table / seqused_k is not supported yet")
    if block_mask is not None:
        check_block_mask(block_mask, q, k, packed)
    if attn_mask is not None:
        check_elementwise("attn_mask", attn_mask, MASK_DTYPES, q, keys, packed)
    if attn_bias is not None:
        check_elementwise("attn_bias", attn_bias, SUPPORTED_DTYPES, q, keys, packed)
    check_topk(topk, topk_scores, attn_bias, q, keys, packed)
    row_lens = None
    if seqlens_k_per_row is not None:
        row_lens = check_row_lens(seqlens_k_per_row, q, keys, packed, check_inputs)
    backward_needed = graph_parts or records_graph(q, k, v, attn_bias)
    if not uses_kernels(q):
        return _Prepared(reference_plan(q, backward_needed), None, None, row_lens, packed, paged)
    if topk is not None and torch.compiler.is_compiling():
        return _Prepared(reference_plan(q, backward_needed, topk_refusal()), None, None,
                         row_lens, packed, paged)
    args = KernelArgs.make(q.shape[-1], causal, window, softmax_scale, softcap)
    # per-row key lengths alone: each batch's rows in length order, key ranges from the lengths
    row_order = row_lens is not None and not args.masked and packed is None \
        and block_mask is None and attn_mask is None and attn_bias is None and dropout_p == 0 \
        and topk is None and groups_rows_by_length(q.shape[1], q.shape[-1], q.dtype)
    heads = q.shape[-2]
    if topk is not None and topk >= _keys_per_sequence(keys, packed):
        topk = None  # every row keeps every key it sees
    form = CallForm(
        q, k, v, args, mask=Elementwise.of(attn_mask, heads) if attn_mask is not None else None,
        bias=Elementwise.of(attn_bias, heads) if attn_bias is not None else None,
        bias_grad=attn_bias is not None and attn_bias.requires_grad and backward_needed,
        row_lens=row_lens, row_order=row_order, packed=packed,
        block_mask=kernel_block_mask(block_mask, args, attn_mask, row_lens, packed),
        dropout=dropout_p > 0, deterministic=deterministic, paged=paged,
        topk_scores=None if topk is None else Elementwise.of(
            attn_bias if topk_scores is None else topk_scores, heads))
    plan, lists = plan_call(form, backward_needed)
    return _Prepared(plan, form, lists, row_lens, packed, paged)


def _keys_per_sequence(keys: torch.Tensor, packed: PackedSequences | None) -> int:
    """The most keys a row may see: Sk, or the longest packed sequence's."""
    return packed.max_seqlen_k if packed is not None else keys.shape[1]


def explain(q, k, v, **options) -> CallPlan:
    """What `attention(q, k, v, **options)` would run, without running it: the backend and kernel
    of its forward and of its backward, their tiles and schedule, and why each faster kernel was
    refused. `print(omniattn.explain(...))` reads it; launches nothing (a block mask may be
    converted to the blocks the kernels walk, as the call would, and cached). Options are
    `attention`'s keywords, validated as it validates them."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}; it takes "
                        f"attention's: {', '.join(_OPTIONS)}")
    values = {**_OPTIONS, **options}
    return _prepare(q, k, v, *values.values(), graph_parts=False).plan


def _attention(q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias, block_mask,
               seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, deterministic, return_lse, check_inputs, topk=None, topk_scores=None,
               block_table=None, seqused_k=None, graph_parts=False):
    """`attention` past its call plans (arguments in its order). graph_parts: the forward of a
    call recording a graph, as attention_with_graph's forward gives it (see forward_parts)."""
    plan, form, lists, row_lens, packed, paged = _prepare(
        q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias, block_mask,
        seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        deterministic, return_lse, check_inputs, topk, topk_scores, block_table, seqused_k,
        graph_parts)
    if paged is not None and plan.forward.kernel in (REFERENCE, PER_SEQUENCE):
        # the reference, or an ordinary call, per sequence
        options = dict(causal=causal, window=window, softmax_scale=softmax_scale,
                       softcap=float(softcap), dropout_p=float(dropout_p), topk=topk)
        attend = functools.partial(attention_reference, **options) if form is None else \
            functools.partial(attention, deterministic=deterministic, check_inputs=False,
                              **options)
        out, lse = per_sequence(attend, q, k, v, paged.block_table, paged.seqused_k,
                                attn_mask, attn_bias, row_lens, topk_scores)
        return (out, lse) if return_lse else out
    if plan.forward.kernel == DECODE_FORWARD:
        _, topk_inputs = _topk_inputs(topk, topk_scores, attn_bias, form, row_lens, packed)
        out, lse = decode_attention(decode_inputs(q, k, v, form.args, attn_mask, attn_bias,
                                                  row_lens, paged, *topk_inputs))
        return (out, lse) if return_lse else out
    if form is None:
        out, lse = attention_reference(q, k, v, causal=causal, window=window,
                                       softmax_scale=softmax_scale, softcap=float(softcap),
                                       attn_mask=attn_mask, attn_bias=attn_bias,
                                       block_mask=block_mask, seqlens_k_per_row=row_lens,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       dropout_p=float(dropout_p), return_lse=True, topk=topk,
                                       topk_scores=topk_scores)
        return (out, lse) if return_lse else out
    # a fresh Philox seed per call from torch's (CPU) generator: torch.manual_seed makes the
    # dropout pattern reproducible, and drawing it needs no device sync
    seed = int(torch.randint(2, 2 ** 31 - 1, ())) if dropout_p > 0 else 0
    # the kernels draw 16-bit numbers: p on their grid keeps the 1 / (1 - p) scale exact
    kernel_p = round(dropout_p * DROPOUT_LEVELS) / DROPOUT_LEVELS
    call = _kernel_call(q, k, v, plan, form, lists, row_lens, packed, attn_mask, attn_bias,
                        (kernel_p, seed), deterministic, topk, topk_scores)
    if graph_parts:
        return forward_parts(call)
    out, lse = triton_attention(call)
    return (out, lse) if return_lse else out


def _kernel_call(q, k, v, plan: CallPlan, form: CallForm, lists: ListTiles | None, row_lens,
                 packed, attn_mask, attn_bias, dropout: tuple[float, int], deterministic,
                 topk: int | None, topk_scores: torch.Tensor | None):
    """The kernels' call (kernel_inputs) of a prepared call: its rows in length order where the
    form asks, its rows' top-k threshold pairs, its lists built at the plan's tiles."""
    args, row_order = form.args, None
    if form.row_order:
        # q, out and lse stay in the caller's order: the kernels read and write each row where
        # it is and tile the rows (and their lengths) in this order
        row_order, row_lens = length_order(row_lens, k.shape[1])
    term, topk_inputs = _topk_inputs(topk, topk_scores, attn_bias, form, row_lens, packed)
    schedule = None
    if lists is not None and q.numel() and k.numel():
        schedule, args = build_schedule(form, lists, attn_mask, backward=plan.backward_needed,
                                        topk=term)
    # without a recorded gradient the backward is never planned; the Triton backward, which
    # serves every call, stands in for it
    backward = plan.backward.kernel if plan.backward_needed else TRITON_BACKWARD
    return kernel_inputs(q, k, v, args, (plan.forward.kernel, backward), schedule,
                         attn_mask, attn_bias, row_lens, packed, dropout, deterministic,
                         row_order, *topk_inputs)


def _topk_inputs(topk: int | None, topk_scores: torch.Tensor | None,
                 attn_bias: torch.Tensor | None, form: CallForm, row_lens,
                 packed) -> tuple[TopkTerm | None, tuple]:
    """The call's top-k term and the op's top-k inputs (its scores as given, or attn_bias, and
    the rows' threshold pairs); (None, (None, None)) without one."""
    if form.topk_scores is None:
        return None, (None, None)
    term = TopkTerm(form.topk_scores, _topk_pairs(topk, form, row_lens, packed))
    return term, (attn_bias if topk_scores is None else topk_scores, term.pairs)


def _topk_pairs(topk: int, form: CallForm, row_lens, packed) -> torch.Tensor:
    """int32 (2, B, Hs, Sq|1) (packed: (2, 1, Hs, total_q)): the rows' threshold pairs of
    kernels/select.py, thresholds then last ties (TopkTerm.pairs). Paged or partly used keys:
    each sequence selects among its used keys (seqused_k), of those it can hold."""
    q, k, paged = form.q, form.k, form.paged
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    if paged is not None:
        seqlen_k = paged.seqlen_k
    return threshold_pairs(topk, form.topk_scores, form.args, batch, seqlen_q, seqlen_k,
                           q.shape[-2], k.shape[-2], mask=form.mask, block_mask=form.block_mask,
                           row_lens=row_lens, packed=packed,
                           total_q=q.shape[0] if packed is not None else None,
                           seqused_k=paged.seqused_k if paged is not None else None)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None = None,
                       **options):
    """The backward of `attention(q, k, v, **options)` alone, from a given out and lse: no
    forward runs. The plan, masks and schedule are the call's, as `attention` builds them.

    Args:
        dout: the gradient reaching out, like q; out: like q; lse: float32 (B, H, Sq) (packed:
            (H, total_q)); dlse: the gradient reaching lse, like lse, or None.
        options: `attention`'s keywords (dropout_p must be 0: its draws belong to a forward).

    Returns:
        (dq, dk, dv, dbias): like q, k, v and attn_bias; dbias None unless attn_bias requires
        grad. The gradients of the softmax p = exp(s - lse): with attention's own out and lse,
        those of its graph; with a larger softmax's out and lse (this call's keys part of its
        keys, as the pieces of omniattn.distributed's ring), this part's share of its
        gradients.
    """
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"attention_backward() got unexpected keyword arguments "
                        f"{sorted(unknown)}; it takes attention's: {', '.join(_OPTIONS)}")
    values = {**_OPTIONS, **options}
    plan, form, lists, row_lens, packed, paged = _prepare(q, k, v, *values.values(),
                                                          graph_parts=True)
    if paged is not None:
        raise NotImplementedError("attention_backward with block_table / seqused_k is not "
                                  "supported: gather each sequence's keys first")
    check_gradient_inputs(dout, out, lse, dlse, q, values["dropout_p"])
    attn_bias = values["attn_bias"]
    bias_grad = attn_bias is not None and attn_bias.requires_grad
    # the kernels take a one-column bias's gradient from dlse alone (exact for their own lse
    # only): the reference sums it over the keys
    if form is None or (bias_grad and attn_bias.shape[-1] == 1):
        reference_options = {name: values[name] for name in _REFERENCE_OPTIONS}
        return reference_backward(dout, q, k, v, out, lse, dlse, bias_grad=bias_grad,
                                  seqlens_k_per_row=row_lens, **reference_options)
    call = _kernel_call(q, k, v, plan, form, lists, row_lens, packed, values["attn_mask"],
                        attn_bias, (0.0, 0), values["deterministic"], values["topk"],
                        values["topk_scores"])
    return backward_from_output(call, dout, out, lse, dlse, bias_grad)


# attention's keywords the reference takes as they are (seqlens_k_per_row: once validated)
_REFERENCE_OPTIONS = ("causal", "window", "softmax_scale", "softcap", "attn_mask", "attn_bias",
                      "block_mask", "cu_seqlens_q", "cu_seqlens_k", "topk", "topk_scores")
