"""Pieces shared by the forward and backward kernels: the element predicate (with its top-k term)
and the softcap."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_rows(ptrs, rows, n_rows, offs_d, EVEN_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; masks only where the tile may cross the sequence or head dim."""
    if EVEN_ROWS:
        if BLOCK_D == HEAD_DIM:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if BLOCK_D == HEAD_DIM:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def visible_elements(
    offs_m, offs_n, key_end, diag_offset, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr,
):
    """Element predicate of a PARTIAL tile: [BM, BN] True where query offs_m may see key offs_n.

    key_end [BM]: the keys each row sees end there (Sk, or the row's key length), read only with
    KEY_BOUND (without it no key of the tile lies past Sk and rows have no lengths of their own:
    the comparison would be all True); diag_offset = Sk - Sq (bottom-right aligned diagonal);
    causal is HAS_RIGHT with window_right 0.
    """
    visible = tl.full([offs_m.shape[0], offs_n.shape[0]], 1, tl.int1)
    if KEY_BOUND:
        visible = offs_n[None, :] < key_end[:, None]
    rel = offs_n[None, :] - offs_m[:, None] - diag_offset
    if HAS_RIGHT:
        visible = visible & (rel <= window_right)
    if HAS_LEFT:
        visible = visible & (rel >= -window_left)
    return visible


@triton.jit
def signed_order_keys(x):
    """int32 order keys of float scores, predicate.order_keys on the device: signed order is the
    scores' order as float32 (-0 = +0, NaN above +inf)."""
    x = x.to(tl.float32)
    bits = tl.where(x == 0, 0, x.to(tl.int32, bitcast=True))
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats order backwards by magnitude
    return tl.where(x != x, 0x7FFFFFFF, keys)


@triton.jit
def topk_keep(scores, keys, threshold, last_tie, TRANSPOSED: tl.constexpr):
    """The top-k term of the predicate (predicate.RowThresholds): [BM, BN] True where the row's
    threshold pair keeps the key ([BN, BM] when TRANSPOSED). scores: the tile's top-k scores,
    broadcastable to it; keys [BN]: key indices; threshold / last_tie [BM]: the rows' pairs."""
    order = signed_order_keys(scores)
    if TRANSPOSED:
        above = order > threshold[None, :]
        tie_kept = (order == threshold[None, :]) & (keys[:, None] <= last_tie[None, :])
    else:
        above = order > threshold[:, None]
        tie_kept = (order == threshold[:, None]) & (keys[None, :] <= last_tie[:, None])
    return above | tie_kept


@triton.jit
def row_pairs(pairs, pair_stride, rows, n_rows, stride_row, HAS_TOPK: tl.constexpr):
    """[BM] (threshold, last_tie) of rows `rows` from a (2, ...) pair tensor whose row 0 of this
    (batch, head) is at `pairs`; rows past n_rows keep everything. Without HAS_TOPK: zeros
    that no tile reads, and no loads (the caller's pair addresses are then dead code)."""
    if HAS_TOPK:
        inside = rows < n_rows
        threshold = tl.load(pairs + rows * stride_row, mask=inside, other=-2 ** 31)
        last_tie = tl.load(pairs + pair_stride + rows * stride_row, mask=inside,
                           other=2 ** 31 - 1)
    else:
        threshold = tl.zeros(rows.shape, tl.int32)
        last_tie = threshold
    return threshold, last_tie


