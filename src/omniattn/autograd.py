"""Forward and backward registered as torch custom ops (with fake implementations), joined by
torch.library.register_autograd: traceable by torch.compile(fullgraph=True). Eager calls on plain
tensors take the same implementations through an autograd.Function (no dispatcher hops).
Split-KV decoding is a forward-only op of its own (`decode_attention`)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .kernels.elementwise import Elementwise, TopkTerm
from .kernels.schedule import KernelArgs, Schedule
from .kernels.sequences import PackedSequences, PagedKeys, lse_shape
from .passes import attention_backward, attention_forward, decode_forward
from .runtime import call_plans


class ForwardCall(NamedTuple):
    """The forward op's arguments, in its schema's order: an explicit schedule crosses the op
    boundary as its tensors and launch ints (empty lists: implicit schedule); top-k as its
    scores and the rows' threshold pairs (TopkTerm); the plan's kernel of each pass by name
    (plan.py)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    attn_bias: torch.Tensor | None
    row_lens: torch.Tensor | None
    row_order: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    topk_scores: torch.Tensor | None
    topk_pairs: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    softcap: float
    window_left: int
    window_right: int
    dropout_p: float
    dropout_seed: int
    schedule: list
    tiles: list
    deterministic: bool
    forward_kernel: str
    backward_kernel: str


class BackwardCall(NamedTuple):
    """The backward op's arguments, in its schema's order."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None
    attn_mask: torch.Tensor | None
    attn_bias: torch.Tensor | None
    row_lens: torch.Tensor | None
    row_order: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    topk_scores: torch.Tensor | None
    topk_pairs: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    bias_grad: bool
    softmax_scale: float
    softcap: float
    window_left: int
    window_right: int
    dropout_p: float
    dropout_seed: int
    schedule: list
    tiles: list
    deterministic: bool
    kernel: str

    def tensors(self) -> tuple:
        """Its tensors (None where absent), the schedule's last: what a call plan keys."""
        return (*self[:BackwardCall._fields.index("max_seqlen_q")], *self.schedule)


def _rebuild(schedule: list[torch.Tensor], tiles: list[int], attn_mask, attn_bias, num_heads,
             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk_scores, topk_pairs):
    sched = Schedule.from_parts(schedule, tiles) if schedule else None
    mask = Elementwise.of(attn_mask, num_heads) if attn_mask is not None else None
    bias = Elementwise.of(attn_bias, num_heads) if attn_bias is not None else None
    packed = None
    if cu_seqlens_q is not None:
        packed = PackedSequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    topk = None
    if topk_pairs is not None:
        topk = TopkTerm(Elementwise.of(topk_scores, num_heads), topk_pairs)
    return sched, mask, bias, packed, topk


def _forward_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, row_lens: torch.Tensor | None, row_order: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    topk_scores: torch.Tensor | None, topk_pairs: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, softcap: float, window_left: int, window_right: int,
    dropout_p: float, dropout_seed: int, schedule: list[torch.Tensor], tiles: list[int],
    deterministic: bool, forward_kernel: str, backward_kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a `ForwardCall`; `deterministic` and `backward_kernel` are for the backward
    pass (kept in the autograd context)."""
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    sched, mask, bias, packed, topk = _rebuild(schedule, tiles, attn_mask, attn_bias,
                                               q.shape[-2], cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, topk_scores, topk_pairs)
    forward, bits = (sched.forward, sched.bits) if sched is not None else (None, None)
    return attention_forward(q, k, v, args, forward, bits, mask=mask, bias=bias,
                             row_lens=row_lens, packed=packed, dropout=(dropout_p, dropout_seed),
                             row_order=row_order, kernel=forward_kernel, topk=topk)


attention_fwd_op = torch.library.custom_op("omniattn::attention_fwd", _forward_impl,
                                           mutates_args=())


@attention_fwd_op.register_fake
def _(q, k, v, attn_mask, attn_bias, row_lens, row_order, cu_seqlens_q, cu_seqlens_k,
      topk_scores, topk_pairs, max_seqlen_q, max_seqlen_k, softmax_scale, softcap, window_left,
      window_right, dropout_p, dropout_seed, schedule, tiles, deterministic, forward_kernel, backward_kernel):
    return torch.empty_like(q), q.new_empty(lse_shape(q), dtype=torch.float32)


def _backward_impl(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, row_lens: torch.Tensor | None, row_order: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    topk_scores: torch.Tensor | None, topk_pairs: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, bias_grad: bool, softmax_scale: float, softcap: float, window_left: int,
    window_right: int, dropout_p: float, dropout_seed: int, schedule: list[torch.Tensor],
    tiles: list[int], deterministic: bool, kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias) of a `BackwardCall`; dbias is an empty tensor unless bias_grad."""
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    sched, mask, bias, packed, topk = _rebuild(schedule, tiles, attn_mask, attn_bias,
                                               q.shape[-2], cu_seqlens_q, cu_seqlens_k,
                                               max_seqlen_q, max_seqlen_k, topk_scores, topk_pairs)
    dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, args, sched, mask=mask,
                                           bias=bias, bias_grad=bias_grad, dlse=dlse,
                                           row_lens=row_lens, packed=packed,
                                           dropout=(dropout_p, dropout_seed),
                                           deterministic=deterministic, row_order=row_order,
                                           kernel=kernel, topk=topk)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)


