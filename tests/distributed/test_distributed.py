"""omniattn.distributed on CPU with gloo: every method equal to the single-process call (the 2x
rule on outputs, lse and gradients) for each mask, both layouts, world sizes 2 and 3; bad calls
fail before any communication; auto's choices. One spawned process group per world size runs
every case (cp_workers.py); NCCL on 2 GPUs under the gpu marker."""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from cp_workers import Case, Shapes, cases, worker
import omniattn
from omniattn.distributed.layout import Chunk, chunks, chunks_per_rank, to_global, to_shards
from omniattn.distributed.pieces import block_mask_part, cut, pieces
from omniattn.distributed.visibility import layout_chunks, rank_work, visibility
from omniattn.predicate import RelativePredicate

# world size -> shapes: the heads split over P (ulysses); chunks of 16 (the block masks' blocks)
GLOO_SHAPES = {2: Shapes(batch=2, chunk=16, heads=4, heads_k=2, head_dim=8),
               3: Shapes(batch=2, chunk=16, heads=6, heads_k=3, head_dim=8)}


def _spawn(world: int, backend: str, dtype: str, shapes: Shapes, folder, only=None,
           interpret=False) -> dict:
    results = folder / "results.json"
    mp.spawn(worker, args=(world, str(folder / "init"), str(results), backend, dtype, shapes,
                           only, interpret), nprocs=world)
    return json.loads(results.read_text())


@pytest.fixture(scope="module", params=sorted(GLOO_SHAPES), ids=lambda w: f"world{w}")
def gloo(request, tmp_path_factory) -> dict:
    world = request.param
    return _spawn(world, "gloo", "float32", GLOO_SHAPES[world],
                  tmp_path_factory.mktemp(f"gloo{world}"))


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_matches_single_process(gloo, case: Case):
    assert gloo["results"][case.id] == "ok", gloo["results"][case.id]


# ring cases that must hand rows off, per world size: a window block mask with key bias as the
# scaling benchmark's (both sizes; at 3 a chain: rank 1 takes rank 2's rows and hands its own to
# rank 0), contiguous causal (at 3 all the last rank's rows that see rank 0's keys), a narrow
# window with key bias (at 2; at 3 the busiest rank is within the margin)
HANDING_OFF = {
    2: ["ring-zigzag-window_fine_blocks", "ring-contiguous-window_fine_blocks",
        "ring-contiguous-causal", "ring-contiguous-key_bias", "ring-zigzag-narrow_window",
        "ring-contiguous-narrow_window"],
    3: ["ring-zigzag-window_fine_blocks", "ring-contiguous-window_fine_blocks",
        "ring-contiguous-causal", "ring-contiguous-key_bias"],
}


def test_ring_hands_rows_off(gloo):
    """Where the cost model finds the ring imbalanced, rows are handed off and the modelled
    busiest / mean drops (explain's plan); the outputs, lse and every gradient of those cases
    equal the single-process call's (test_matches_single_process), which a part computed twice
    or left out would break."""
    world, handoffs = gloo["world"], gloo["handoffs"]
    for case_id in HANDING_OFF[world]:
        plan = handoffs[case_id]
        assert plan["offloads"] and plan["after"] < plan["before"] - 0.02, (case_id, plan)
        assert gloo["results"][case_id] == "ok", gloo["results"][case_id]
    assert all(p["after"] <= p["before"] for p in handoffs.values())
    assert not handoffs["ring-zigzag-causal"]["offloads"]  # zigzag balances causal itself
    if world == 3:
        assert handoffs["ring-zigzag-window_fine_blocks"]["chains"] == [1]
        assert handoffs["ring-contiguous-causal"]["whole"] == [
            "rows [64, 96) of rank 2 computed by rank 0 against its own keys [0, 32)"]


def test_ring_backward_runs_no_forward(gloo):
    """The ring's backward: one local backward call per piece, from the merged out and lse,
    and no forward call (counted at the pieces' calls)."""
    outcome = gloo["results"]["ring-backward_without_forward"]
    assert outcome == "ok", outcome


def test_other_groups(gloo):
    """A 1-D DeviceMesh of a 2-D one, a subgroup of the first and last ranks (world 3; with
    rows handed off between them), one rank alone."""
    outcomes = {name: r for name, r in gloo["results"].items() if name.startswith("group-")}
    assert len(outcomes) >= (6 if gloo["world"] > 2 else 4)
    assert all(r == "ok" for r in outcomes.values()), outcomes


