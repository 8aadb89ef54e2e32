"""Top-k attention on a GPU (issue #53's acceptance), bf16, D128, causal, per-key scores = the key
bias (B, Hs, 1, S): the whole call `attention(..., attn_bias=bias, topk=K)` (selection included)
against attention with the same selection precomputed as a mask (`topk_mask`, then attn_mask +
attn_bias), forward and forward+backward; the selection alone; the share of causal tiles the
top-k states leave (so the target: causal time x that share + the selection); peak memory
beyond the inputs, outputs and gradients. One JSON record per line.

    python benchmarks/topk_attention.py --seqlen 4096 --batch 2 --heads 16 --heads-k 16 --topk 1024
    python benchmarks/topk_attention.py --seqlen 32768 131072 --batch 1 --heads 16 --heads-k 4 \
        --topk 2048 --no-mask
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import omniattn
from omniattn import api
from omniattn.kernels.elementwise import TopkTerm, topk_tile_states
from omniattn.masks import topk_mask
from omniattn.predicate import HIDDEN


def timed(fn) -> tuple[float, float]:
    """(median ms, peak MiB allocated during a call beyond what was allocated before it)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"), peak


def kernel_times(fn, calls: int = 3) -> dict[str, float]:
    """Device ms per call of each kernel fn launches (torch.profiler), largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    times = {e.key[:60]: round(e.device_time_total / 1000 / calls, 4) for e in events}
    return dict(sorted(times.items(), key=lambda item: -item[1])[:12])


def visited_share(q, k, v, bias, topk) -> float:
    """Tiles the top-k forward walks (not HIDDEN by its states, within causal) over the causal
    tiles, at the forward's tiles."""
    options = {**api._OPTIONS, "causal": True, "attn_bias": bias, "topk": topk}
    prepared = api._prepare(q, k, v, *options.values(), graph_parts=False)
    form, lists = prepared.form, prepared.lists
    pairs = api._topk_pairs(topk, form, None, None)
    block_m, block_n = lists.forward
    seqlen = q.shape[1]
    states = topk_tile_states(TopkTerm(form.topk_scores, pairs), seqlen, seqlen, block_m,
                              block_n)
    rows = torch.arange(states.shape[-2], device=q.device)[:, None]
    cols = torch.arange(states.shape[-1], device=q.device)[None, :]
    causal = cols * block_n <= rows * block_m + block_m - 1
    walked = (states != HIDDEN) & causal
    return (walked.sum() / (causal.sum() * states.shape[0] * states.shape[1])).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-k", type=int, default=16)
    parser.add_argument("--topk", type=int, default=1024)
    parser.add_argument("--no-mask", action="store_true",
                        help="skip the precomputed-mask comparison ((S, S) masks)")
    parser.add_argument("--label", default="")
    parser.add_argument("--profile", action="store_true",
                        help="also each mode's kernels and their device time")
    opts = parser.parse_args()
    for seqlen in opts.seqlen:
        torch.manual_seed(0)
        batch, heads, heads_k, topk = opts.batch, opts.heads, opts.heads_k, opts.topk
        q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k, v = (torch.randn(batch, seqlen, heads_k, 128, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        bias = torch.randn(batch, heads_k, 1, seqlen, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)
        dout = torch.randn_like(q)
        record = dict(label=opts.label, batch=batch, heads=heads, heads_k=heads_k,
                      seqlen=seqlen, topk=topk, gpu=torch.cuda.get_device_name(),
                      # what a peak holds beside the call's own memory: out and the gradients
                      outputs_and_grads_mib=sum(t.numel() * t.element_size()
                                                for t in (q, q, k, v, bias)) / 2 ** 20)

        def run(backward: bool, **options):
            def call():
                out = omniattn.attention(q, k, v, causal=True, **options)
                if backward:
                    out.backward(dout)
            return call

        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            grads = torch.enable_grad() if backward else torch.no_grad()
            with grads:
                record[f"topk_{mode}_ms"], record[f"topk_{mode}_peak_mib"] = timed(
                    run(backward, attn_bias=bias, topk=topk))
                record[f"causal_{mode}_ms"], record[f"causal_{mode}_peak_mib"] = timed(
                    run(backward))
                if opts.profile:
                    record[f"topk_{mode}_kernels"] = kernel_times(
                        run(backward, attn_bias=bias, topk=topk))
                if not opts.no_mask:
                    keep = topk_mask(bias.detach(), topk, causal=True)
                    record[f"mask_{mode}_ms"], _ = timed(
                        run(backward, attn_mask=keep, attn_bias=bias))
                    del keep
            for t in (q, k, v, bias):
                t.grad = None
        with torch.no_grad():
            form = api._prepare(q, k, v, *{**api._OPTIONS, "causal": True, "attn_bias": bias,
                                            "topk": topk}.values(), graph_parts=False).form
            record["selection_ms"], record["selection_peak_mib"] = timed(
                lambda: api._topk_pairs(topk, form, None, None))
            record["visited_share"] = visited_share(q, k, v, bias, topk)
            if not opts.no_mask:
                record["topk_mask_ms"], record["topk_mask_peak_mib"] = timed(
                    lambda: topk_mask(bias, topk, causal=True))
        print(json.dumps(record), flush=True)
        del q, k, v, bias, dout
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
