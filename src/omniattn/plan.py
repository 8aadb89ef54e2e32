"""The plan of a call: which backend and kernel run its forward and its backward, at which tiles
over which schedule, and why each faster candidate was refused. One place decides: `attention`
builds its lists at the plan's tiles and the launchers launch the kernels it names;
`omniattn.explain` prints it without launching anything.

Candidates, fastest first: split-KV decoding (`fwd_decode`) for a forward with a few query
rows per sequence and no gradient; on Hopper the warp-specialised Gluon kernels (`fwd_hopper`,
`bwd_hopper`, `bwd_hopper_wide` at head dims it splits), else the Triton kernels (`fwd`, `bwd`);
CPU tensors take the exact PyTorch `reference` unless TRITON_INTERPRET=1 runs the Triton kernels;
top-k calls run the Triton kernels, split-KV decoding included (rows' threshold pairs from
kernels/select.py), or the reference while torch.compile traces them. Paged or partly used
keys (`block_table`, `seqused_k`) that split-KV does not take run `per_sequence`: each
sequence's keys gathered (or sliced) and attended as a contiguous call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .backends.gluon_sm90.backward import hopper_backward_refusal
from .backends.gluon_sm90.blocks import gluon_refusal
from .backends.gluon_sm90.configs import (hopper_backward_config, hopper_backward_splits_head_dim,
                                          hopper_forward_config)
from .backends.gluon_sm90.forward import hopper_forward_refusal
from .backends.triton.backward import backward_tiles
from .backends.triton.configs import (DECODE_MAX_QUERY_ROWS, backward_config, decode_config,
                                      forward_config)
from .kernels.elementwise import Elementwise
from .kernels.schedule import KernelArgs
from .kernels.sequences import PackedSequences, PagedKeys, tma_compatible
from .passes import (DECODE_FORWARD, GLUON_BACKWARD, GLUON_BACKWARD_WIDE, GLUON_FORWARD,
                     TRITON_BACKWARD, TRITON_FORWARD)
from .predicate import RelativePredicate
from .runtime.switches import interpreting, tma_enabled

REFERENCE = "reference"
# an element mask's lists with a left window bound keep the Triton forward's 64 x 64 tiles, which
# waste less of the window's edges than the Gluon 128 x 128 ones. H100, B2 H16 4k, a 75% random mask
# + key bias, window (1024, 0), forward kernel ms: 0.284-0.288 / 0.297-0.303 Gluon
_LEFT_WINDOW_MASK = "an element mask with a left window bound keeps the Triton forward's finer " \
    "tiles (0.284-0.288 against 0.297-0.303 ms Gluon, H100 4k)"


# a Gluon forward that read the pairs (key bias folded, 128 x 128 lists) ran slower than the
# Triton one, whose 64 x 64 lists leave more tiles out. H100, B1 H16/4 128k causal K 2048, whole
# forward call: 225 against 189 ms; B2 H16 4k K 1024: 2.46 against 1.77 ms (docs/perf/topk.md)
_TOPK = "top-k: the Triton kernels read the rows' threshold pairs (a Gluon forward that read " \
    "them ran slower: 225 against 189 ms, H100 128k)"


@dataclass(frozen=True)
class Refusal:
    """A faster kernel that does not run this pass, and why."""

    kernel: str
    reason: str


@dataclass(frozen=True)
class PassPlan:
    """What runs one pass: `kernel` over `schedule` at (block_m, block_n) `tiles` (None where
    the reference runs), and the faster kernels refused."""

    kernel: str
    schedule: str
    tiles: tuple[int, int] | None = None
    refused: tuple[Refusal, ...] = ()

    def describe(self, name: str) -> list[str]:
        tiles = f" at {self.tiles[0]} x {self.tiles[1]} tiles" if self.tiles else ""
        lines = [f"{name}: {self.kernel}{tiles}, {self.schedule}"]
        lines += [f"  not {r.kernel}: {r.reason}" for r in self.refused]
        return lines


@dataclass(frozen=True)
class CallPlan:
    """The plan of one `attention` call: its forward and its backward (what a gradient would
    run; `backward_needed` says whether the call records one). A call without a gradient
    plans its backward only if asked (`explain`): its refusal checks are half of a forward's
    planning time."""

    forward: PassPlan
    plan_backward: Callable[[], PassPlan] = field(repr=False, compare=False)
    backward_needed: bool

    @property
    def backward(self) -> PassPlan:
        return self.plan_backward()

    @property
    def backend(self) -> str:
        return REFERENCE if self.forward.kernel == REFERENCE else "triton"

    def __str__(self) -> str:
        needed = "" if self.backward_needed else " (if a gradient is asked for)"
        return "\n".join(self.forward.describe("forward")
                         + self.backward.describe(f"backward{needed}"))


def _backward_planner(plan_backward: Callable[[], PassPlan],
                      backward_needed: bool) -> Callable[[], PassPlan]:
    """plan_backward, run now when the call records a gradient (its backward reads the plan),
    else on each request."""
    if not backward_needed:
        return plan_backward
    backward = plan_backward()
    return lambda: backward


@dataclass(frozen=True)
class CallForm:
    """What the plan reads of a validated call: tensors for their device, dtype, shapes and
    strides (never their values) and the masks' forms.
    block_mask: the mask at the blocks the kernels walk (coarsened where needed: `bits` then
    says it carries element bitmaps); row_order: per-row key lengths alone, rows in length
    order (no lists)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    args: KernelArgs
    mask: Elementwise | None = None
    bias: Elementwise | None = None
    bias_grad: bool = False
    row_lens: torch.Tensor | None = None
    row_order: bool = False
    packed: PackedSequences | None = None
    block_mask: object = None
    dropout: bool = False
    deterministic: bool = False
    given_lists: bool = False  # lists built by the caller (the launchers' own tests)
    paged: PagedKeys | None = None  # block_table / seqused_k: k and v hold pages or spare keys
    topk_scores: Elementwise | None = None  # a top-k call's scores (rows' pairs come later)

    @property
    def full_bias(self) -> bool:
        return self.bias is not None and self.bias.spans_queries_and_keys

    @property
    def explicit(self) -> bool:
        """Whether the call walks explicit lists (block mask, element mask, lengths not in
        length order, top-k: its tile states skip the tiles no row keeps)."""
        return self.given_lists or self.block_mask is not None or self.mask is not None \
            or (self.row_lens is not None and not self.row_order) or self.topk_scores is not None

    @property
    def bits(self) -> bool:
        return self.block_mask is not None and self.block_mask.kernel_bits is not None