attention_bwd_op = torch.library.custom_op("omniattn::attention_bwd", _backward_impl,
                                           mutates_args=())


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_mask, attn_bias, row_lens, row_order, cu_seqlens_q,
      cu_seqlens_k, topk_scores, topk_pairs, max_seqlen_q, max_seqlen_k, bias_grad, softmax_scale,
      softcap, window_left, window_right, dropout_p, dropout_seed, schedule, tiles, deterministic, kernel):
    dbias = torch.empty_like(attn_bias) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output):
    call = ForwardCall(*inputs)
    out, lse = output
    ctx.save_for_backward(call.q, call.k, call.v, out, lse, call.attn_mask, call.attn_bias,
                          call.row_lens, call.row_order, call.cu_seqlens_q, call.cu_seqlens_k,
                          call.topk_scores, call.topk_pairs, *call.schedule)
    ctx.call = call._replace(q=None, k=None, v=None, attn_mask=None, attn_bias=None,
                             row_lens=None, row_order=None, cu_seqlens_q=None, cu_seqlens_k=None,
                             topk_scores=None, topk_pairs=None, schedule=len(call.schedule))


def _gradients(ctx, dout, dlse, backward_fn):
    """(dq, dk, dv, dbias or None) from the context _setup_context filled."""
    (q, k, v, out, lse, attn_mask, attn_bias, row_lens, row_order, cu_seqlens_q, cu_seqlens_k,
     topk_scores, topk_pairs, *schedule) = ctx.saved_tensors
    call = ctx.call
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = backward_fn(BackwardCall(
        dout, q, k, v, out, lse, dlse, attn_mask, attn_bias, row_lens, row_order, cu_seqlens_q,
        cu_seqlens_k, topk_scores, topk_pairs, call.max_seqlen_q, call.max_seqlen_k, bias_grad,
        call.softmax_scale, call.softcap, call.window_left, call.window_right, call.dropout_p, call.dropout_seed,
        schedule, call.tiles, call.deterministic, call.backward_kernel))
    return dq, dk, dv, dbias if bias_grad else None