def test_transformers_model(gloo):
    """A tiny Llama with its attention registered as omniattn.distributed: logits and summed
    parameter gradients equal the single-process model's (docs/distributed.md's recipe)."""
    assert gloo["results"]["transformers"] == "ok", gloo["results"]["transformers"]


def test_bad_calls_fail_before_communication(gloo):
    failed = {name: outcome for name, outcome in gloo["results"].items()
              if name.startswith("error-") and outcome != "ok"}
    assert len([n for n in gloo["results"] if n.startswith("error-")]) >= 19
    assert not failed, "\n".join(f"{name}: {outcome}" for name, outcome in failed.items())


def test_auto_choice_and_reasons(gloo):
    plans = gloo["plans"]
    assert plans["heads_split"].startswith("method: ulysses (auto: one single-device call")
    assert plans["mqa"].startswith("method: ring (auto: K/V shards travel to the ranks whose "
                                   "rows see them")
    assert "\n  not ulysses: it splits heads over the" in plans["mqa"]
    assert plans["mqa_topk"].startswith("method: allgather (auto:")
    assert "\n  not ring: top-k keeps each row's best keys" in plans["mqa_topk"]
    # contiguous causal window (3, 0): rank 0 needs no other rank's keys
    assert plans["ring_window"].startswith("method: ring (asked for:")
    assert "\n  step 1, K/V of rank" in plans["ring_window"]
    assert ": none seen here, not received; own K/V sent to rank 1" in plans["ring_window"]


def test_explain_balance_and_layout_advice(gloo):
    """The cost model in explain: zigzag balances causal work and advises nothing; contiguous
    causal is told zigzag balances it; a narrow causal window moves fewer shards contiguous
    (each rank sees the rank before only), which zigzag is told."""
    plans, world = gloo["plans"], gloo["world"]
    causal_zigzag = plans["mqa"]
    assert f"\nK/V shards moved: {world * (world - 1)} of {world * (world - 1)} " in causal_zigzag
    assert "; busiest / mean 1.00\n" in causal_zigzag and "suits" not in causal_zigzag
    assert "\nlayout='zigzag' suits these masks better: its busiest rank has" \
        in plans["ring_causal_contiguous"]
    contiguous = plans["ring_narrow_contiguous"]
    assert f"\nK/V shards moved: {world - 1} of " in contiguous and "suits" not in contiguous
    assert "\nlayout='contiguous' suits these masks better: its busiest rank has " \
        in plans["ring_narrow_zigzag"]
    assert f"K/V shards moved: {world - 1} (" in plans["ring_narrow_zigzag"]
    if world > 2:  # contiguous: no rank sees the keys of the rank two behind
        assert "\n  step 2: no rank sees keys of the rank 2 behind it, skipped" in contiguous


def test_ring_moves_only_what_is_seen(gloo):
    """Messages counted at batch_isend_irecv: exactly the shards (and gradients) of the pairs
    of ranks whose rows see each other's keys (cp_workers.run_ring_messages)."""
    assert gloo["results"]["ring-messages"] == "ok", gloo["results"]["ring-messages"]