@dataclass(frozen=True)
class ListTiles:
    """The (block_m, block_n) tiles of each pass's explicit lists, and why the forward's are
    not the Gluon forward's (None where they are)."""

    forward: tuple[int, int]
    dq: tuple[int, int]
    dkdv: tuple[int, int]
    launch: tuple[tuple[int, int], tuple[int, int]]  # (warps, stages) of the Triton fwd, bwd
    gluon_refusal: str | None


def _kernel_tile(block: int, preferred: int) -> int:
    """Largest power-of-two tile <= preferred (>= 16) dividing the mask's block."""
    tile = preferred
    while block % tile:
        tile //= 2
    return tile


def _sparse(form: CallForm) -> bool:
    """Per-row lengths alone, or a block mask without PARTIAL blocks, leave most visited tiles
    FULL: the dense (or causal) tiles stay the best; masks and PARTIAL blocks take the sparse
    ones."""
    return form.mask is not None or form.args.masked or form.topk_scores is not None or (
        form.block_mask is not None and form.block_mask.has_partial_blocks)


def _gluon_lists_refusal(form: CallForm) -> str | None:
    """Why the forward lists are not built at the Gluon forward's tiles (None where they are)."""
    if form.topk_scores is not None:
        return _TOPK
    if form.row_lens is not None:
        return "per-row key lengths with other masks (their lists at the Triton forward's tiles)"
    if form.packed is not None:
        return "packed sequences with a mask"
    if form.dropout:
        return "dropout"
    if form.mask is not None and form.args.has_left:
        return _LEFT_WINDOW_MASK
    full_bias = form.bias.tensor if form.full_bias else None
    refusal = gluon_refusal(form.q, form.args, full_bias)
    if refusal is not None:
        return refusal
    if form.block_mask is not None:
        if form.bits:
            return "a block mask with element bitmaps (blocks not multiples of its tiles, or " \
                "its predicate cut by other masks)"
        tile = hopper_forward_config(form.q.shape[-1], form.full_bias)
        block_q, block_k = form.block_mask.block_size
        if block_q % tile.block_m or block_k % tile.block_n:
            return f"block mask blocks {block_q} x {block_k} are not multiples of its " \
                f"{tile.block_m} x {tile.block_n} tiles"
    return None