def _backward(ctx, dout, dlse):
    dq, dk, dv, dbias = _gradients(ctx, dout, dlse, lambda call: attention_bwd_op(*call))
    # gradients mirror the inputs' structure: a list per tensor list; an int list is one leaf
    # (an empty one a list)
    grads = ForwardCall(*[None] * len(ForwardCall._fields))._replace(
        q=dq, k=dk, v=dv, attn_bias=dbias, schedule=[None] * ctx.call.schedule,
        tiles=None if ctx.call.tiles else [])
    return tuple(grads)


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward without the dispatcher, for eager calls: a custom op
    costs host time in every layer it crosses (H100 host, causal 4k fwd+bwd: 1.49 -> 0.95 ms
    per call without it; the kernels run 1.26 ms), so short calls became host-bound. The context
    comes into forward (no setup_context): with one, every apply binds the arguments through
    inspect.signature. forward() gives (out, lse, the implementations' inputs): the call's own
    work, schedule included, or its call plan's replay (call_plans); the backward too replays
    a plan where its signature has one."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, attn_bias, forward, forward_key):
        out, lse, call = forward()
        _setup_context(ctx, call, (out, lse))
        ctx.forward_key = forward_key
        ctx.set_materialize_grads(False)  # an unused lse costs no zero gradient
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # only lse reached the loss
            dout = torch.zeros_like(ctx.saved_tensors[3])  # like out
        dq, dk, dv, dbias = _gradients(ctx, dout, dlse,
                                       functools.partial(_planned_backward, ctx.forward_key))
        return dq, dk, dv, None, dbias, None, None


def _planned_backward(forward_key, call: BackwardCall):
    """_backward_impl(*call), replayed from a call plan where there is one: its host work
    depends only on the signature of its tensors and scalars, dropout's seed aside. Keyed on
    the forward's call plan key where it has one (what follows from it is not keyed again)."""
    tensors = call.tensors()
    key = None
    if call.dropout_p == 0 and not torch.is_grad_enabled():  # no double backward
        if forward_key is None:
            scalars = tuple(call[BackwardCall._fields.index("max_seqlen_q"):
                                 BackwardCall._fields.index("schedule")])
            key = call_plans.signature(tensors, ("backward", *scalars, tuple(call.tiles),
                                                 call.deterministic, call.kernel))
        else:  # new beside the forward's inputs and results: dout, dlse, whether dbias is due
            fresh = (BackwardCall._fields.index("dout"), BackwardCall._fields.index("dlse"))
            key = call_plans.signature_after(forward_key, tensors, fresh,
                                             ("backward", call.bias_grad))
    if key is None:
        return _backward_impl(*call)
    return call_plans.run(key, tensors, lambda: _backward_impl(*call))


def backward_from_output(call: ForwardCall, dout, out, lse, dlse, bias_grad: bool) -> tuple:
    """(dq, dk, dv, dbias or None) of a forward call (kernel_inputs) from an out and lse given
    rather than computed by it (its backward alone), replayed from a call plan where there is
    one."""
    # the launcher reads lse and dlse at the strides of the delta it lays out like a dense lse
    lse, dlse = lse.contiguous(), dlse.contiguous() if dlse is not None else None
    dq, dk, dv, dbias = _planned_backward(None, BackwardCall(
        dout, call.q, call.k, call.v, out, lse, dlse, call.attn_mask, call.attn_bias,
        call.row_lens, call.row_order, call.cu_seqlens_q, call.cu_seqlens_k, call.topk_scores,
        call.topk_pairs, call.max_seqlen_q,
        call.max_seqlen_k, bias_grad, call.softmax_scale, call.softcap, call.window_left,
        call.window_right, call.dropout_p, call.dropout_seed, call.schedule, call.tiles,
        call.deterministic, call.backward_kernel))
    return dq, dk, dv, dbias if bias_grad else None


def kernel_inputs(q, k, v, args: KernelArgs, kernels: tuple[str, str],
                  schedule: Schedule | None = None, attn_mask: torch.Tensor | None = None,
                  attn_bias: torch.Tensor | None = None, row_lens: torch.Tensor | None = None,
                  packed: PackedSequences | None = None, dropout: tuple[float, int] = (0.0, 0),
                  deterministic: bool = False,
                  row_order: torch.Tensor | None = None,
                  topk_scores: torch.Tensor | None = None,
                  topk_pairs: torch.Tensor | None = None) -> ForwardCall:
    """The forward op's call; kernels: the plan's (forward, backward) kernel names; top-k: its
    scores as the caller gave them and the rows' pairs (TopkTerm)."""
    tensors, tiles = (schedule.tensors(), schedule.tiles()) if schedule is not None else ([], [])
    cu_q, cu_k, max_q, max_k = (None, None, 0, 0) if packed is None else (
        packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q, packed.max_seqlen_k)
    return ForwardCall(q, k, v, attn_mask, attn_bias, row_lens, row_order, cu_q, cu_k,
                       topk_scores, topk_pairs, max_q, max_k, args.softmax_scale, args.softcap,
                       args.window_left, args.window_right, *dropout, tensors, tiles,
                       deterministic, *kernels)


def forward_parts(call: ForwardCall) -> tuple:
    """(out, lse, the call's fields): what attention_with_graph's forward gives, from
    kernel_inputs (a plain tuple, as call plans record results)."""
    return (*_forward_impl(*call), tuple(call))


def records_graph(q, k, v, attn_bias) -> bool:
    """Whether a call records a graph (to q, k, v and attn_bias; inputs not yet validated)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v, attn_bias))


def attention_with_graph(q, k, v, attn_mask, attn_bias, forward, forward_key=None) -> tuple:
    """(out, lse) with a graph to (q, k, v, attn_bias), for an eager call on plain tensors;
    forward() runs with no graph recorded and gives forward_parts. forward_key: the call plan
    key forward() ran under, if any (the backward's key builds on it)."""
    return _EagerAttention.apply(q, k, v, attn_mask, attn_bias, forward, forward_key)


def triton_attention(call: ForwardCall):
    """Differentiable kernel attention from kernel_inputs: returns (out, lse); attn_bias gets
    a gradient too. dropout: (p, seed); the backward pass regenerates the same keep decisions
    from the seed. deterministic: the backward pass without atomics (bitwise-identical
    gradients). row_order: the length order of per-row key lengths alone (see
    attention_forward)."""
    q, k, v, attn_mask, attn_bias = call[:5]
    # traced graphs, fake and subclassed tensors and functorch transforms need the ops (their
    # fake implementations and dispatch); plain eager calls skip the dispatcher
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor \
            or torch._C._are_functorch_transforms_active():
        return attention_fwd_op(*call)
    if not records_graph(q, k, v, attn_bias):
        # no graph to record: the Function's apply and context were 13% of a masked forward's
        # Python (CPU, launches mocked: 233 -> 203 us)
        return _forward_impl(*call)
    return attention_with_graph(q, k, v, attn_mask, attn_bias, lambda: forward_parts(call))


class DecodeCall(NamedTuple):
    """The decode op's arguments, in its schema's order: pages or spare keys as their block
    table (page_size: k's second dim when given) and seqused_k; top-k as its scores and the
    rows' threshold pairs (TopkTerm); seqlen_k: the keys a sequence holds."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor | None
    seqused_k: torch.Tensor | None
    attn_mask: torch.Tensor | None
    attn_bias: torch.Tensor | None
    row_lens: torch.Tensor | None
    topk_scores: torch.Tensor | None
    topk_pairs: torch.Tensor | None
    seqlen_k: int
    softmax_scale: float
    softcap: float
    window_left: int
    window_right: int


def _decode_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None,
    seqused_k: torch.Tensor | None, attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, row_lens: torch.Tensor | None,
    topk_scores: torch.Tensor | None, topk_pairs: torch.Tensor | None, seqlen_k: int,
    softmax_scale: float, softcap: float, window_left: int, window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a `DecodeCall`."""
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    heads = q.shape[-2]
    paged = None
    if block_table is not None or seqused_k is not None:
        page_size = k.shape[1] if block_table is not None else 0
        paged = PagedKeys(block_table, seqused_k, page_size, seqlen_k)
    topk = None
    if topk_pairs is not None:
        topk = TopkTerm(Elementwise.of(topk_scores, heads), topk_pairs)
    return decode_forward(
        q, k, v, args, mask=Elementwise.of(attn_mask, heads) if attn_mask is not None else None,
        bias=Elementwise.of(attn_bias, heads) if attn_bias is not None else None,
        row_lens=row_lens, paged=paged, topk=topk)


attention_decode_op = torch.library.custom_op("omniattn::attention_decode", _decode_impl,
                                              mutates_args=())


@attention_decode_op.register_fake
def _(q, k, v, block_table, seqused_k, attn_mask, attn_bias, row_lens, topk_scores, topk_pairs,
      seqlen_k, softmax_scale, softcap, window_left, window_right):
    return torch.empty_like(q), q.new_empty(lse_shape(q), dtype=torch.float32)


def decode_inputs(q, k, v, args: KernelArgs, attn_mask: torch.Tensor | None = None,
                  attn_bias: torch.Tensor | None = None, row_lens: torch.Tensor | None = None,
                  paged: PagedKeys | None = None, topk_scores: torch.Tensor | None = None,
                  topk_pairs: torch.Tensor | None = None) -> DecodeCall:
    """The decode op's call: q (B, Sq, H, D), k/v (B, Sk, Hk, D) or pages with `paged`; row_lens
    normalised (B, Sq); top-k's scores and threshold pairs as the forward op takes them."""
    table, used = (paged.block_table, paged.seqused_k) if paged is not None else (None, None)
    seqlen_k = paged.seqlen_k if paged is not None else k.shape[1]
    return DecodeCall(q, k, v, table, used, attn_mask, attn_bias, row_lens, topk_scores,
                      topk_pairs, seqlen_k, args.softmax_scale, args.softcap, args.window_left,
                      args.window_right)


def decode_attention(call: DecodeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of split-KV decoding, forward only (the plan gives it no call that records a
    graph): through the op where tracing or transforms need it, else straight."""
    if torch.compiler.is_compiling() or type(call.q) is not torch.Tensor \
            or torch._C._are_functorch_transforms_active():
        return attention_decode_op(*call)
    return _decode_impl(*call)