@pytest.mark.interpreter
def test_triton_kernels_under_the_interpreter(tmp_path):
    """A few cases through the Triton kernels (TRITON_INTERPRET=1): the pieces' strided rows,
    block-mask parts with element bitmaps, unchecked lengths; the ring's backward launches no
    forward kernel."""
    only = ["ring-zigzag-everything-odd_heads", "ring-zigzag-block_documents",
            "allgather-contiguous-everything", "ulysses-zigzag-row_lengths",
            "ring-backward_without_forward"]
    shapes = Shapes(batch=1, chunk=16, heads=2, heads_k=2, head_dim=16)
    outcome = _spawn(2, "gloo", "float32", shapes, tmp_path, only=only, interpret=True)
    assert [outcome["results"][name] for name in only] == ["ok"] * len(only), outcome["results"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_nccl_two_gpus_bf16(tmp_path):
    """Each method's collectives over NCCL with the GPU kernels in bf16, against the float64
    reference under the 2x rule (block masks at 64-position chunks): a sample of the cases
    that gloo runs in full, one that compiles in minutes (every case at once did not finish
    in 230 s on 2 H100s)."""
    shapes = Shapes(batch=2, chunk=64, heads=4, heads_k=2, head_dim=64)
    only = [f"{method}-{case}" for method in ("ulysses", "ring", "allgather")
            for case in ("zigzag-causal", "zigzag-everything", "contiguous-key_bias")]
    only += ["ring-zigzag-window_blocks", "ring-contiguous-window_blocks",
             "ring-zigzag-block_documents", "ring-zigzag-row_lengths",
             "ring-contiguous-narrow_window", "ring-zigzag-everything-odd_heads",
             "ring-zigzag-window_fine_blocks", "ring-contiguous-causal",
             "ulysses-zigzag-topk", "allgather-contiguous-topk", "ring-backward_without_forward"]
    outcome = _spawn(2, "nccl", "bfloat16", shapes, tmp_path, only=only)
    assert set(only) <= set(outcome["results"]), sorted(outcome["results"])
    failed = {name: r for name, r in outcome["results"].items() if r != "ok"}
    assert not failed, "\n".join(f"{name}: {r}" for name, r in failed.items())


# ---- positions and pieces, without processes ----

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shards_round_trip_and_chunks(world, layout):
    seqlen = 24 * world
    full = torch.arange(seqlen).view(1, seqlen)
    shards = to_shards(full, layout, world, 1)
    assert torch.equal(to_global(shards, layout, 1), full)
    for rank, part in enumerate(shards):
        held = torch.cat([torch.arange(c.start, c.stop) for c in
                          chunks(layout, rank, world, seqlen)])
        assert torch.equal(part[0], held)
    if layout == "zigzag":
        assert [c.start for c in chunks(layout, 0, world, seqlen)] == [0, seqlen - 12]


def _visible(rows: Chunk, keys: Chunk, predicate: RelativePredicate, seqlen: int):
    """(rows, keys) bool of what the global predicate shows."""
    q_idx = torch.arange(rows.start, rows.stop)[:, None]
    k_idx = torch.arange(keys.start, keys.stop)[None, :]
    return predicate.holds(q_idx, k_idx, seqlen, seqlen)


@pytest.mark.parametrize("causal,window", [(True, None), (False, (5, 2)), (False, (0, 9)),
                                           (True, (11, -1)), (False, (-1, 3)), (False, None)])
def test_cut_shows_exactly_the_global_predicate(causal, window):
    """Every (row chunk, key chunk) pair: the piece's own bottom-right aligned predicate on its
    rectangle equals the global predicate, and nothing visible lies outside the rectangle."""
    seqlen, length = 48, 8
    predicate = RelativePredicate.make(causal, window)
    grid = [Chunk(s, 0, length) for s in range(0, seqlen, length)]
    for rows in grid:
        for keys in grid:
            expected = _visible(rows, keys, predicate, seqlen)
            piece = cut(rows, keys, predicate)
            if piece is None:
                assert not expected.any()
                continue
            (i0, i1), (j0, j1) = piece.rows, piece.keys
            own = RelativePredicate.make(piece.causal, piece.window)
            got = torch.zeros_like(expected)
            got[i0:i1, j0:j1] = own.visible(torch.arange(i1 - i0), i1 - i0, j1 - j0) \
                if not own.unbounded else True
            assert torch.equal(got, expected), (rows, keys, piece)


@pytest.mark.parametrize("mask_window,causal", [((27, 0), True), ((32, 0), True),
                                                ((5, 19), False), ((-1, 3), False),
                                                ((40, -1), True)])
@pytest.mark.parametrize("call_window", [None, (21, -1), (-1, 6)])
def test_window_mask_parts_keep_a_window_and_no_bitmaps(mask_window, causal, call_window):
    """A window block mask cut at every (row chunk, key chunk) pair under the call's own
    window: each part shows exactly the global mask AND the call's predicate on its rectangle,
    nothing visible lies outside it, and its partial blocks apply a window of their own (no
    element bitmaps, which would keep the Gluon kernels away)."""
    seqlen, length, block = 128, 32, 16
    mask = omniattn.window_block_mask(seqlen, seqlen, mask_window, causal=causal,
                                      block_size=block)
    predicate = RelativePredicate.make(False, call_window)
    grid = [Chunk(s, 0, length) for s in range(0, seqlen, length)]
    seen = 0
    for rows in grid:
        for keys in grid:
            expected = mask.visible(torch.arange(rows.start, rows.stop), seqlen, seqlen)[
                0, 0, :, keys.start:keys.stop] & _visible(rows, keys, predicate, seqlen)
            part = block_mask_part(mask, (rows.start, rows.stop), (keys.start, keys.stop),
                                   predicate)
            if part is None:
                assert not expected.any()
                continue
            seen += 1
            assert part.element_bits is None
            n_rows, n_keys = part.seq_lengths
            got = torch.zeros_like(expected)
            got[:n_rows, :n_keys] = part.visible(torch.arange(n_rows), n_rows, n_keys)[0, 0]
            assert torch.equal(got, expected), (rows, keys, part)
    assert seen > len(grid)


def test_bitmap_masks_keep_bitmaps_in_parts():
    """A document mask's partial blocks hold bitmaps; its parts carry them on."""
    seqlen, length = 128, 32
    bounds = torch.tensor([0, 21, 75, 128])
    mask = omniattn.document_block_mask(bounds, 16, causal=True)
    part = block_mask_part(mask, (32, 64), (0, 32), RelativePredicate.make(True))
    assert part is not None and part.element_bits is not None
    expected = mask.visible(torch.arange(32, 64), seqlen, seqlen)[0, 0, :, :length]
    assert torch.equal(part.visible(torch.arange(32), 32, 32)[0, 0], expected)


def test_pieces_skip_hidden_and_join_unmasked():
    """Causal zigzag, rank 0 of 2: its own K/V give three pieces; rank 1's K/V are fully
    visible to the late chunk only and become one call."""
    seqlen, predicate = 64, RelativePredicate.make(True)
    rows = chunks("zigzag", 0, 2, seqlen)
    own = pieces(rows, chunks("zigzag", 0, 2, seqlen), predicate, None, False)
    assert [(p.causal, p.unmasked) for p in own] == [(True, False), (False, True),
                                                     (True, False)]
    other = pieces(rows, chunks("zigzag", 1, 2, seqlen), predicate, None, False)
    assert len(other) == 1 and other[0].rows == (16, 32) and other[0].keys == (0, 32)
    # per-row key lengths count keys by global position: nothing is joined
    assert len(pieces(rows, chunks("zigzag", 1, 2, seqlen), predicate, None, True)) == 2


def _rank_totals(dense: torch.Tensor, owned, world: int) -> list[float]:
    """The visible pairs of each rank's rows in a dense (S, S) picture (float: averaged)."""
    return [sum(float(dense[c.start:c.stop].sum()) for owner, c in owned if owner == rank)
            for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_visibility_and_work_of_every_chunk_pair(world, layout):
    """The chunk table says whether any (row, key) pair of two chunks is visible, as the dense
    picture does (causal / window exactly; block masks of FULL blocks and window block masks
    too, at their blocks); rank_work counts each rank's visible pairs exactly (block masks:
    their listed blocks' area, averaged over heads)."""
    length = 16
    seqlen = length * world * chunks_per_rank(layout)
    owned = layout_chunks(layout, world, seqlen)
    positions = torch.arange(seqlen)

    def chunk_pairs(dense):
        return tuple(tuple(bool(dense[r.start:r.stop, c.start:c.stop].any()) for _, c in owned)
                     for _, r in owned)

    for causal, window in [(True, None), (True, (8, -1)), (False, (8, 8)), (False, (0, 20)),
                           (False, None), (True, (40, 3))]:
        predicate = RelativePredicate.make(causal, window)
        dense = predicate.holds(positions[:, None], positions[None, :], seqlen, seqlen)
        assert visibility(layout, world, seqlen, predicate, None).visible == chunk_pairs(dense)
        assert list(rank_work(layout, world, seqlen, predicate, None)) == \
            _rank_totals(dense, owned, world)
    n = seqlen // length
    blocks = torch.rand(1, 2, n, n, generator=torch.Generator().manual_seed(world)) < 0.3
    masks = [(omniattn.block_mask_from_blocks(blocks, length), RelativePredicate.make(True)),
             (omniattn.window_block_mask(seqlen, seqlen, (8, 0), causal=True,
                                         block_size=length), RelativePredicate())]
    for mask, predicate in masks:
        dense = mask.visible(positions, seqlen, seqlen) & predicate.holds(
            positions[:, None], positions[None, :], seqlen, seqlen)
        table = visibility(layout, world, seqlen, predicate, mask)
        assert table.visible == chunk_pairs(dense.any(0).any(0))
        assert table is visibility(layout, world, seqlen, predicate, mask)  # cached per mask
    listed = blocks.repeat_interleave(length, 2).repeat_interleave(length, 3)
    assert list(rank_work(layout, world, seqlen, RelativePredicate(), masks[0][0])) == \
        pytest.approx(_rank_totals(listed.float().mean((0, 1)), owned, world))


def test_needs_and_row_lengths():
    """Contiguous causal: each rank needs the ranks before it only; rows whose keys all lie in
    the first chunk need rank 0 alone (zigzag: chunks 0 and 3 are rank 0's)."""
    table = visibility("contiguous", 3, 48, RelativePredicate.make(True), None)
    assert table.needs(3) == ((True, False, False), (True, True, False), (True, True, True))
    zigzag = visibility("zigzag", 2, 64, RelativePredicate(), None)
    assert zigzag.narrowed([16, 16, 16, 1]).needs(2) == ((True, False), (True, False))
    assert zigzag.narrowed([0, 17, 0, 0]).needs(2) == ((False, False), (True, True))


def _dense_pairs(layout: str, world: int, seqlen: int, predicate: RelativePredicate, mask):
    """float (S, S): the cost model's picture, each visible pair 1 (a block mask: its listed
    blocks' area, averaged over its lists, with the predicate at blocks)."""
    positions = torch.arange(seqlen)
    if mask is None:
        return predicate.holds(positions[:, None], positions[None, :], seqlen, seqlen).float()
    block_q, block_k = mask.block_size
    states = torch.minimum(mask.states, predicate.classify(seqlen, seqlen, block_q, block_k)) \
        if not predicate.unbounded else mask.states
    listed = (states != 0).float().mean((0, 1))
    return listed.repeat_interleave(block_q, 0).repeat_interleave(block_k, 1)


BALANCE_CASES = [  # (layout, world, chunk, causal, window, window block mask (window, block))
    ("zigzag", 2, 16, True, (8, -1), None), ("contiguous", 2, 16, True, (8, -1), None),
    ("contiguous", 2, 16, True, None, None), ("contiguous", 3, 16, True, None, None),
    ("contiguous", 3, 16, True, (8, -1), None),
    ("zigzag", 3, 128, True, (128, -1), None), ("zigzag", 4, 128, True, (128, -1), None),
    ("zigzag", 2, 128, False, None, (128, 16)), ("zigzag", 3, 128, False, None, (128, 16)),
    ("contiguous", 3, 128, False, None, (128, 16)), ("zigzag", 4, 256, False, None, (512, 32)),
    ("contiguous", 2, 1000, True, None, None),  # granules of 8 rows: 1000 is no multiple of 16
]


@pytest.mark.parametrize("layout,world,chunk,causal,window,blocks", BALANCE_CASES)
def test_balance_hands_rows_to_lighter_ranks(layout, world, chunk, causal, window, blocks):
    """Each hand-off is a granule-aligned run of the owner's rows against a key chunk the
    helper holds, moving the work the dense picture gives it, each (row chunk, key chunk) pair
    once, never back against an earlier hand-off; `whole` exactly when no other row of the
    chunk sees those keys; the busiest rank's work drops, and at P = 2 no slice a granule
    longer or shorter would bring the two ranks closer."""
    from omniattn.distributed.balance import balance, granule

    seqlen = chunk * world * chunks_per_rank(layout)
    predicate = RelativePredicate.make(causal, window)
    mask = omniattn.window_block_mask(seqlen, seqlen, (blocks[0], 0), causal=True,
                                      block_size=blocks[1]) if blocks else None
    found = balance(layout, world, seqlen, predicate, mask)
    dense = _dense_pairs(layout, world, seqlen, predicate, mask)
    owned = layout_chunks(layout, world, seqlen)
    length = owned[0][1].length
    step = granule(length, mask)
    assert found.offloads and max(found.after) < max(found.before)
    assert found.before == rank_work(layout, world, seqlen, predicate, mask)
    work = list(found.before)
    pairs, directions = set(), set()
    for o in found.offloads:
        chunk_rows = owned[o.rows.start // length]
        assert owned[o.keys.start // length] == (o.helper, o.keys)
        assert chunk_rows[0] == o.owner and o.rows.start % step == 0 and o.rows.length % step == 0
        assert o.rows.local - chunk_rows[1].local == o.rows.start - chunk_rows[1].start
        moved = float(dense[o.rows.start:o.rows.stop, o.keys.start:o.keys.stop].sum())
        assert o.work == pytest.approx(moved) and moved > 0
        rest = float(dense[chunk_rows[1].start:chunk_rows[1].stop,
                           o.keys.start:o.keys.stop].sum()) - moved
        assert o.whole == (rest == pytest.approx(0))
        pair = (o.rows.start // length, o.keys.start // length)
        assert pair not in pairs and (o.helper, o.owner) not in directions
        pairs.add(pair)
        directions.add((o.owner, o.helper))
        work[o.owner] -= moved
        work[o.helper] += moved
    assert work == pytest.approx(list(found.after))
    if world == 2:
        (o,), (a, b) = found.offloads, sorted(found.before)
        chunk_start = o.rows.start - o.rows.start % length
        for stop in (o.rows.stop - step, o.rows.stop + step):
            if o.rows.start < stop <= chunk_start + length:
                other = float(dense[o.rows.start:stop, o.keys.start:o.keys.stop].sum())
                assert abs(b - a - 2 * o.work) <= abs(b - a - 2 * other) + 1e-6


@pytest.mark.parametrize("layout,world,causal,window", [
    ("zigzag", 2, True, None), ("zigzag", 3, True, None), ("contiguous", 2, False, None),
    ("zigzag", 3, True, (8, -1))])
def test_balance_leaves_balanced_calls(layout, world, causal, window):
    """Nothing handed off where the busiest rank is within the margin of the mean (zigzag
    causal, no mask, a narrow window zigzag over 3 ranks)."""
    from omniattn.distributed.balance import balance

    seqlen = 16 * world * chunks_per_rank(layout)
    found = balance(layout, world, seqlen, RelativePredicate.make(causal, window), None)
    assert found.offloads == () and found.after == found.before


def test_balance_hands_nothing_that_leaves_the_busiest_as_busy():
    """Contiguous over 3 ranks, blocks of 16 in chunks of 48 listed as (3, 9, 9) blocks: rank 1
    could hand rows to rank 0, but rank 2, as busy, sees only its own keys: no hand-off would
    shorten the call, and none is made."""
    from omniattn.distributed.balance import balance

    blocks = torch.eye(9, dtype=torch.bool)
    blocks[3:6, 0:2] = True  # rank 1's rows see rank 0's keys
    blocks[6:9, 6:9] = True  # rank 2's rows see its own keys only
    mask = omniattn.block_mask_from_blocks(blocks[None, None], 16)
    found = balance("contiguous", 3, 144, RelativePredicate(), mask)
    assert [w / 256 for w in found.before] == [3, 9, 9]
    assert found.offloads == () and found.after == found.before


def test_balance_of_the_scaling_benchmark():
    """benchmarks/cp_scaling.py's key bias + causal window (S/4) block mask at 128k, blocks of
    128, zigzag over 2 ranks: 1.5 : 2 units of work; rank 1's first 9600 rows of chunk 1 (75
    blocks) against rank 0's chunk 0 leave 1.0002 : 1 (a 76th block: 1.0016)."""
    from omniattn.distributed.balance import balance

    seqlen = 131072
    mask = omniattn.window_block_mask(seqlen, seqlen, (seqlen // 4, 0), causal=True,
                                      block_size=128)
    found = balance("zigzag", 2, seqlen, RelativePredicate(), mask)
    (o,) = found.offloads
    assert (o.owner, o.helper, o.rows, o.keys) == (1, 0, Chunk(32768, 0, 9600),
                                                  Chunk(0, 0, 32768))
    assert max(found.before) * 2 / sum(found.before) == pytest.approx(8 / 7)
    assert max(found.after) * 2 / sum(found.after) == pytest.approx(1.0002, abs=1e-4)


def test_granules():
    """Slices of 128 rows (a GPU query tile), fewer in chunks shorter than 16 of them or not
    a multiple of them; a block mask's query blocks."""
    from omniattn.distributed.balance import granule

    assert [granule(n, None) for n in (32768, 2048, 1000, 64, 16, 15)] == \
        [128, 128, 8, 4, 1, 1]
    mask = omniattn.window_block_mask(256, 256, (64, 0), causal=True, block_size=(32, 16))
    assert granule(64, mask) == 32
