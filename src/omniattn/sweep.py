"""Randomized differential sweep: `omniattn.attention` against the float64 reference on random
configurations of every feature, forward and backward (`omniattn check --sweep N --seed S`).

Config i of sweep seed S is drawn from its own seed, `config_seed(S, i)`, alone: any config
re-runs by itself with `omniattn check --config <its seed>` (on the same kind of device: CUDA
draws GPU sizes and fp16/bf16, the CPU draws interpreter sizes and fp16/fp32).

The pass rule, for the output, the lse (when returned) and each gradient separately:
err(kernel) = max |kernel - ref64|, err(torch) = max |plain - ref64|, where ref64 is
`attention_reference` on float64 inputs and plain is `attention_reference(upcast=False)` in the
input dtype; pass iff err(kernel) <= 2 * err(torch) + 1e-3 * max |ref64| + 1e-4. A NaN or inf of
the kernel where ref64 is finite fails; rows that see no key must be exactly 0 (output and dq).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import math
import os
import random
import time
import traceback
from collections.abc import Callable, Iterator

import torch

RELATIVE_TOLERANCE = 1e-3  # of max |ref64|
ABSOLUTE_FLOOR = 1e-4  # what a reference of all zeros allows: fp32 sums that cancel to 0
CONFIG_TIMEOUT_S = 900  # a config running longer in a worker (a hung kernel) fails
EMPTY_ROWS = "[empty rows]"  # the name suffix of the exact-zero checks of rows seeing no key


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the draws may pick: dtypes, head dims (odd ones are padded by the kernels), batch,
    heads, (low, high) length ranges, block sizes, and a cap on B * H * Sq * Sk."""
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    odd_head_dims: tuple[int, ...]
    max_batch: int
    max_heads: int
    length_ranges: tuple[tuple[int, int], ...]
    block_sizes: tuple[int, ...]
    max_elements: int
    float_mask_dtypes: tuple[str, ...]


GPU_LIMITS = Limits(dtypes=("float16", "bfloat16"), head_dims=(32, 64, 96, 128, 192, 256),
                    odd_head_dims=(24, 40, 72, 80, 100, 160), max_batch=3, max_heads=16,
                    length_ranges=((1, 16), (1, 128), (65, 512), (257, 1000)),
                    block_sizes=(16, 32, 48, 64, 96, 128, 256), max_elements=1 << 23,
                    float_mask_dtypes=("float16", "bfloat16", "float32"))
# the interpreter computes bf16 wrongly, and runs each program in Python: small and fp16/fp32
INTERPRETER_LIMITS = Limits(dtypes=("float16", "float32"), head_dims=(16, 32, 64),
                            odd_head_dims=(24, 40), max_batch=2, max_heads=4,
                            length_ranges=((1, 16), (1, 40), (17, 64)), block_sizes=(16, 32, 48),
                            max_elements=1 << 15, float_mask_dtypes=("float16", "float32"))


def limits_for(device: torch.device) -> Limits:
    return GPU_LIMITS if device.type == "cuda" else INTERPRETER_LIMITS


