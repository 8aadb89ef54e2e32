"""What the spawned ranks of the distributed tests run: the cases (method x layout x masks x
heads), each compared on rank 0 with the single-process float64 reference under the 2x rule,
and the bad calls, each expected to fail before any communication. One process group serves
every case of a world size; rank 0 writes a JSON file {case id: "ok" or what failed}."""
from __future__ import annotations

import inspect
import json
import os
import re
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
METHODS = ("ulysses", "ring", "allgather")
LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Shapes:
    """B, the length of one chunk (S = chunk x 2P zigzag; the block masks' block size), H,
    Hk, D."""

    batch: int
    chunk: int
    heads: int
    heads_k: int
    head_dim: int


@dataclass(frozen=True)
class Case:
    method: str
    layout: str
    mask: str
    odd_heads: bool = False  # H and Hk not multiples of P: ring and allgather only

    @property
    def id(self) -> str:
        return f"{self.method}-{self.layout}-{self.mask}" + ("-odd_heads" if self.odd_heads else "")


# every mask, in global positions; ulysses with odd heads is refused (tested among the errors)
MASKS = ("none", "causal", "window", "causal_window", "softcap_scale", "key_bias",
         "block_random_causal", "block_documents", "row_lengths", "everything")
# masks under which some rank sees none of another's keys: the ring skips those shards
SKIPPING_MASKS = ("narrow_window", "band", "window_blocks", "short_rows")
# masks whose ring cases hand rows to lighter ranks at both world sizes (with others: contiguous
# causal, a narrow window at P = 2)
OFFLOADING_MASKS = ("window_fine_blocks",)
# masks run on chunks this many times longer: blocks of 16 (a BlockMask's smallest) that slice
# a chunk finely enough for the ring's hand-offs to balance
CHUNK_SCALE = {"window_fine_blocks": 8}


def cases() -> list[Case]:
    found = [Case(m, layout, mask) for m in METHODS for layout in LAYOUTS for mask in MASKS]
    found += [Case("ring", layout, mask) for layout in LAYOUTS
              for mask in SKIPPING_MASKS + OFFLOADING_MASKS]
    found += [Case(m, layout, mask, odd_heads=True) for m in ("ring", "allgather")
              for layout in LAYOUTS for mask in ("causal", "everything")]
    if "topk" in inspect.signature(_local_attention()).parameters:
        found += [Case(m, layout, "topk") for m in ("ulysses", "allgather") for layout in LAYOUTS]
    return found


def _local_attention():
    import omniattn

    return omniattn.attention