@triton.jit
def topk_tile_keep(scores, local_m, local_n, stride_m, stride_n, rows_left, keys_left, keys,
                   threshold, last_tie, TOPK_FORM: tl.constexpr, EVEN_M: tl.constexpr,
                   EVEN_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """`topk_keep` of one PARTIAL tile, its top-k scores loaded here: [BM, BN] ([BN, BM] when
    TRANSPOSED). scores: the top-k scores at the tile's first (row, key); local_m / local_n:
    row / key offsets in the tile along stride_m / stride_n; rows_left / keys_left: the rows /
    keys the sequence has from there (scores past them read 0); keys [BN], threshold /
    last_tie [BM]: as topk_keep's; TOPK_FORM: (given, rows shared, columns shared)."""
    if TRANSPOSED:
        top_scores = load_pair_tile(scores, local_n, local_m, stride_n, stride_m, keys_left,
                                    rows_left, TOPK_FORM[2], TOPK_FORM[1], EVEN_N, EVEN_M)
    else:
        top_scores = load_pair_tile(scores, local_m, local_n, stride_m, stride_n, rows_left,
                                    keys_left, TOPK_FORM[1], TOPK_FORM[2], EVEN_M, EVEN_N)
    return topk_keep(top_scores, keys, threshold, last_tie, TRANSPOSED)


@triton.jit
def block_bits_keep(slot_ptr, bits, rows, cols, USER_BQ: tl.constexpr, USER_BK: tl.constexpr,
                    TRANSPOSED: tl.constexpr):
    """Element bitmap of the user block whose slot is at slot_ptr (the tile lies inside it):
    [BM, BN] True where visible ([BN, BM] when TRANSPOSED), all True for a block without one
    (slot -1). rows / cols are positions in the sequence."""
    slot = tl.load(slot_ptr)
    # slot -1 reads bitmap 0 (always there) and keeps everything: no masked load
    base = bits + tl.maximum(slot, 0).to(tl.int64) * (USER_BQ * USER_BK)
    if TRANSPOSED:
        tile = tl.load(base + (rows % USER_BQ)[None, :] * USER_BK + (cols % USER_BK)[:, None])
    else:
        tile = tl.load(base + (rows % USER_BQ)[:, None] * USER_BK + (cols % USER_BK)[None, :])
    return (tile != 0) | (slot < 0)


@triton.jit
def row_key_end(row_lens, rows, seqlen_q, seqlen_k, HAS_ROW_LENS: tl.constexpr):
    """[BM] end of the keys each row sees: min(its key length, Sk), or Sk. row_lens points at
    this sequence's first row."""
    if HAS_ROW_LENS:
        end = tl.minimum(tl.load(row_lens + rows, mask=rows < seqlen_q, other=0), seqlen_k)
    else:
        end = tl.zeros(rows.shape, tl.int32) + seqlen_k
    return end


@triton.jit
def sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first query row, Sq, first key row, Sk) of batch off_b: packed sequences read their
    bounds from cu_seqlens, padded batches start at row 0 with the launch's Sq, Sk. The Gluon
    kernels call it with VARLEN only (the zeros below need a layout there)."""
    if VARLEN:
        first_q = tl.load(CuSeqlensQ + off_b)
        seqlen_q = tl.load(CuSeqlensQ + off_b + 1) - first_q
        first_k = tl.load(CuSeqlensK + off_b)
        seqlen_k = tl.load(CuSeqlensK + off_b + 1) - first_k
    else:
        first_q = tl.zeros([], tl.int32)
        first_k = tl.zeros([], tl.int32)
    return first_q, seqlen_q, first_k, seqlen_k


@triton.jit
def used_keys(SeqUsed, off_b, seqlen_k, HAS_SEQUSED: tl.constexpr):
    """The keys batch off_b uses: seqused_k[b] clamped to [0, seqlen_k] (a count past the cache
    cannot read past it), or seqlen_k without seqused_k."""
    if HAS_SEQUSED:
        seqlen_k = tl.minimum(tl.maximum(tl.load(SeqUsed + off_b), 0), seqlen_k)
    return seqlen_k


@triton.jit
def load_pair_tile(base, offs_a, offs_b, stride_a, stride_b, n_a, n_b,
                   A_SHARED: tl.constexpr, B_SHARED: tl.constexpr,
                   EVEN_A: tl.constexpr, EVEN_B: tl.constexpr):
    """[A, B]-broadcastable tile of a mask or bias at local offsets (offs_a, offs_b) from `base`;
    a dimension the tensor broadcasts (size 1, *_SHARED) is loaded once, not per element.
    Elements outside (n_a, n_b) read 0. One return: the compiler wants one result type."""
    if A_SHARED and B_SHARED:
        tile = tl.load(base)
    elif A_SHARED:
        if EVEN_B:
            tile = tl.load(base + offs_b * stride_b)[None, :]
        else:
            tile = tl.load(base + offs_b * stride_b, mask=offs_b < n_b, other=0)[None, :]
    elif B_SHARED:
        if EVEN_A:
            tile = tl.load(base + offs_a * stride_a)[:, None]
        else:
            tile = tl.load(base + offs_a * stride_a, mask=offs_a < n_a, other=0)[:, None]
    else:
        ptrs = base + offs_a[:, None] * stride_a + offs_b[None, :] * stride_b
        if EVEN_A and EVEN_B:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_a[:, None] < n_a) & (offs_b[None, :] < n_b), other=0)
    return tile


@triton.jit
def store_pair_tile(base, value, offs_a, offs_b, stride_a, stride_b, n_a, n_b,
                    ACCUMULATE: tl.constexpr):
    """Store (or add into, for a sum over query heads within one program) an [A, B] tile."""
    ptrs = base + offs_a[:, None] * stride_a + offs_b[None, :] * stride_b
    inside = (offs_a[:, None] < n_a) & (offs_b[None, :] < n_b)
    if ACCUMULATE:
        value += tl.load(ptrs, mask=inside, other=0.0)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=inside)


@triton.jit
def dropout_keep(seed, rng_base, offs_q, offs_k, rng_stride, dropout_p, TRANSPOSED: tl.constexpr):
    """Dropout's keep decision for (query offs_q, key offs_k) of one (batch, head): [BM, BN], or
    [BN, BM] when TRANSPOSED. One Philox call (4 x 32 bits) serves 8 keys of a row: key k takes
    16-bit draw k % 8 of counter rng_base + q * rng_stride + k // 8, the same in every pass that
    visits it, and is kept iff the draw >= p * 2^16 (the launcher makes p a multiple of 2^-16).
    offs_k starts at a multiple of 8."""
    rows: tl.constexpr = offs_q.shape[0]
    cols: tl.constexpr = offs_k.shape[0]
    groups = tl.min(tl.reshape(offs_k, [cols // 8, 8]), 1) // 8  # [BN / 8]
    counters = rng_base + offs_q[:, None].to(tl.int64) * rng_stride + groups[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)  # [BM, BN / 8] each
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [rows, cols // 8, 4])
    draws = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [rows, cols])  # key 8g + 2w + h
    # p arrives as a Python float under the interpreter: make it a tensor before the cast
    keep = draws >= (tl.zeros([], tl.float32) + dropout_p * 65536.0).to(tl.uint32)
    if TRANSPOSED:
        keep = tl.trans(keep)
    return keep


@triton.jit
def tanh(x):
    # exp2-based so it runs the same under the interpreter; saturates cleanly at +-1
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_log2(qk, qk_scale_log2, softcap_inv_scaled, softcap_log2, SOFTCAP: tl.constexpr):
    """Raw q.k^T -> scores in log2 units (and tanh, for the softcap backward chain rule)."""
    if SOFTCAP:
        capped = tanh(qk * softcap_inv_scaled)  # tanh(scale * qk / softcap)
        return capped * softcap_log2, capped
    return qk * qk_scale_log2, qk


@triton.jit
def implicit_kv_range(
    start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Key tiles for query rows [start_m, start_m + BM): PARTIAL [lo, full_lo), FULL [full_lo,
    full_hi), PARTIAL [full_hi, hi). A tile is FULL only if every row sees every key in it.
    Bounds are clamped to >= 0 before dividing: integer division of negatives differs between
    the compiled kernel (truncation) and the interpreter (floor)."""
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    key_lo = 0
    full_key_lo = 0
    key_hi = seqlen_k
    full_key_hi = seqlen_k
    if HAS_LEFT:
        key_lo = tl.maximum(start_m + diag_offset - window_left, 0)
        full_key_lo = tl.maximum(last_m + diag_offset - window_left, 0)
    if HAS_RIGHT:
        key_hi = tl.maximum(tl.minimum(last_m + diag_offset + window_right + 1, seqlen_k), 0)
        full_key_hi = tl.maximum(tl.minimum(start_m + diag_offset + window_right + 1, seqlen_k), 0)
    lo = key_lo // BLOCK_N
    hi = tl.maximum(tl.cdiv(key_hi, BLOCK_N), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_key_lo, BLOCK_N), lo), hi)
    full_hi = tl.minimum(tl.maximum(full_key_hi // BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def implicit_q_range(
    start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Query tiles that see keys [start_n, start_n + BN), split like implicit_kv_range."""
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    row_lo = 0
    full_row_lo = 0
    row_hi = seqlen_q
    full_row_hi = seqlen_q
    if HAS_RIGHT:
        row_lo = tl.maximum(start_n - diag_offset - window_right, 0)
        full_row_lo = tl.maximum(last_n - diag_offset - window_right, 0)
    if HAS_LEFT:
        row_hi = tl.maximum(tl.minimum(last_n - diag_offset + window_left + 1, seqlen_q), 0)
        full_row_hi = tl.maximum(tl.minimum(start_n - diag_offset + window_left + 1, seqlen_q), 0)
    lo = row_lo // BLOCK_M
    hi = tl.maximum(tl.cdiv(row_hi, BLOCK_M), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_row_lo, BLOCK_M), lo), hi)
    full_hi = tl.minimum(tl.maximum(full_row_hi // BLOCK_M, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def clip_ranges(lo, full_lo, full_hi, hi, full_end, end):
    """Implicit (lo, full_lo, full_hi, hi) ranges narrowed by the per-row key lengths: tiles from
    `end` on are seen by no row of this tile (dropped), FULL tiles from `full_end` on by only
    some (PARTIAL: they join the last phase)."""
    hi = tl.maximum(tl.minimum(hi, end), lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(tl.minimum(tl.minimum(full_hi, full_end), hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def length_kv_range(lo, full_lo, full_hi, hi, key_end, rows, seqlen_q, seqlen_k,
                    BLOCK_N: tl.constexpr):
    """Key-tile ranges of a query tile narrowed to its rows' key lengths (key_end [BM]): FULL up
    to its shortest row, PARTIAL up to its longest, nothing past it."""
    longest = tl.max(key_end, 0)  # rows past Sq end at 0
    shortest = tl.min(tl.where(rows < seqlen_q, key_end, seqlen_k), 0)
    return clip_ranges(lo, full_lo, full_hi, hi, shortest // BLOCK_N, tl.cdiv(longest, BLOCK_N))


@triton.jit
def length_q_range(lo, full_lo, full_hi, hi, row_lens, seqlen_q, seqlen_k, start_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Query-tile ranges of key tile [start_n, start_n + BN) narrowed to the rows' key lengths,
    for rows sorted by length, longest first: the rows that reach the tile are a prefix, and so
    are those that see all of it. One pass over the lengths (CHUNK at a time), no search."""
    key_hi = tl.minimum(start_n + BLOCK_N, seqlen_k)
    reaching = 0
    covering = 0
    for first in range(0, seqlen_q, CHUNK):
        rows = first + tl.arange(0, CHUNK)
        lens = tl.minimum(tl.load(row_lens + rows, mask=rows < seqlen_q, other=0), seqlen_k)
        reaching += tl.sum((lens > start_n).to(tl.int32), 0)
        covering += tl.sum((lens >= key_hi).to(tl.int32), 0)
    return clip_ranges(lo, full_lo, full_hi, hi, covering // BLOCK_M, tl.cdiv(reaching, BLOCK_M))


@triton.jit
def schedule_phase(
    phase: tl.constexpr, EXPLICIT: tl.constexpr, placeholder, part_num, part_idx, full_num,
    full_idx, lo, full_lo, full_hi, hi,
):
    """(tile_list, first_tile, num_tiles) of phase 0 (PARTIAL), 1 (FULL) or 2 (PARTIAL): from
    the explicit lists, or from the implicit ranges [lo, full_lo), [full_lo, full_hi), [full_hi, hi)."""
    tile_list = placeholder
    first_tile = 0
    if EXPLICIT:
        if phase == 0:
            tile_list = part_idx
            num_tiles = tl.load(part_num)
        elif phase == 1:
            tile_list = full_idx
            num_tiles = tl.load(full_num)
        else:
            num_tiles = 0
    else:
        if phase == 0:
            first_tile = lo
            num_tiles = full_lo - lo
        elif phase == 1:
            first_tile = full_lo
            num_tiles = full_hi - full_lo
        else:
            first_tile = full_hi
            num_tiles = hi - full_hi
    return tile_list, first_tile, num_tiles


@triton.jit
def schedule_rows(
    Num, Idx, FullNum, FullIdx, off_b, off_h, row,
    stride_nb, stride_nh, stride_nr, stride_ib, stride_ih, stride_ir,
    stride_fnb, stride_fnh, stride_fnr, stride_fib, stride_fih, stride_fir, head_div,
):
    """Pointers to one row of an explicit schedule: (partial count, partial list, full count,
    full list) of (batch, query head, tile row); broadcast dims have stride 0. Query head off_h
    walks list head off_h // head_div (TileLists.operands' last stride item: lists may have
    fewer heads than the queries)."""
    off_h = off_h // head_div
    part_num = Num + off_b * stride_nb + off_h * stride_nh + row * stride_nr
    part_idx = Idx + off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih \
        + row.to(tl.int64) * stride_ir
    full_num = FullNum + off_b * stride_fnb + off_h * stride_fnh + row * stride_fnr
    full_idx = FullIdx + off_b.to(tl.int64) * stride_fib + off_h.to(tl.int64) * stride_fih \
        + row.to(tl.int64) * stride_fir
    return part_num, part_idx, full_num, full_idx