def list_tiles(form: CallForm) -> ListTiles:
    """The tiles of an explicit schedule's lists, each pass at its kernel's: the forward's at
    the Gluon forward's where it can walk them, the backward's at the Triton backward's (which
    the Gluon backward shares); a block mask's tiles divide its blocks."""
    head_dim, dtype = form.q.shape[-1], form.q.dtype
    refusal = _gluon_lists_refusal(form)
    elementwise = form.mask is not None or form.bias is not None or form.topk_scores is not None
    fwd = forward_config(head_dim, dtype, masked=_sparse(form), elementwise=elementwise,
                         gluon=refusal is None, full_bias=form.full_bias)
    bwd = backward_config(head_dim, dtype, masked=_sparse(form), full_bias=form.full_bias)
    tiles = [(fwd.block_m, fwd.block_n), (bwd.block_m2, bwd.block_n2), (bwd.block_m1, bwd.block_n1)]
    if form.block_mask is not None:
        block_q, block_k = form.block_mask.block_size
        tiles = [(_kernel_tile(block_q, m), _kernel_tile(block_k, n)) for m, n in tiles]
    return ListTiles(*tiles, ((fwd.num_warps, fwd.num_stages), (bwd.num_warps, bwd.num_stages)),
                     refusal)


def groups_rows_by_length(seqlen_q: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a call whose only mask is per-row key lengths (no causal / window / other mask,
    bias, dropout or packing: the caller's condition) runs with each batch's query rows reordered
    by length, longest first; this function adds the size condition (two query tiles or more).
    A query tile then holds rows of similar lengths, so it is FULL up to its shortest row and
    skips every key tile past its longest, where rows in their own order leave almost every
    tile PARTIAL (uniform lengths: H100 8k fwd 2.54 -> 1.29 ms of kernels, about half the tiles
    visited). Rows are independent given K and V, so the result is the same; the kernels then
    take each tile's key range from the lengths (no schedule lists) and read and write every
    row where the caller has it (no copies in the new order)."""
    return seqlen_q > forward_config(head_dim, dtype).block_m


def _schedule_name(form: CallForm) -> str:
    if form.row_order:
        return "per-row key lengths, rows in length order (key ranges from the lengths)"
    if form.explicit:
        what = [name for name, given in (("block mask", form.block_mask is not None),
                                         ("element mask", form.mask is not None),
                                         ("per-row key lengths", form.row_lens is not None),
                                         ("top-k tile states", form.topk_scores is not None),
                                         ("given", form.given_lists))
                if given]
        return f"explicit lists ({' + '.join(what)})"
    predicate = RelativePredicate(form.args.window_left, form.args.window_right)
    if predicate.unbounded:
        kind = "dense"
    elif predicate == RelativePredicate.make(causal=True):
        kind = "causal"
    else:
        kind = f"window ({predicate.left}, {predicate.right})"
    return f"{kind}, implicit (tile ranges from Sq, Sk and the window; no lists)"


def _triton_tiles(form: CallForm, lists: ListTiles | None, backward: bool) -> tuple[int, int]:
    """The tiles the Triton forward / the Triton backward (its dK/dV programs) run this call at."""
    head_dim, dtype, args = form.q.shape[-1], form.q.dtype, form.args
    if lists is not None:
        return lists.dkdv if backward else lists.forward
    if backward:
        cfg = backward_tiles(head_dim, dtype, args, False, form.bias, form.row_lens is not None,
                             form.packed is not None, bool(form.dropout))
        return cfg.block_m1, cfg.block_n1
    tma = tma_enabled(form.q.device) and tma_compatible(form.q, form.k, form.v)
    cfg = forward_config(head_dim, dtype, args.masked, form.bias is not None, tma)
    return cfg.block_m, cfg.block_n


def _call_refusal(form: CallForm) -> str | None:
    """What no Gluon kernel of either pass takes, or None."""
    if form.topk_scores is not None:
        return _TOPK
    if form.bits:
        return "a block mask with element bitmaps"
    if form.row_lens is not None and not form.row_order:
        return "per-row key lengths with other masks (walked as lists)"
    if form.packed is not None and form.row_lens is not None:
        return "packed sequences with per-row key lengths"
    if form.dropout:
        return "dropout"
    return None


def forward_pass(form: CallForm, lists: ListTiles | None) -> PassPlan:
    """The forward's kernel: the Gluon forward where it applies, else the Triton forward."""
    refusal = _call_refusal(form)
    if refusal is None:
        schedule_tiles = lists.forward if lists is not None else None
        refusal = hopper_forward_refusal(form.q, form.k, form.v, form.args, schedule_tiles,
                                         form.bias, form.packed, form.row_lens)
        if refusal is not None and lists is not None and lists.gluon_refusal is not None \
                and schedule_tiles != _gluon_forward_tiles(form):
            refusal = lists.gluon_refusal
    schedule = _schedule_name(form)
    if refusal is None:
        return PassPlan(GLUON_FORWARD, schedule, _gluon_forward_tiles(form))
    return PassPlan(TRITON_FORWARD, schedule, _triton_tiles(form, lists, False),
                    (Refusal(GLUON_FORWARD, refusal),))


def _gluon_forward_tiles(form: CallForm) -> tuple[int, int] | None:
    plain = not form.explicit and form.bias is None and form.packed is None \
        and form.row_lens is None
    cfg = hopper_forward_config(form.q.shape[-1], form.full_bias, plain)
    return None if cfg is None else (cfg.block_m, cfg.block_n)


def _gluon_backward_refusal(form: CallForm, lists: ListTiles | None) -> str | None:
    refusal = _call_refusal(form)
    if refusal is not None:
        return refusal
    if form.deterministic:
        return "deterministic=True (its dQ is summed by atomics, in no fixed order)"
    if form.q.numel() == 0 or form.k.numel() == 0:
        return "an empty call"
    # a bias with one column for all keys gets its gradient from lse, not from a kernel
    bias_grad = form.bias_grad and not form.bias.cols_shared
    return hopper_backward_refusal(form.q, form.k, form.v, form.args,
                                   lists.dkdv if lists is not None else None, form.mask,
                                   form.bias, bias_grad, form.packed)


def backward_pass(form: CallForm, lists: ListTiles | None) -> PassPlan:
    """The backward's kernel: a Gluon backward where one applies, else the Triton backward
    (deterministic: every gradient written once, in a fixed order)."""
    refusal = _gluon_backward_refusal(form, lists)
    schedule = _schedule_name(form)
    head_dim = form.q.shape[-1]
    gluon = GLUON_BACKWARD_WIDE if hopper_backward_splits_head_dim(head_dim) else GLUON_BACKWARD
    if refusal is None:
        cfg = hopper_backward_config(head_dim)
        return PassPlan(gluon, schedule, (cfg.block_m, cfg.block_n))
    return PassPlan(TRITON_BACKWARD, schedule, _triton_tiles(form, lists, True),
                    (Refusal(gluon, refusal),))


def _reference_reason(q: torch.Tensor) -> str:
    return f"q is on {q.device}: CPU tensors run the exact PyTorch reference (TRITON_INTERPRET=1 " \
        f"runs the Triton kernels in the interpreter)"


def topk_refusal() -> str:
    """Why a top-k call that torch.compile traces runs the reference."""
    return "top-k while torch.compile traces the call: the selection kernels run outside the " \
        "traced ops (the reference selects each chunk of rows in PyTorch)"


def uses_kernels(q: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors too under TRITON_INTERPRET=1."""
    return q.is_cuda or interpreting()


def reference_plan(q: torch.Tensor, backward_needed: bool, reason: str | None = None) -> CallPlan:
    """The plan of a call sent to the exact PyTorch reference: by `uses_kernels` (CPU
    tensors), or for `reason` (what the kernels do not serve yet)."""
    reference = PassPlan(REFERENCE, "queries in chunks, O(chunk x Sk) memory",
                         refused=(Refusal("triton", reason or _reference_reason(q)),))
    return CallPlan(reference, lambda: reference, backward_needed)


PER_SEQUENCE = "per_sequence"  # paged / partly used keys, one contiguous call per sequence


def decode_refusal(form: CallForm, backward_needed: bool) -> str | None:
    """Why split-KV decoding does not run this call's forward (None: it does)."""
    if form.packed is not None:
        return "packed sequences (cu_seqlens)"
    seqlen_q = form.q.shape[1]
    if seqlen_q > DECODE_MAX_QUERY_ROWS:
        return f"{seqlen_q} query rows per sequence, more than {DECODE_MAX_QUERY_ROWS} (the " \
            f"forward's query tiles fill the GPU)"
    if backward_needed:
        return "the call records a gradient (split-KV decoding is forward only)"
    if form.block_mask is not None:
        return "a block mask (its lists are per query tile; split-KV walks each sequence's keys)"
    if form.dropout:
        return "dropout"
    return None


def _decode_pass(form: CallForm) -> PassPlan:
    batch, seqlen_q, num_heads, head_dim = form.q.shape
    group = num_heads // form.k.shape[2]
    paged = form.paged
    cfg = decode_config(head_dim, form.q.dtype, seqlen_q * group,
                        paged is not None and paged.page_size > 0)
    source = f"pages of {paged.page_size} keys through the block table" \
        if paged is not None and paged.page_size else "a contiguous cache"
    used = ", the first seqused_k of each sequence" if paged is not None \
        and paged.seqused_k is not None else ""
    topk = "; top-k: each packed row keeps the keys of its own threshold pair" \
        if form.topk_scores is not None else ""
    return PassPlan(DECODE_FORWARD, f"split-KV: each (batch, KV head)'s keys split over "
                    f"programs, partial outputs merged by their LSE; {group} query heads x "
                    f"{seqlen_q} rows packed per tile; K/V from {source}{used}{topk}",
                    (cfg.block_m, cfg.block_n))


def _per_sequence_pass(form: CallForm, refused: tuple[Refusal, ...] = ()) -> PassPlan:
    how = "gathered from its pages" if form.paged.page_size else "sliced (a view)"
    return PassPlan(PER_SEQUENCE, f"each sequence's used keys {how} into contiguous K/V "
                    f"(seqused_k read on the host), then attended as a contiguous call with "
                    f"its own plan (omniattn.explain of that call)", refused=refused)


def _with_refusal(pass_plan: PassPlan, refusal: Refusal) -> PassPlan:
    return PassPlan(pass_plan.kernel, pass_plan.schedule, pass_plan.tiles,
                    (refusal, *pass_plan.refused))


def plan_call(form: CallForm, backward_needed: bool) -> tuple[CallPlan, ListTiles | None]:
    """The plan of a call on the kernels (`uses_kernels`), and the tiles its explicit lists are
    built at (None: implicit, or a kernel that builds none). Split-KV decoding where it applies;
    a call with pages or spare keys it refuses runs per sequence."""
    refusal = decode_refusal(form, backward_needed)
    if form.paged is not None:
        backward = _backward_planner(lambda: _per_sequence_pass(form), backward_needed)
        if refusal is None:
            return CallPlan(_decode_pass(form), backward, backward_needed), None
        forward = _per_sequence_pass(form, (Refusal(DECODE_FORWARD, refusal),))
        return CallPlan(forward, backward, backward_needed), None
    lists = list_tiles(form) if form.explicit else None
    backward = _backward_planner(lambda: backward_pass(form, lists), backward_needed)
    if refusal is None:  # the lists serve only the backward's description: none are built
        return CallPlan(_decode_pass(form), backward, backward_needed), None
    forward = forward_pass(form, lists)
    if form.q.shape[1] <= DECODE_MAX_QUERY_ROWS:  # decode-shaped: say why not split-KV
        forward = _with_refusal(forward, Refusal(DECODE_FORWARD, refusal))
    return CallPlan(forward, backward, backward_needed), lists