def _arguments(mask: str, shapes: Shapes, seqlen: int, heads: tuple[int, int], device,
               generator) -> dict:
    """The global keyword arguments of a mask case (bias (B, Hm, 1, S), lengths (B, S))."""
    import omniattn

    batch, chunk = shapes.batch, shapes.chunk
    heads_q, heads_k = heads

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    def lengths(longest=seqlen):
        lens = torch.randint(0, longest + 1, (batch, seqlen), generator=generator)
        lens[:, :3] = 0  # rows that see no key
        return lens.to(torch.int32).to(device)

    def random_blocks():
        n = seqlen // chunk
        blocks = torch.rand(batch, heads_q, n, n, generator=generator) < 0.6
        return omniattn.block_mask_from_blocks(blocks.to(device), chunk,
                                               seq_lengths=(seqlen, seqlen))

    if mask == "none":
        return {}
    if mask == "causal":
        return {"causal": True}
    if mask == "window":  # both sides bounded, crossing chunk boundaries
        return {"window": (chunk + 3, chunk // 2 + 1)}
    if mask == "causal_window":
        return {"causal": True, "window": (chunk // 2 + 3, -1)}
    if mask == "softcap_scale":
        return {"softcap": 2.0, "softmax_scale": 0.7, "causal": True}
    if mask == "key_bias":
        return {"causal": True, "attn_bias": randn(batch, heads_k, 1, seqlen)}
    if mask == "block_random_causal":  # per-head lists, causal folded into the parts
        return {"block_mask": random_blocks(), "causal": True}
    if mask == "block_documents":  # element bitmaps in partial blocks
        bounds = torch.tensor([0, chunk // 2 + 3, seqlen // 2 + 5, seqlen - 7, seqlen])
        return {"block_mask": omniattn.document_block_mask(bounds.to(device), chunk,
                                                           causal=True)}
    if mask == "row_lengths":
        return {"seqlens_k_per_row": lengths(), "window": (chunk + 1, 2)}
    if mask == "everything":
        return {"causal": True, "window": (2 * chunk + 1, -1), "softcap": 3.0,
                "attn_bias": randn(1, heads_q, 1, seqlen), "seqlens_k_per_row": lengths(),
                "block_mask": random_blocks()}
    if mask == "narrow_window":  # a chunk's rows see its keys and the chunk's before
        return {"causal": True, "window": (chunk // 2, -1),
                "attn_bias": randn(batch, heads_k, 1, seqlen)}
    if mask == "band":
        return {"window": (chunk // 2, chunk // 2)}
    if mask == "window_blocks":  # the scaling benchmark's case, narrower
        return {"block_mask": omniattn.window_block_mask(seqlen, seqlen, (chunk // 2, 0),
                                                         causal=True, block_size=chunk,
                                                         device=device),
                "attn_bias": randn(1, heads_q, 1, seqlen)}
    if mask == "window_fine_blocks":  # the scaling benchmark's case: a window S/4 at P = 2
        return {"block_mask": omniattn.window_block_mask(seqlen, seqlen, (chunk, 0),
                                                         causal=True, block_size=16,
                                                         device=device),
                "attn_bias": randn(1, heads_q, 1, seqlen)}
    if mask == "short_rows":  # every row's keys lie in the first chunk (rank 0's)
        return {"seqlens_k_per_row": lengths(chunk), "causal": True}
    if mask == "topk":
        return {"causal": True, "topk": chunk // 2 + 1,
                "topk_scores": randn(batch, 1, 1, seqlen), "attn_bias": randn(batch, 1, 1, seqlen)}
    raise ValueError(mask)


def _masked_lse(lse):
    """lse with the rows that see no key at 0 (their lse is -inf), for a finite loss."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _single_process(q, k, v, dout, dlse, kwargs, upcast: bool):
    """(out, lse, dq, dk, dv[, dbias]) of the single-process call: the float64 reference
    (upcast) or plain PyTorch in the inputs' dtype (top-k included)."""
    from omniattn.reference import attention_reference

    kwargs = dict(kwargs)
    leaves = [q, k, v] + ([kwargs["attn_bias"]] if "attn_bias" in kwargs else [])
    leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_()
              for t in leaves]
    if "attn_bias" in kwargs:
        kwargs["attn_bias"] = leaves[3]
    out, lse = attention_reference(*leaves[:3], return_lse=True, upcast=upcast, **kwargs)
    loss = (out * dout.to(out.dtype)).sum() + (_masked_lse(lse) * dlse.to(lse.dtype)).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def _compare(got, exact, plain, dtype) -> None:
    from helpers import max_error

    for name, g, e, p in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, exact, plain):
        assert g.shape == e.shape, f"{name}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        err, base = max_error(g, e), max_error(p, e)
        atol = ATOL[torch.float32 if name == "lse" else dtype]
        assert err <= 2 * base + atol, \
            f"{name}: error {err:.3g} > 2 x single-process {base:.3g} + atol {atol:.1g}"


def run_case(case: Case, shapes: Shapes, device, dtype, seed: int, group=None,
             plans: dict | None = None) -> None:
    """One case on every rank of group (a ProcessGroup, a DeviceMesh or None: all ranks); the
    group's first rank compares (raises AssertionError on a mismatch). plans: where a ring
    case's hand-offs and modelled balance go (`handoff_summary`), by case id."""
    from omniattn import distributed as cp
    from omniattn.distributed.sharding import resolve_group

    shapes = replace(shapes, chunk=shapes.chunk * CHUNK_SCALE.get(case.mask, 1))
    world = dist.get_world_size(resolve_group(group))
    seqlen = shapes.chunk * 2 * world
    heads = (shapes.heads, shapes.heads_k)
    if case.odd_heads:  # MQA, or as many K/V heads as query heads, never a multiple of P
        heads = (2 * world + 1, 1) if case.mask == "causal" else (2 * world + 1,) * 2
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    b, d = shapes.batch, shapes.head_dim
    q, k, v = randn(b, seqlen, heads[0], d), randn(b, seqlen, heads[1], d), \
        randn(b, seqlen, heads[1], d)
    dout, dlse = randn(b, seqlen, heads[0], d), randn(b, heads[0], seqlen).float()
    kwargs = _arguments(case.mask, shapes, seqlen, heads, device, generator)
    if "attn_bias" in kwargs:
        kwargs["attn_bias"] = kwargs["attn_bias"].to(dtype)
    if "topk_scores" in kwargs:
        kwargs["topk_scores"] = kwargs["topk_scores"].to(dtype)

    leaves = [t.clone().requires_grad_() for t in [q, k, v] + (
        [kwargs["attn_bias"]] if "attn_bias" in kwargs else [])]
    shard = {"layout": case.layout, "group": group}
    local = {**kwargs, **{name: cp.shard(kwargs[name], dim=dim, **shard) for name, dim in
                          (("topk_scores", 3), ("seqlens_k_per_row", 1)) if name in kwargs}}
    if "attn_bias" in kwargs:
        local["attn_bias"] = cp.shard(leaves[3], dim=3, **shard)
    sharded = [cp.shard(t, **shard) for t in leaves[:3]]
    if plans is not None and case.method == "ring":
        plans[case.id] = handoff_summary(cp.explain(*sharded, method="ring", **shard, **local))
    out, lse = cp.attention(*sharded, method=case.method, return_lse=True, **shard, **local)
    out, lse = cp.unshard(out, **shard), cp.unshard(lse, dim=2, **shard)
    loss = (out * dout).sum() + (_masked_lse(lse) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    if dist.get_rank(resolve_group(group)) == 0:
        got = (out.detach(), lse.detach(), *grads)
        exact = _single_process(q, k, v, dout, dlse, kwargs, upcast=True)
        plain = _single_process(q, k, v, dout, dlse, kwargs, upcast=False)
        _compare(got, exact, plain, dtype)


def handoff_summary(plan) -> dict:
    """A ring plan's hand-offs and busiest / mean before and after them."""
    def spread(work):
        return max(work) * len(work) / sum(work) if sum(work) else 1.0

    after = plan.balanced_work if plan.balanced_work is not None else plan.rank_work
    return {"offloads": [o.describe() for o in plan.offloads],
            "chains": sorted({o.owner for o in plan.offloads} & {o.helper for o in plan.offloads}),
            "whole": [o.describe() for o in plan.offloads if o.whole],
            "before": spread(plan.rank_work), "after": spread(after)}


def run_backward_without_forward(shapes: Shapes, device, dtype) -> None:
    """The ring's backward runs no forward: counted at the pieces' local calls and at the
    kernels' forward launcher (under the interpreter or on GPUs), the backward makes as many
    local backward calls as the forward made forward calls, and no forward call; causal over
    both layouts (contiguous: rows handed off, whose pieces count where they run)."""
    from omniattn import autograd
    from omniattn import distributed as cp
    from omniattn.distributed import pieces

    calls = {"forward": 0, "backward": 0, "kernel_forward": 0}

    def counted(name, fn):
        return lambda *args, **kwargs: calls.__setitem__(name, calls[name] + 1) \
            or fn(*args, **kwargs)

    saved = (pieces.local_attention, pieces.local_backward, autograd._forward_impl)
    pieces.local_attention = counted("forward", saved[0])
    pieces.local_backward = counted("backward", saved[1])
    autograd._forward_impl = counted("kernel_forward", saved[2])
    try:
        world = dist.get_world_size()
        seqlen = shapes.chunk * 2 * world
        generator = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(shapes.batch, seqlen, heads, shapes.head_dim, generator=generator)
                   .to(device, dtype).requires_grad_()
                   for heads in (shapes.heads, shapes.heads_k, shapes.heads_k))
        bias = torch.randn(1, shapes.heads_k, 1, seqlen, generator=generator).to(device, dtype)
        bias.requires_grad_()
        for layout in LAYOUTS:
            calls.update(forward=0, backward=0, kernel_forward=0)
            out = cp.attention(*(cp.shard(t, layout=layout) for t in (q, k, v)),
                               method="ring", causal=True, layout=layout,
                               attn_bias=cp.shard(bias, dim=3, layout=layout))
            forward_calls = calls["forward"]
            calls.update(forward=0, kernel_forward=0)
            out.square().sum().backward()
            expected = {"forward": 0, "backward": forward_calls, "kernel_forward": 0}
            assert forward_calls > 0 and calls == expected, \
                f"{layout}: forward: {forward_calls} local calls; backward: {calls}"
            assert all(t.grad is not None for t in (q, k, v, bias))
    finally:
        pieces.local_attention, pieces.local_backward, autograd._forward_impl = saved


def _dense_visible(kwargs: dict, seqlen: int) -> torch.Tensor:
    """bool (S, S): some batch's row i sees key j under the causal / window predicate and the
    per-row key lengths."""
    from omniattn.predicate import RelativePredicate

    positions = torch.arange(seqlen)
    predicate = RelativePredicate.make(kwargs.get("causal", False), kwargs.get("window"))
    visible = predicate.holds(positions[:, None], positions[None, :], seqlen, seqlen)
    if "seqlens_k_per_row" in kwargs:
        longest = kwargs["seqlens_k_per_row"].cpu().amax(0)
        visible = visible & (positions[None, :] < longest[:, None])
    return visible


def _dense_needs(visible: torch.Tensor, world: int, layout: str) -> list[list[bool]]:
    """needs[r][s]: some row of rank r sees some key of rank s in the (S, S) picture."""
    from omniattn.distributed.layout import to_shards

    held = to_shards(torch.arange(visible.shape[0]), layout, world, 0)
    return [[bool(visible[held[r]][:, held[s]].any()) for s in range(world)]
            for r in range(world)]


def run_ring_messages(shapes: Shapes, device, dtype) -> None:
    """The ring moves only what some row of the receiving rank sees: each rank's messages,
    counted at torch.distributed.batch_isend_irecv, are exactly its K/V (and key bias) to the
    ranks whose rows see them and back from the ranks whose keys its rows see (forward, and
    again in the backward, where the float32 gradients of each received shard go back to its
    owner), leaving out the rows handed to the keys' owner (explain's offloads); and for each
    hand-off, the rows of it that see those keys: q out and (out, lse) back in the forward,
    (dout, out, lse, dlse) out and dq back in the backward. Every rank's count is checked on
    every rank; some pair must be skipped, some rows handed off, and some pair of ranks spared
    its K/V by a hand-off of every row that sees them."""
    from collections import Counter

    from omniattn import distributed as cp

    world, rank = dist.get_world_size(), dist.get_rank()
    seqlen = shapes.chunk * 2 * world
    heads = (shapes.heads, shapes.heads_k)
    log: list[tuple] = []
    real = dist.batch_isend_irecv

    def logged(ops):
        log.extend(("send" if op.op is dist.isend else "receive", op.peer, op.tensor.numel(),
                    op.tensor.dtype) for op in ops)
        return real(ops)

    problems, skipped, handed, spared = [], 0, 0, 0
    for layout in LAYOUTS:
        for mask in ("narrow_window", "short_rows", "causal"):
            generator = torch.Generator().manual_seed(11)
            kwargs = _arguments(mask, shapes, seqlen, heads, device, generator)
            q, k, v = (torch.randn(shapes.batch, seqlen, h, shapes.head_dim,
                                   generator=generator).to(device, dtype)
                       for h in (heads[0], heads[1], heads[1]))
            shard = {"layout": layout}
            local = {name: cp.shard(value, dim=3 if name == "attn_bias" else 1, **shard)
                     if isinstance(value, torch.Tensor) else value
                     for name, value in kwargs.items()}
            key_side = [cp.shard(k, **shard), cp.shard(v, **shard)]
            if "attn_bias" in local:
                local["attn_bias"] = local["attn_bias"].to(dtype).requires_grad_()
                key_side.append(local["attn_bias"])
            leaves = [cp.shard(q, **shard).requires_grad_()] + \
                [t.requires_grad_() for t in key_side[:2]]
            offloads = cp.explain(*leaves, method="ring", **shard, **local).offloads
            dist.batch_isend_irecv = logged
            try:
                out = cp.attention(*leaves, method="ring", **shard, **local)
                forward = Counter(log)
                log.clear()
                out.float().square().sum().backward()
                backward = Counter(log)
                log.clear()
            finally:
                dist.batch_isend_irecv = real
            visible = _dense_visible(kwargs, seqlen)
            kept = visible.clone()
            kv, gradients, handoffs_out, handoffs_back = (Counter() for _ in range(4))
            row = shapes.batch * heads[0] * shapes.head_dim  # one row of q, out, dout, dq
            row_lse = shapes.batch * heads[0]
            for o in offloads:
                kept[o.rows.start:o.rows.stop, o.keys.start:o.keys.stop] = False
                seeing = visible[o.rows.start:o.rows.stop, o.keys.start:o.keys.stop].any(1)
                first, last = seeing.nonzero().flatten()[[0, -1]].tolist()
                rows = last - first + 1
                if rank not in (o.owner, o.helper):
                    continue
                owner = rank == o.owner
                mine, theirs = ("send", "receive") if owner else ("receive", "send")
                peer = o.helper if owner else o.owner
                handoffs_out[mine, peer, rows * row, dtype] += 1  # q
                handoffs_out[theirs, peer, rows * row, dtype] += 1  # out
                handoffs_out[theirs, peer, rows * row_lse, torch.float32] += 1  # lse
                handoffs_back[mine, peer, rows * row, dtype] += 2  # dout, out
                handoffs_back[mine, peer, rows * row_lse, torch.float32] += 2  # lse, dlse
                handoffs_back[theirs, peer, rows * row, dtype] += 1  # dq
            needs = _dense_needs(kept, world, layout)
            for other in (r for r in range(world) if r != rank):
                for t in key_side:
                    if needs[other][rank]:
                        kv["send", other, t.numel(), t.dtype] += 1
                        gradients["receive", other, t.numel(), torch.float32] += 1
                    if needs[rank][other]:
                        kv["receive", other, t.numel(), t.dtype] += 1
                        gradients["send", other, t.numel(), torch.float32] += 1
            if forward != kv + handoffs_out or backward != kv + gradients + handoffs_back:
                problems.append(f"rank {rank}, {layout} {mask}: forward {dict(forward)}, "
                                f"expected {dict(kv + handoffs_out)}; backward "
                                f"{dict(backward)}, expected "
                                f"{dict(kv + gradients + handoffs_back)}")
            skipped += sum(not needs[r][s] for r in range(world) for s in range(world)
                           if r != s)
            handed += len(offloads)
            spared += sum(_dense_needs(visible, world, layout)[r][s] and not needs[r][s]
                          for r in range(world) for s in range(world))
    everyone = [None] * world
    dist.all_gather_object(everyone, problems)
    assert skipped > 0, "no pair of ranks skipped: the masks test nothing"
    assert handed > 0, "no rows handed off: the masks test no hand-off"
    if world > 2:  # contiguous causal: the last rank's rows all computed by rank 0
        assert spared > 0, "no K/V spared by a hand-off"
    assert not any(everyone), "\n".join(p for found in everyone for p in found)


# ---- bad calls: (id, expected exception, a regex of its message, the call) ----

def bad_calls(shapes: Shapes, device) -> list[tuple]:
    """Each fails validation on every rank alike, before any communication."""
    import omniattn
    from omniattn import distributed as cp

    world = dist.get_world_size()
    rows = shapes.chunk * 2
    b, h, hk, d = shapes.batch, shapes.heads, shapes.heads_k, shapes.head_dim
    q = torch.randn(b, rows, h, d, device=device)
    k = torch.randn(b, rows, hk, d, device=device)
    v = torch.randn(b, rows, hk, d, device=device)
    odd_k = torch.randn(b, rows, 1, d, device=device)
    seqlen = rows * world
    ragged = torch.randn(b, rows + 1, h, d, device=device)
    # blocks of 2 x rows never divide the zigzag chunks (rows / 2)
    mask = omniattn.causal_block_mask(seqlen, seqlen, 2 * rows, device=device)

    def attn(*args, **kwargs):
        return lambda: cp.attention(*args, **kwargs)

    return [
        ("ulysses_heads", ValueError, rf"method='ulysses' cannot run this call: it splits heads "
         rf"over the {world} ranks: H = {h} query and Hk = 1 key/value heads must be multiples "
         rf"of {world}; use method='ring' or 'allgather'",
         attn(q, odd_k, odd_k, method="ulysses")),
        ("ring_topk", ValueError, r"method='ring' cannot run this call: top-k .*ulysses or "
         r"allgather computes it exactly", attn(q, k, v, method="ring", topk=4)),
        ("zigzag_odd_rows", ValueError, rf"q has {rows + 1} positions per rank; "
         rf"layout='zigzag' needs a multiple of 2 \(the global length a multiple of "
         rf"{2 * world} = 2 x {world} ranks\)",
         attn(ragged, ragged[..., :hk, :], ragged[..., :hk, :])),
        ("q_k_rows", ValueError, r"q has \d+ positions per rank and k \d+: omniattn.distributed "
         r"attends one sequence", attn(q, k[:, :-2], v[:, :-2])),
        ("bias_shape", ValueError, rf"attn_bias has shape \({b}, {h}, 1, {seqlen}\); "
         rf"omniattn.distributed takes it key-wise, this rank's keys: \(B={b} or 1, Hm in "
         rf"\{{1,{hk},{h}\}}, 1, S/P={rows}\)",
         attn(q, k, v, attn_bias=torch.zeros(b, h, 1, seqlen, device=device))),
        ("bias_dtype", TypeError, r"attn_bias has dtype torch.int64",
         attn(q, k, v, attn_bias=torch.zeros(b, h, 1, rows, dtype=torch.long, device=device))),
        ("lengths_shape", ValueError, rf"seqlens_k_per_row has shape \({b}, {seqlen}\); "
         rf"expected this rank's rows, \({b}, {rows}\)",
         attn(q, k, v, seqlens_k_per_row=torch.zeros(b, seqlen, dtype=torch.int32,
                                                     device=device))),
        ("lengths_range", ValueError, rf"seqlens_k_per_row must lie in \[0, S\] \(global key "
         rf"lengths, S = {seqlen}\)$",
         attn(q, k, v, seqlens_k_per_row=torch.full((b, rows), seqlen + 1, dtype=torch.int32,
                                                    device=device))),
        ("block_mask_lengths", ValueError, rf"block_mask was built for \(Sq, Sk\) = "
         rf"\({rows}, {rows}\); omniattn.distributed takes the global mask, \({seqlen}, "
         rf"{seqlen}\)", attn(q, k, v, block_mask=omniattn.causal_block_mask(rows, rows, 16,
                                                                              device=device))),
        ("block_mask_grid", ValueError, rf"method='ring' cannot run this call: its pieces cut "
         rf"block_mask at the zigzag chunks of {rows // 2} positions, which must be multiples "
         rf"of the mask's block size", attn(q, k, v, method="ring", block_mask=mask)),
        ("method_name", ValueError, r"method must be 'auto', 'ulysses', 'ring' or 'allgather', "
         r"got 'rings'", attn(q, k, v, method="rings")),
        ("layout_name", ValueError, r"layout must be one of 'zigzag', 'contiguous', got "
         r"'striped'", attn(q, k, v, layout="striped")),
        ("window_type", TypeError, r"window must be a \(left, right\) pair of ints",
         attn(q, k, v, window=(1.5, 0))),
        ("topk_scores_alone", ValueError, r"topk_scores needs topk",
         attn(q, k, v, topk_scores=torch.zeros(b, 1, 1, rows, device=device))),
        ("int_q", TypeError, r"q has dtype torch.int64",
         attn(q.long(), k, v)),
        ("group_type", TypeError, r"group must be a torch.distributed ProcessGroup, a 1-D "
         r"DeviceMesh or None, got str", attn(q, k, v, group="cp")),
        ("shard_length", ValueError, rf"x has length {seqlen + 2}; layout='zigzag' over "
         rf"{world} ranks needs a multiple of 2P = {2 * world}",
         lambda: cp.shard(torch.zeros(1, seqlen + 2, device=device))),
        ("shard_contiguous_length", ValueError, rf"x has length {world + 1}; "
         rf"layout='contiguous' over {world} ranks needs a multiple of P = {world}",
         lambda: cp.shard(torch.zeros(world + 1, device=device), dim=0, layout="contiguous")),
        ("unshard_dim", ValueError, r"dim must be an int in \[-2, 2\)",
         lambda: cp.unshard(torch.zeros(2, 2, device=device), dim=2)),
    ]


def _no_communication():
    """Makes every collective and point-to-point call fail, returning the undo."""
    names = ("all_gather", "all_to_all", "reduce_scatter", "batch_isend_irecv", "isend",
             "irecv", "all_reduce", "broadcast")
    saved = {name: getattr(dist, name) for name in names}

    def refuse(*args, **kwargs):
        raise AssertionError("communication before validation finished")

    for name in names:
        setattr(dist, name, refuse)
    return lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


def run_bad_call(expected, pattern, call) -> None:
    undo = _no_communication()
    try:
        call()
    except expected as error:
        assert re.search(pattern, str(error)), f"message {str(error)!r} does not match {pattern!r}"
        assert "tensor(" not in str(error), f"the message prints a tensor: {error}"
    else:
        raise AssertionError(f"no {expected.__name__} raised")
    finally:
        undo()


def run_explain(shapes: Shapes, device) -> dict[str, str]:
    """auto's choices (printed plans) for a few calls."""
    from omniattn import distributed as cp

    world = dist.get_world_size()
    rows = shapes.chunk * 2
    q = torch.randn(1, rows, world * 2, 8, device=device)
    k = torch.randn(1, rows, world, 8, device=device)
    mqa = torch.randn(1, rows, 1, 8, device=device)
    narrow = {"method": "ring", "causal": True, "window": (shapes.chunk // 2, -1)}
    return {"heads_split": str(cp.explain(q, k, k, causal=True)),
            "mqa": str(cp.explain(q, mqa, mqa, causal=True)),
            "mqa_topk": str(cp.explain(q, mqa, mqa, topk=4)),
            "ring_window": str(cp.explain(q, mqa, mqa, method="ring", window=(3, 0),
                                          layout="contiguous")),
            "ring_narrow_zigzag": str(cp.explain(q, mqa, mqa, **narrow)),
            "ring_narrow_contiguous": str(cp.explain(q, mqa, mqa, layout="contiguous",
                                                     **narrow)),
            "ring_causal_contiguous": str(cp.explain(q, mqa, mqa, method="ring", causal=True,
                                                     layout="contiguous"))}


def run_groups(shapes: Shapes, device, dtype, record) -> None:
    """The same call on other groups than the default one: a 1-D DeviceMesh cut from a 2-D
    one, a subgroup whose ranks are not the global ones (the ring's neighbours and the ranks
    taking rows handed off are looked up), and a group of one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "cp"))
    record("group-device_mesh", lambda: run_case(Case("ring", "zigzag", "everything"), shapes,
                                                 device, dtype, 1, group=mesh["cp"]))
    # every rank creates every group, in one order
    first_last = dist.new_group([0, world - 1])
    alone = [dist.new_group([r]) for r in range(world)]
    if world > 2 and rank in (0, world - 1):
        record("group-subgroup", lambda: run_case(Case("ring", "zigzag", "causal"), shapes,
                                                  device, dtype, 2, group=first_last))
        # rows handed from the subgroup's rank 1 (global world - 1) to its rank 0
        record("group-subgroup-handoff", lambda: run_case(
            Case("ring", "contiguous", "causal"), shapes, device, dtype, 4, group=first_last))
    for method in METHODS:
        record(f"group-one_rank-{method}", lambda: run_case(
            Case(method, "zigzag", "everything"), shapes, device, dtype, 3, group=alone[rank]))


def run_transformers(device) -> None:
    """docs/distributed.md's transformers recipe: a tiny Llama whose attention is
    omniattn.distributed (registered as "omniattn_cp", masks left to the call), fed this
    rank's shard of the tokens and of their positions; its logits and its parameters'
    gradients (summed over the ranks) equal the whole sequence's on one process."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    from omniattn import distributed as cp

    def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
        out = cp.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           causal=True, softmax_scale=scaling)
        return out, None

    AttentionInterface.register("omniattn_cp", cp_attention)
    AttentionMaskInterface.register("omniattn_cp", lambda *args, **kwargs: None)
    def model(attn_implementation):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             attn_implementation=attn_implementation)
        return LlamaForCausalLM(config).to(device)

    whole, sharded = model("eager"), model("omniattn_cp")
    tokens = torch.randint(0, 64, (2, 16 * dist.get_world_size()),
                           generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)

    expected = whole(tokens, position_ids=positions).logits
    expected.square().mean().backward()
    local = sharded(cp.shard(tokens), position_ids=cp.shard(positions)).logits
    # the loss of this rank's tokens, scaled as a share of the whole sequence's mean
    (local.square().sum() / expected.numel()).backward()
    logits = cp.unshard(local)
    # fp32 through the GPU kernels sums in other orders than eager attention
    rtol, atol = (1e-3, 1e-4) if device.type == "cuda" else (1e-4, 1e-5)
    torch.testing.assert_close(logits, expected, rtol=rtol, atol=atol)
    for (name, p_whole), p_sharded in zip(whole.named_parameters(), sharded.parameters()):
        grad = p_sharded.grad.clone()
        dist.all_reduce(grad)  # what DDP / FSDP does over the context-parallel ranks too
        torch.testing.assert_close(grad, p_whole.grad, rtol=rtol, atol=atol / 10, msg=name)


def worker(rank: int, world: int, init_file: str, out_file: str, backend: str,
           dtype_name: str, shapes: Shapes, only: list[str] | None,
           interpret: bool = False) -> None:
    """A rank of the test group: every case (those named in `only`), then other groups, the
    bad calls and explain; rank 0 writes the results. interpret: the Triton kernels under
    the interpreter (CPU), else the reference path."""
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    torch.set_num_threads(1)  # P ranks share the machine's cores
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    dtype = getattr(torch, dtype_name)
    results: dict[str, str] = {}

    def record(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - recorded and reported by the test of that case
            results[name] = traceback.format_exc(limit=6)

    handoffs: dict[str, dict] = {}
    for seed, case in enumerate(cases()):
        if only is None or case.id in only:
            record(case.id, lambda: run_case(case, shapes, device, dtype, seed, plans=handoffs))
    if only is None or "ring-backward_without_forward" in only:
        record("ring-backward_without_forward",
               lambda: run_backward_without_forward(shapes, device, dtype))
    if only is None or "ring-messages" in only:
        record("ring-messages", lambda: run_ring_messages(shapes, device, dtype))
    if only is None:
        run_groups(shapes, device, dtype, record)
        record("transformers", lambda: run_transformers(device))
    for name, expected, pattern, call in bad_calls(shapes, device):
        record(f"error-{name}", lambda: run_bad_call(expected, pattern, call))
    plans = run_explain(shapes, device)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"world": world, "results": results, "plans": plans,
                       "handoffs": handoffs}, f)
    dist.barrier()
    dist.destroy_process_group()
