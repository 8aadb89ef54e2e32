"""The providers `omniattn bench` times: omniattn, SDPA's backends and FlexAttention. Each takes
q (B, Sq, H, D), k/v (B, Sk, Hk, D) in omniattn's layout and returns out (B, Sq, H, D); a provider
is built once per workload (`provider_builders`) and runs only the workloads whose kind of mask
it takes (`providers_for`)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import omniattn
from omniattn.plan import PassPlan

from .workloads import ExtraInputs, Workload

# SDPA has no block-sparse masks: its providers get no row on a sparse workload
BLOCK_MASK_PROVIDERS = ("omniattn", "flex")
# SDPA gets a dynamic workload's mask and bias as one float attn_mask, differentiable under its
# efficient and math backends, and a rows or window workload's mask as a bool attn_mask; flash
# takes no attn_mask, and issue #4's SDPA baseline is the efficient backend, so flash and cuDNN
# get no row on a dynamic, rows, window or varlen workload. A decode workload (one query row
# over a long cache) is dense: every provider runs it, FlexAttention through its decoding kernel
ELEMENT_MASK_PROVIDERS = ("omniattn", "flex", "sdpa-efficient", "sdpa-math")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BuiltAttention(NamedTuple):
    """A provider built for one workload: fn(q, k, v) -> out, and the tensors besides q, k, v
    that fn reads and fwd+bwd differentiates (the bias, in the form this provider takes it)."""

    fn: AttentionFn
    learnable: tuple[torch.Tensor, ...] = ()


def _to_sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, S, H, D) <-> (B, H, S, D), a view


def _omniattn_options(workload: Workload, extra: ExtraInputs) -> dict:
    """omniattn.attention's keywords for the workload. check_inputs=False: the values it checks
    are the row lengths' and cu_seqlens', right by construction (`workload_row_lengths`,
    `workload_documents`); checking them syncs with the host on every timed call."""
    if extra.cu_seqlens is not None:
        return dict(causal=workload.causal, cu_seqlens_q=extra.cu_seqlens,
                    cu_seqlens_k=extra.cu_seqlens, max_seqlen_q=extra.max_document,
                    max_seqlen_k=extra.max_document, check_inputs=False)
    return dict(causal=workload.causal, window=workload.window, block_mask=extra.block_mask,
                attn_mask=extra.keep, attn_bias=extra.bias, seqlens_k_per_row=extra.row_lens,
                block_table=extra.block_table, check_inputs=False,
                topk=workload.topk if workload.select else None)


def _omniattn(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
    options = _omniattn_options(workload, extra)

    # (1, S, H, D) -> the packed (S, H, D) views by squeeze, whose gradient is a view too (q[0]'s
    # is a zero fill and a copy per input)
    def run_packed(q, k, v):
        return omniattn.attention(q.squeeze(0), k.squeeze(0), v.squeeze(0),
                                  **options).unsqueeze(0)

    if extra.cu_seqlens is not None:
        return BuiltAttention(run_packed)

    def run(q, k, v):
        return omniattn.attention(q, k, v, **options)

    return BuiltAttention(run, extra.learnable)


def forward_plan(workload: Workload, extra: ExtraInputs, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> PassPlan:
    """What omniattn's forward runs for the workload on these q (B, Sq, H, D), k, v
    (B, Sk, Hk, D): its kernel and (block_m, block_n) tiles, as `omniattn.explain` plans the
    call the omniattn provider makes (nothing is launched)."""
    if extra.cu_seqlens is not None:
        q, k, v = q.squeeze(0), k.squeeze(0), v.squeeze(0)
    return omniattn.explain(q, k, v, **_omniattn_options(workload, extra)).forward



def _sdpa(backend, cuda_only: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    # extra.block_mask is always None: run_suite gives SDPA no sparse workload
    # (BLOCK_MASK_PROVIDERS)
    def build(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
        if cuda_only and device.type != "cuda":
            raise RuntimeError("benchmarked on CUDA only")
        # a dynamic workload's float mask hides what causal hides (SDPA takes no attn_mask
        # together with is_causal); a rows or window workload's bool mask is its only mask
        # (never causal), a varlen one's holds its causal
        attn_mask = extra.sdpa_mask if extra.keep is not None \
            else extra.sdpa_row_mask if extra.row_lens is not None \
            else extra.sdpa_window_mask if workload.window is not None \
            else extra.sdpa_document_mask if extra.cu_seqlens is not None else None
        is_causal = workload.causal and attn_mask is None
        # SDPA's is_causal is top-left aligned; it equals omniattn's bottom-right causal only here
        if is_causal and workload.seqlen_q != workload.seqlen_k:
            raise ValueError(f"SDPA is_causal differs from omniattn's causal when Sq != Sk "
                             f"({workload.seqlen_q} != {workload.seqlen_k})")
        enable_gqa = workload.heads != workload.heads_k

        def run(q, k, v):
            with sdpa_kernel(backend):
                out = scaled_dot_product_attention(
                    _to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                    attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
            return _to_sdpa_layout(out)

        # the float mask carries the bias and its gradient; the bool one has none
        return BuiltAttention(run, (attn_mask,) if extra.keep is not None else ())

    return build


def _flex_score_mod(workload: Workload, bias: torch.Tensor | None):
    """FlexAttention's score_mod adding the dynamic workload's bias; None without one."""
    if workload.bias == "full":
        return lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx]
    if workload.bias == "key":
        return lambda score, b, h, q_idx, kv_idx: score + bias[b, h, 0, kv_idx]
    return None


def _flex(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
    if device.type != "cuda":
        raise RuntimeError("benchmarked on CUDA only")
    from torch.nn.attention.flex_attention import flex_attention

    flex_mask = extra.flex_block_mask
    score_mod = _flex_score_mod(workload, extra.bias)
    # static shapes, and a fresh compile cache per workload, so the suite never reaches dynamo's
    # recompile limit nor falls back to a slower dynamic-shape kernel
    torch.compiler.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    enable_gqa = workload.heads != workload.heads_k

    def run(q, k, v):
        out = compiled(_to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                       score_mod=score_mod, block_mask=flex_mask, enable_gqa=enable_gqa)
        return _to_sdpa_layout(out)

    return BuiltAttention(run, extra.learnable)


Builder = Callable[[Workload, torch.device, ExtraInputs], BuiltAttention]


def provider_builders() -> dict[str, Builder]:
    """name -> build(workload, device, extra)."""
    from torch.nn.attention import SDPBackend

    return {
        "omniattn": _omniattn,
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, cuda_only=True),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, cuda_only=True),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION, cuda_only=True),
        "sdpa-math": _sdpa(SDPBackend.MATH, cuda_only=False),
        "flex": _flex,
    }


PROVIDERS = tuple(provider_builders())


def default_providers(device: str | torch.device) -> tuple[str, ...]:
    if torch.device(device).type == "cuda":
        return ("omniattn", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex")
    return ("omniattn", "sdpa-math")




def providers_for(workload: Workload, providers: tuple[str, ...]) -> tuple[str, ...]:
    """The providers that run the workload: those that take its kind of mask (pages: omniattn
    alone, its contiguous row of the same shape is the others' comparison; a selection inside
    attention: omniattn alone, the masked row of its shape at 4k is the others')."""
    if workload.page_size is not None or workload.select:
        runnable = ("omniattn",)
    elif workload.density is not None:
        runnable = BLOCK_MASK_PROVIDERS
    elif workload.topk is not None or workload.row_lengths is not None \
            or workload.window is not None or workload.documents is not None:
        runnable = ELEMENT_MASK_PROVIDERS
    else:
        return providers
    return tuple(p for p in providers if p in runnable)