def config_seed(sweep_seed: int, index: int) -> int:
    """The seed of config `index` of a sweep: a hash of both, so configs are independent."""
    digest = hashlib.blake2b(f"{sweep_seed}:{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


@dataclasses.dataclass(frozen=True)
class ElementSpec:
    """An attn_mask or attn_bias: its shape (size-1 dims broadcast; packed: (total_q|1, Hm,
    max_seqlen_k|1)), dtype, and `amount`: the kept fraction of a mask, the scale of a bias.
    empty_rows: a mask hides every key from about a fifth of its rows."""
    shape: tuple[int, ...]
    dtype: str
    amount: float
    requires_grad: bool = False
    empty_rows: bool = False


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A block mask: the omniattn.masks builder, its block size, and the builder's options
    (batch / heads of the lists, density, window, ...) as (name, value) pairs."""
    builder: str
    block_size: tuple[int, int]
    options: tuple[tuple[str, object], ...] = ()

    def option(self, name: str):
        return dict(self.options)[name]


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One drawn call. Varlen: `lengths_q` / `lengths_k` per sequence (batch = their count),
    seqlen_q / seqlen_k their maxima. Tensor values come from a generator seeded with `seed`."""
    seed: int
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    softmax_scale: float | None = None
    mask: ElementSpec | None = None
    bias: ElementSpec | None = None
    row_lengths: str | None = None  # the pattern of seqlens_k_per_row (ROW_PATTERNS)
    row_lengths_flat: bool = False  # passed as (B * Sq,)
    block: BlockSpec | None = None
    lengths_q: tuple[int, ...] | None = None
    lengths_k: tuple[int, ...] | None = None
    max_seqlens_given: bool = True
    return_lse: bool = False
    deterministic: bool = False
    backward: bool = True

    @property
    def varlen(self) -> bool:
        return self.lengths_q is not None

    @property
    def families(self) -> list[str]:
        """The feature families this config counts in (one config may count in several);
        "dense" is a call with no mask of any kind."""
        masks = {"causal": self.causal, "window": self.window is not None,
                 "mask": self.mask is not None, "bias": self.bias is not None,
                 "rows": self.row_lengths is not None, "block": self.block is not None,
                 "varlen": self.varlen}
        names = [name for name, on in masks.items() if on] or ["dense"]
        if self.mask is not None and self.bias is not None:
            names.append("mask+bias")
        extras = {"gqa": self.heads_k < self.heads, "softcap": self.softcap > 0,
                  "lse": self.return_lse, "deterministic": self.deterministic,
                  "padded-dim": self.head_dim & (self.head_dim - 1) != 0,
                  "fwd-only": not self.backward}
        return names + [name for name, on in extras.items() if on]

    def describe(self) -> str:
        """One line naming every drawn feature."""
        if self.varlen:
            parts = [f"varlen q{list(self.lengths_q)} k{list(self.lengths_k)}"]
        else:
            parts = [f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k}"]
        parts.append(f"H{self.heads}/Hk{self.heads_k} D{self.head_dim} {self.dtype}")
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.softcap:
            parts.append(f"softcap={self.softcap}")
        if self.softmax_scale is not None:
            parts.append(f"scale={self.softmax_scale:.4g}")
        if self.mask is not None:
            m = self.mask
            parts.append(f"mask{m.shape} {m.dtype} keep={m.amount:.2f}"
                         + (" empty-rows" if m.empty_rows else ""))
        if self.bias is not None:
            b = self.bias
            parts.append(f"bias{b.shape} {b.dtype} x{b.amount}" + (" grad" if b.requires_grad
                                                                    else ""))
        if self.row_lengths is not None:
            parts.append(f"rows={self.row_lengths}" + (" flat" if self.row_lengths_flat else ""))
        if self.block is not None:
            options = ",".join(f"{k}={v}" for k, v in self.block.options)
            parts.append(f"block={self.block.builder}{self.block.block_size}[{options}]")
        if self.varlen and not self.max_seqlens_given:
            parts.append("max_seqlen=None")
        for flag in ("return_lse", "deterministic"):
            if getattr(self, flag):
                parts.append(flag)
        if not self.backward:
            parts.append("forward-only")
        return " ".join(parts)


ROW_PATTERNS = ("uniform", "full-some-empty", "constant", "ramp")
BLOCK_BUILDERS = ("blocks", "causal", "window", "prefix_lm", "document", "streaming",
                  "predicate")


def _draw_length(rng: random.Random, limits: Limits, low: int | None = None) -> int:
    """A length in one of the ranges: odd and even alike, now and then a multiple of 16."""
    range_low, high = rng.choice(limits.length_ranges)
    length = rng.randint(range_low if low is None else low, high)
    if rng.random() < 0.15 and length >= 16:
        length -= length % 16
    return length


def _draw_window(rng: random.Random, seqlen_k: int) -> tuple[int, int]:
    def side() -> int:
        return -1 if rng.random() < 0.3 else rng.randint(0, max(seqlen_k, 1))
    return side(), side()


def _draw_element(rng: random.Random, is_mask: bool, dims: dict, dtype: str,
                  limits: Limits) -> ElementSpec:
    """A mask / bias in one broadcast form: each dim full or 1, heads in {1, Hk, H}."""
    shape = (rng.choice((1, dims["rows"])),) if dims["packed"] else \
        (rng.choice((1, dims["batch"])),)
    shape += (rng.choice((1, dims["heads_k"], dims["heads"])),)
    if not dims["packed"]:
        shape += (rng.choice((1, dims["seqlen_q"])),)
    shape += (rng.choice((1, dims["seqlen_k"])),)
    if is_mask:
        kind = rng.random()
        mask_dtype = "bool" if kind < 0.5 else "uint8" if kind < 0.7 else \
            rng.choice(limits.float_mask_dtypes)
        keep = rng.choice((1.0, 0.05, rng.uniform(0.3, 0.95), rng.uniform(0.3, 0.95)))
        row_dim = 0 if dims["packed"] else 2
        empty_rows = shape[row_dim] > 1 and rng.random() < 0.3
        return ElementSpec(shape, mask_dtype, round(keep, 3), empty_rows=empty_rows)
    bias_dtype = dtype if rng.random() < 0.75 else rng.choice(
        sorted({*limits.dtypes, "float32"} - {dtype}))
    return ElementSpec(shape, bias_dtype, rng.choice((0.5, 1.0, 2.0, 4.0)),
                       requires_grad=rng.random() < 0.7)


def _draw_block(rng: random.Random, config: dict, limits: Limits) -> BlockSpec:
    """A block mask for (Sq, Sk) (varlen: the maxima, lists per sequence or shared)."""
    block_q = rng.choice(limits.block_sizes)
    block_k = block_q if rng.random() < 0.5 else rng.choice(limits.block_sizes)
    seqlen_q, seqlen_k = config["seqlen_q"], config["seqlen_k"]
    if config.get("lengths_q") is not None:
        # varlen: lists whose batch dim indexes the sequences, no predicate of their own
        builder = rng.choice(("blocks", "predicate"))
    else:
        builder = rng.choice(BLOCK_BUILDERS)
        if builder == "document" and seqlen_q != seqlen_k:
            builder = "blocks"
    lists = (("batch", rng.choice((1, config["batch"]))),
             ("heads", rng.choice((1, config["heads"]))))
    if builder == "blocks":
        options = (*lists, ("density", round(rng.uniform(0.2, 0.95), 2)))
    elif builder == "causal":
        options = ()
    elif builder == "window":
        options = (("window", _draw_window(rng, seqlen_k)), ("causal", rng.random() < 0.3))
    elif builder == "prefix_lm":
        options = (("prefix", rng.randint(0, seqlen_k)),)
    elif builder == "document":
        cuts = sorted(rng.sample(range(1, seqlen_q), min(rng.randint(0, 3), seqlen_q - 1)))
        options = (("bounds", (0, *cuts, seqlen_q)), ("causal", rng.random() < 0.5))
    elif builder == "streaming":
        in_tokens = rng.random() < 0.5
        if in_tokens:
            options = (("sink", rng.randint(0, max(seqlen_k // 4, 1))),
                       ("local", rng.randint(1, max(seqlen_k, 1))), ("in_tokens", True))
        else:
            options = (("sink", rng.randint(0, 2)), ("local", rng.randint(1, 3)),
                       ("in_tokens", False))
    else:
        kind = rng.choice(("modular", "slope", "stripes"))
        if kind == "modular":
            params = (rng.randint(1, 7), rng.randint(1, 7), rng.randint(0, 3), rng.randint(2, 5))
        elif kind == "slope":
            params = (rng.randint(1, 4), rng.randint(1, 4), rng.randint(-seqlen_k, seqlen_k))
        else:
            params = (rng.choice((3, 8, 16, 24, 40)),)
        options = (*lists, ("kind", kind), ("params", params))
    return BlockSpec(builder, (block_q, block_k), options)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_config(seed: int, limits: Limits) -> SweepConfig:
    """The config of `seed`: every choice from random.Random(seed), within `limits`; only
    combinations `attention` accepts."""
    rng = random.Random(seed)
    dtype = rng.choice(limits.dtypes)
    head_dim = rng.choice(limits.odd_head_dims) if rng.random() < 0.15 else \
        rng.choice(limits.head_dims)
    batch = rng.randint(1, limits.max_batch)
    config: dict = dict(seed=seed, dtype=dtype, head_dim=head_dim, batch=batch)
    if rng.random() < 0.2:
        # varlen: sequences of 0 rows or 0 keys among them, at least one row and one key
        lengths_q = [0 if rng.random() < 0.1 else _draw_length(rng, limits, 1)
                     for _ in range(batch)]
        lengths_k = list(lengths_q) if rng.random() < 0.4 else \
            [0 if rng.random() < 0.1 else _draw_length(rng, limits, 1) for _ in range(batch)]
        lengths_q[0], lengths_k[-1] = max(lengths_q[0], 1), max(lengths_k[-1], 1)
        config.update(lengths_q=tuple(lengths_q), lengths_k=tuple(lengths_k),
                      seqlen_q=max(lengths_q), seqlen_k=max(lengths_k),
                      max_seqlens_given=rng.random() < 0.7)
    else:
        seqlen_q = _draw_length(rng, limits)
        seqlen_k = seqlen_q if rng.random() < 0.35 else _draw_length(rng, limits)
        config.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    scores_per_head = batch * config["seqlen_q"] * config["seqlen_k"]
    heads = rng.randint(1, max(1, min(limits.max_heads, limits.max_elements // scores_per_head)))
    heads_k = rng.choice(_divisors(heads)) if rng.random() < 0.6 else heads
    config.update(heads=heads, heads_k=heads_k)
    seqlen_k = config["seqlen_k"]
    config["causal"] = rng.random() < 0.3
    if rng.random() < 0.2:
        config["window"] = _draw_window(rng, seqlen_k)
    if rng.random() < 0.15:
        config["softcap"] = round(rng.uniform(1.0, 30.0), 2)
    if rng.random() < 0.1:
        config["softmax_scale"] = rng.uniform(0.3, 3.0) / math.sqrt(head_dim)
    packed = config.get("lengths_q") is not None
    dims = dict(packed=packed, batch=batch, heads=heads, heads_k=heads_k,
                seqlen_q=config["seqlen_q"], seqlen_k=seqlen_k,
                rows=sum(config.get("lengths_q") or ()))
    if rng.random() < 0.3:
        config["mask"] = _draw_element(rng, True, dims, dtype, limits)
    if rng.random() < 0.3:
        config["bias"] = _draw_element(rng, False, dims, dtype, limits)
    if rng.random() < 0.2:
        config["row_lengths"] = rng.choice(ROW_PATTERNS)
        config["row_lengths_flat"] = not packed and rng.random() < 0.3
    if rng.random() < 0.2:
        config["block"] = _draw_block(rng, config, limits)
    config["return_lse"] = rng.random() < 0.4
    config["deterministic"] = rng.random() < 0.2
    config["backward"] = rng.random() < 0.9
    return SweepConfig(**config)


@dataclasses.dataclass
class Call:
    """The tensors of a config's call: q, k, v, the bias (a differentiable leaf too where
    bias_grad), the other arguments, what only the kernels take, the incoming gradients."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    bias_grad: bool
    options: dict  # every other argument the reference takes too
    kernel_options: dict  # max_seqlen_q / k, deterministic
    dout: torch.Tensor
    dlse: torch.Tensor | None  # with return_lse: the gradient reaching lse

    def arguments(self) -> dict:
        """The keyword arguments of `attention` (all but q, k, v)."""
        return dict(self.options, attn_bias=self.bias, **self.kernel_options)


def _element_tensor(spec: ElementSpec, is_mask: bool, generator: torch.Generator,
                    device: torch.device) -> torch.Tensor:
    """The mask (keep-fraction `amount`, in its dtype; numeric masks keep nonzero values) or the
    bias (randn * `amount`) of `spec`."""
    if not is_mask:
        bias = torch.randn(spec.shape, generator=generator, device=device) * spec.amount
        return bias.to(getattr(torch, spec.dtype))
    keep = torch.rand(spec.shape, generator=generator, device=device) < spec.amount
    if spec.empty_rows:
        row_dim = 2 if len(spec.shape) == 4 else 0
        rows = torch.rand(spec.shape[row_dim], generator=generator, device=device) < 0.2
        keep = keep & ~rows.view([-1 if d == row_dim else 1 for d in range(len(spec.shape))])
    if spec.dtype == "bool":
        return keep
    # numeric masks keep where nonzero: kept values other than 1 too
    values = torch.rand(spec.shape, generator=generator, device=device) * 4 - 2
    values = torch.where(values.abs() < 0.1, torch.ones_like(values), values)
    if spec.dtype == "uint8":
        values = values.abs().mul(60).clamp(min=1)
    return torch.where(keep, values, torch.zeros_like(values)).to(getattr(torch, spec.dtype))


def _row_lengths(pattern: str, limit: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """int32 lengths in [0, limit] (limit: each row's key count) of a ROW_PATTERNS pattern."""
    draw = torch.rand(limit.shape, generator=generator, device=limit.device)
    if pattern == "uniform":
        lengths = (draw * (limit + 1)).floor()
    elif pattern == "full-some-empty":
        lengths = torch.where(draw < 0.2, torch.zeros_like(limit), limit)
    elif pattern == "constant":
        lengths = torch.minimum(limit, (draw.flatten()[0] * (limit.max() + 1)).floor())
    else:  # ramp along the rows (the last dim)
        count = limit.shape[-1]
        fraction = torch.arange(1, count + 1, device=limit.device) / count
        lengths = (limit * fraction).floor()
    return lengths.to(torch.int32)


def _mask_mod(kind: str, params: tuple) -> Callable:
    """An element predicate for block_mask_from_predicate: "modular" (a scattered pattern of
    b, h, q, k), "slope" (keys below a line through the rows) or "stripes" (a checkerboard of
    squares of `width`)."""
    if kind == "modular":
        a, b, c, m = params
        return lambda bi, h, q, k: (q * a + k * b + h * c + bi) % m != 0
    if kind == "slope":
        numerator, denominator, offset = params
        return lambda bi, h, q, k: k * denominator <= q * numerator + offset
    width, = params
    return lambda bi, h, q, k: (q // width + k // width + bi + h) % 2 == 0


def _block_mask(spec: BlockSpec, seqlen_q: int, seqlen_k: int, generator: torch.Generator,
                device: torch.device):
    from .masks import builders

    size = spec.block_size
    if spec.builder == "blocks":
        n_q, n_k = -(-seqlen_q // size[0]), -(-seqlen_k // size[1])
        picture = torch.rand(spec.option("batch"), spec.option("heads"), n_q, n_k,
                             generator=generator, device=device) < spec.option("density")
        return builders.block_mask_from_blocks(picture, size, seq_lengths=(seqlen_q, seqlen_k))
    if spec.builder == "causal":
        return builders.causal_block_mask(seqlen_q, seqlen_k, size, device=device)
    if spec.builder == "window":
        return builders.window_block_mask(seqlen_q, seqlen_k, spec.option("window"),
                                          spec.option("causal"), size, device=device)
    if spec.builder == "prefix_lm":
        return builders.prefix_lm_block_mask(seqlen_q, seqlen_k, spec.option("prefix"), size,
                                             device=device)
    if spec.builder == "document":
        bounds = torch.tensor(spec.option("bounds"), dtype=torch.int32, device=device)
        return builders.document_block_mask(bounds, size, spec.option("causal"))
    if spec.builder == "streaming":
        return builders.streaming_block_mask(seqlen_q, seqlen_k, spec.option("sink"),
                                             spec.option("local"), size,
                                             spec.option("in_tokens"), device=device)
    return builders.block_mask_from_predicate(
        _mask_mod(spec.option("kind"), spec.option("params")), spec.option("batch"),
        spec.option("heads"), seqlen_q, seqlen_k, size, device=device)


def build_call(config: SweepConfig, device: torch.device | str) -> Call:
    """The config's tensors on `device`, from a generator seeded with config.seed."""
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)

    def randn(*shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    heads, heads_k, head_dim = config.heads, config.heads_k, config.head_dim
    options: dict = dict(causal=config.causal, window=config.window, softcap=config.softcap,
                         softmax_scale=config.softmax_scale)
    kernel_options: dict = dict(deterministic=config.deterministic)
    if config.varlen:
        total_q, total_k = sum(config.lengths_q), sum(config.lengths_k)
        q, k, v = randn(total_q, heads, head_dim), randn(total_k, heads_k, head_dim), \
            randn(total_k, heads_k, head_dim)

        def offsets(lengths) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                                device=device)

        options.update(cu_seqlens_q=offsets(config.lengths_q),
                       cu_seqlens_k=offsets(config.lengths_k))
        if config.max_seqlens_given:
            kernel_options.update(max_seqlen_q=config.seqlen_q, max_seqlen_k=config.seqlen_k)
        # each row's key count: that of its sequence
        row_limit = torch.repeat_interleave(
            torch.tensor(config.lengths_k, device=device),
            torch.tensor(config.lengths_q, device=device))
    else:
        batch, seqlen_q, seqlen_k = config.batch, config.seqlen_q, config.seqlen_k
        q = randn(batch, seqlen_q, heads, head_dim)
        k, v = randn(batch, seqlen_k, heads_k, head_dim), randn(batch, seqlen_k, heads_k, head_dim)
        row_limit = torch.full((batch, seqlen_q), seqlen_k, device=device)
    if config.mask is not None:
        options["attn_mask"] = _element_tensor(config.mask, True, generator, device)
    bias = None if config.bias is None else \
        _element_tensor(config.bias, False, generator, device)
    bias_grad = bias is not None and config.bias.requires_grad and config.backward
    if config.row_lengths is not None:
        lengths = _row_lengths(config.row_lengths, row_limit, generator)
        options["seqlens_k_per_row"] = lengths.flatten() if config.row_lengths_flat else lengths
    if config.block is not None:
        options["block_mask"] = _block_mask(config.block, config.seqlen_q, config.seqlen_k,
                                            generator, device)
    dout = randn(*q.shape)
    dlse = None
    if config.return_lse:
        lse_shape = (heads, q.shape[0]) if config.varlen else (config.batch, heads,
                                                               config.seqlen_q)
        dlse = torch.randn(lse_shape, generator=generator, device=device)
    return Call(q, k, v, bias, bias_grad, options, kernel_options, dout, dlse)


def evaluate(attention_fn: Callable, call: Call, dtype: torch.dtype | None, backward: bool,
             return_lse: bool, **extra) -> dict[str, torch.Tensor]:
    """{out, lse?, dq, dk, dv, dbias?} of attention_fn on fresh leaves made from the call's
    tensors, cast to `dtype` (None: as they are). The gradients are those of
    sum(out * dout) + sum(lse * dlse) (the lse term where the config returns lse)."""
    def leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        t = t.detach() if dtype is None else t.detach().to(dtype)
        return t.clone().requires_grad_(requires_grad)

    leaves = [leaf(t, backward) for t in (call.q, call.k, call.v)]
    bias = None if call.bias is None else leaf(call.bias, backward and call.bias_grad)
    if bias is not None and bias.requires_grad:
        leaves.append(bias)
    result = attention_fn(*leaves[:3], attn_bias=bias, return_lse=return_lse, **call.options,
                          **extra)
    out, lse = result if return_lse else (result, None)
    values = {"out": out.detach()}
    if lse is not None:
        values["lse"] = lse.detach()
    if backward:
        outputs, grads = [out], [call.dout.to(out.dtype)]
        if lse is not None and call.dlse is not None:
            outputs.append(lse)
            grads.append(call.dlse)
        names = ("dq", "dk", "dv", "dbias")
        values.update(zip(names, torch.autograd.grad(outputs, leaves, grads)))
    return values


@dataclasses.dataclass(frozen=True)
class QuantityCheck:
    """One compared quantity: the kernel's error, the plain dtype's error, the bound, and why
    it failed ("" if it passed)."""
    name: str
    error: float
    torch_error: float
    bound: float
    reason: str = ""

    @property
    def passed(self) -> bool:
        return not self.reason


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |actual - expected| in float64; matching infinities (lse of rows that see no key)
    count 0, a NaN counts inf."""
    actual, expected = actual.double(), expected.double()
    same_inf = torch.isinf(actual) & (actual == expected)
    diff = torch.where(same_inf, torch.zeros_like(actual), (actual - expected).abs())
    if diff.numel() == 0:
        return 0.0
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


def check_quantity(name: str, kernel: torch.Tensor, reference: torch.Tensor,
                   plain: torch.Tensor) -> QuantityCheck:
    """The pass rule (module docstring) for one quantity. Where `plain` itself is non-finite
    and the reference is not, that element leaves the baseline out (it never widens the
    bound)."""
    if kernel.shape != reference.shape:
        return QuantityCheck(name, math.inf, math.nan, math.nan,
                             f"shape {tuple(kernel.shape)}, expected {tuple(reference.shape)}")
    reference = reference.double()
    finite = torch.isfinite(reference)
    scale = float(reference[finite].abs().max()) if bool(finite.any()) else 0.0
    plain = plain.double()
    usable = torch.isfinite(plain) | ~finite
    torch_error = max_error(plain[usable], reference[usable])
    bound = 2 * torch_error + RELATIVE_TOLERANCE * scale + ABSOLUTE_FLOOR
    error = max_error(kernel, reference)
    reason = ""
    wrong_nonfinite = ~torch.isfinite(kernel.double()) & finite
    if bool(wrong_nonfinite.any()):
        reason = f"{int(wrong_nonfinite.sum())} NaN/inf where the reference is finite"
    elif not error <= bound:
        reason = f"error {error:.3g} > bound {bound:.3g}"
    return QuantityCheck(name, error, torch_error, bound, reason)


def _empty_rows(lse: torch.Tensor, packed: bool) -> torch.Tensor:
    """Bool rows that see no key, laid out like the output's leading dims: (B, Sq, H) from lse
    (B, H, Sq), packed (total_q, H) from (H, total_q)."""
    empty = torch.isneginf(lse)
    return empty.transpose(0, 1) if packed else empty.transpose(1, 2)


def compare(config: SweepConfig, kernel: dict, reference: dict, plain: dict) -> list[QuantityCheck]:
    """Every quantity of `kernel` against the float64 `reference` and the `plain` baseline,
    then the rows that see no key (from the reference's lse): exactly 0 in out and dq."""
    checks = [check_quantity(name, kernel[name], reference[name], plain[name])
              for name in kernel]
    empty = _empty_rows(reference["lse"], config.varlen)
    for name in ("out", "dq"):
        if name in kernel and kernel[name].shape == reference[name].shape and bool(empty.any()):
            rows = kernel[name][empty]
            nonzero = int((rows != 0).any(-1).sum())
            reason = f"{nonzero} of {rows.shape[0]} rows that see no key are not 0" \
                if nonzero else ""
            worst = float(rows.double().abs().nan_to_num(math.inf).max()) if rows.numel() else 0.0
            checks.append(QuantityCheck(name + EMPTY_ROWS, worst, 0.0, 0.0, reason))
    return checks


@dataclasses.dataclass
class ConfigResult:
    """The outcome of one config: its checks, or the exception it raised."""
    seed: int
    families: list[str]
    description: str
    checks: list[QuantityCheck] = dataclasses.field(default_factory=list)
    exception: str = ""
    device_broken: bool = False  # a CUDA error that leaves the context unusable
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.exception and all(c.passed for c in self.checks)

    def failures(self) -> str:
        """What failed, in a few words per quantity."""
        if self.exception:
            return self.exception
        return "; ".join(f"{c.name}: {c.reason}" for c in self.checks if not c.passed)


def run_config(config: SweepConfig, device: torch.device | str) -> ConfigResult:
    """The kernels, the float64 reference and the plain dtype on the config's call, compared."""
    import omniattn
    from .reference import attention_reference

    device = torch.device(device)
    started = time.perf_counter()
    result = ConfigResult(config.seed, config.families, config.describe())
    try:
        call = build_call(config, device)
        kernel = evaluate(omniattn.attention, call, None, config.backward, config.return_lse,
                          **call.kernel_options)
        reference = evaluate(attention_reference, call, torch.float64, config.backward, True)
        plain = evaluate(attention_reference, call, None, config.backward, True, upcast=False)
        result.checks = compare(config, kernel, reference, plain)
    except Exception as exc:  # a raising config is a failed config, reported with its seed
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" \
            if frames else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result.exception = f"raised {type(exc).__name__}{where}: {first_line}"
        accelerator_error = getattr(torch, "AcceleratorError", ())
        result.device_broken = device.type == "cuda" and (
            isinstance(exc, accelerator_error) or "CUDA error" in str(exc))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - started
    return result


def run_seed(seed: int, device: torch.device | str) -> ConfigResult:
    """Draw the config of `seed` for `device` (GPU or interpreter limits) and run it."""
    device = torch.device(device)
    return run_config(draw_config(seed, limits_for(device)), device)


def kernels_run_here(device: torch.device) -> bool:
    """Whether this process can run the kernels on `device`: CUDA, or the CPU with
    TRITON_INTERPRET=1 set before triton was imported (what tests/conftest.py does)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _serve(connection, device_index: int | None) -> None:
    """A worker: receive seeds, send back their ConfigResult, stop at None (or after a CUDA
    error that broke its context, to be replaced)."""
    if device_index is not None:
        torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index) if device_index is not None \
        else torch.device("cpu")
    while True:
        seed = connection.recv()
        if seed is None:
            return
        result = run_seed(seed, device)
        connection.send(result)
        if result.device_broken:
            return


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """os.environ with `variables` set (what spawned workers inherit), restored after."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class _Worker:
    process: object
    connection: object
    seed: int | None = None  # the config in flight
    started: float = 0.0


def _in_workers(seeds: list[int], device: torch.device, jobs: int) -> Iterator[ConfigResult]:
    """Results of `seeds` from `jobs` spawned worker processes (GPUs shared round-robin), in
    the order they finish. A worker that dies or runs past CONFIG_TIMEOUT_S fails its config
    and is replaced."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("spawn")
    cuda = device.type == "cuda"
    # CPU workers import triton under the interpreter: it must be set when they start
    environment = {} if cuda else {"TRITON_INTERPRET": "1"}
    pending = collections.deque(seeds)
    workers: list[_Worker] = []
    started_count = 0

    def start() -> None:
        nonlocal started_count
        parent_end, child_end = context.Pipe()
        gpu = started_count % torch.cuda.device_count() if cuda else None
        started_count += 1
        with _environment(**environment):
            process = context.Process(target=_serve, args=(child_end, gpu), daemon=True)
            process.start()
        child_end.close()
        worker = _Worker(process, parent_end)
        workers.append(worker)
        give_work(worker)

    def give_work(worker: _Worker) -> None:
        if pending:
            worker.seed, worker.started = pending.popleft(), time.monotonic()
            worker.connection.send(worker.seed)
        else:
            worker.connection.send(None)
            stop(worker)

    def stop(worker: _Worker) -> None:
        workers.remove(worker)
        worker.process.join(timeout=30)
        worker.process.kill()
        worker.connection.close()

    def lost(worker: _Worker, why: str) -> ConfigResult:
        stop(worker)
        if pending:
            start()
        config = draw_config(worker.seed, limits_for(device))
        return ConfigResult(worker.seed, config.families, config.describe(), exception=why)

    for _ in range(min(jobs, len(seeds))):
        start()
    while workers:
        wait([w.connection for w in workers] + [w.process.sentinel for w in workers],
             timeout=10)
        for worker in list(workers):
            if worker.connection.poll():
                try:
                    result = worker.connection.recv()
                except EOFError:
                    yield lost(worker, f"the worker process died (exit code "
                                       f"{worker.process.exitcode})")
                    continue
                yield result
                if result.device_broken:  # the worker exits: a fresh one takes over
                    stop(worker)
                    if pending:
                        start()
                else:
                    give_work(worker)
            elif not worker.process.is_alive():
                yield lost(worker, f"the worker process died (exit code "
                                   f"{worker.process.exitcode})")
            elif time.monotonic() - worker.started > CONFIG_TIMEOUT_S:
                yield lost(worker, f"timed out after {CONFIG_TIMEOUT_S} s")


def run_seeds(seeds: list[int], device: torch.device, jobs: int = 1) -> Iterator[ConfigResult]:
    """ConfigResults of `seeds` (each drawn for `device`) as they finish: in this process when
    jobs == 1 and it can run the kernels, else in worker processes. In this process a CUDA
    error that breaks the context stops the run (later seeds get no result)."""
    if jobs <= 1 and kernels_run_here(device):
        for seed in seeds:
            result = run_seed(seed, device)
            yield result
            if result.device_broken:
                return
    else:
        yield from _in_workers(seeds, device, max(jobs, 1))


def _progress(results: Iterator[ConfigResult], total: int) -> Iterator[ConfigResult]:
    """Results passed through, with a tqdm bar if tqdm is installed, else a line each."""
    try:
        from tqdm import tqdm
    except ImportError:
        for done, result in enumerate(results, 1):
            print(f"[{done}/{total}] {'PASS' if result.passed else 'FAIL'} {result.seed} "
                  f"({result.seconds:.1f} s)", flush=True)
            yield result
        return
    with tqdm(total=total, unit="config") as bar:
        failed = 0
        for result in results:
            failed += not result.passed
            bar.set_postfix(failed=failed)
            bar.update()
            yield result


def reproduce_command(seed: int) -> str:
    return f"omniattn check --config {seed}"


def report(results: list[ConfigResult], requested: int) -> str:
    """Per-family pass counts (a config counts in every family it has), the total, and each
    failing config: its reproduce command, what failed by how much, and its description."""
    families: dict[str, list[int]] = {}
    for result in results:
        for family in result.families:
            counts = families.setdefault(family, [0, 0])
            counts[0] += 1
            counts[1] += result.passed
    width = max([len("family"), *map(len, families)])
    lines = ["per family (a config counts in each family of its features; dense: no mask of "
             "any kind):", f"{'family':<{width}}  configs  passed  failed"]
    for family, (count, passed) in sorted(families.items()):
        lines.append(f"{family:<{width}}  {count:7d}  {passed:6d}  {count - passed:6d}")
    passed = sum(r.passed for r in results)
    lines.append(f"total: {len(results)} configs, {passed} passed, {len(results) - passed} failed"
                 + (f", {requested - len(results)} not run" if len(results) < requested else ""))
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append("failing configs (each line re-runs one alone):")
    for result in sorted(failed, key=lambda r: r.seed):
        lines.append(f"  {reproduce_command(result.seed)}  # {result.failures()}")
        lines.append(f"      {result.description}")
    return "\n".join(lines)


def detail(result: ConfigResult) -> str:
    """Every quantity of one config: error, plain dtype's error, bound, verdict."""
    lines = [f"config {result.seed}: {result.description}",
             f"  families: {', '.join(result.families)}; {result.seconds:.1f} s"]
    if result.exception:
        lines.append(f"  FAIL {result.exception}")
    for check in result.checks:
        verdict = "PASS" if check.passed else f"FAIL ({check.reason})"
        if check.name.endswith(EMPTY_ROWS):
            numbers = f"max |value| {check.error:.3e}, must be exactly 0"
        else:
            numbers = f"error {check.error:.3e}  torch {check.torch_error:.3e}  bound " \
                      f"{check.bound:.3e}"
        lines.append(f"  {check.name:<16} {numbers}  {verdict}")
    return "\n".join(lines)


def sweep(count: int, sweep_seed: int, device: torch.device, jobs: int = 1,
          progress: bool = True) -> list[ConfigResult]:
    """Run configs 0..count-1 of `sweep_seed`; results in config order."""
    seeds = [config_seed(sweep_seed, index) for index in range(count)]
    results = run_seeds(seeds, device, jobs)
    if progress:
        results = _progress(results, count)
    order = {seed: index for index, seed in enumerate(seeds)}
    return sorted(results, key=lambda r: order[r.seed])
