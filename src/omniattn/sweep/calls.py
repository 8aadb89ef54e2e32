"""The tensors of a drawn config's call (`build_call`), and the call evaluated on them:
output, lse and gradients (`evaluate`)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch

from .configs import BlockSpec, ElementSpec, SweepConfig


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
    from ..masks import builders

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

