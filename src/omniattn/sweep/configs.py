"""The sweep's draws: config i of sweep seed S is drawn from its own seed, `config_seed(S, i)`,
alone (`draw_config`), within the limits of the device it runs on (`limits_for`: CUDA draws GPU
sizes and fp16/bf16, the CPU draws interpreter sizes and fp16/fp32)."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import random

import torch


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

