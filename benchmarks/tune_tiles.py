"""Sweep tile configs of the forward and backward kernels (GPU). Prints a table; writes JSON.

    python benchmarks/tune_tiles.py --json out.json [--head-dims 64,128,256]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from omniattn.backends.triton import configs
from omniattn.backends.triton.configs import BwdTileConfig, TileConfig
from omniattn.kernels.schedule import KernelArgs
from omniattn.passes import attention_backward, attention_forward

FWD_CANDIDATES = {
    64: [(128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 4), (64, 128, 4, 3)],
    256: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 3)],
}
# (block_m1, block_n1, block_m2, block_n2, warps, stages)
BWD_CANDIDATES = {
    64: [(64, 64, 64, 64, 4, 2), (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2),
         (32, 64, 64, 32, 4, 3)],
    128: [(64, 64, 64, 64, 4, 2), (32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 4, 2),
          (32, 128, 128, 32, 8, 2), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 3),
          (16, 128, 128, 16, 4, 3), (32, 128, 64, 64, 4, 2), (64, 128, 128, 64, 8, 3),
          (32, 64, 64, 64, 4, 3), (64, 64, 128, 64, 8, 2)],
    256: [(32, 32, 32, 32, 4, 1), (32, 64, 64, 32, 4, 2), (64, 64, 64, 64, 8, 1),
          (16, 64, 64, 16, 4, 2)],
}
WORKLOADS = [("dense-4k", 2, 4096, False), ("causal-4k", 2, 4096, True)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--kinds", default="fwd,bwd")
    opts = parser.parse_args()
    rows = []
    for head_dim in map(int, opts.head_dims.split(",")):
        key = configs.padded_head_dim(head_dim)
        for name, batch, seqlen, causal in WORKLOADS:
            q, k, v = (torch.randn(batch, seqlen, 16, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            args = KernelArgs.make(head_dim, causal, None, None, 0.0)
            out, lse = attention_forward(q, k, v, args)
            dout = torch.randn_like(out)
            pairs = seqlen * seqlen * (0.5 if causal else 1.0)
            flops = 4 * batch * 16 * head_dim * pairs
            for kind, candidates, table, make in (
                    ("fwd", FWD_CANDIDATES[key], configs._FWD, TileConfig),
                    ("bwd", BWD_CANDIDATES[key], configs._BWD, BwdTileConfig)):
                if kind not in opts.kinds.split(","):
                    continue
                chosen = table[(key, causal)]
                for cand in candidates:
                    table[(key, causal)] = make(*cand)
                    fn = (lambda: attention_forward(q, k, v, args)) if kind == "fwd" else \
                        (lambda: attention_backward(dout, q, k, v, out, lse, args))
                    try:
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    except Exception as exc:  # out of shared memory / registers for this tile
                        rows.append(dict(head_dim=head_dim, workload=name, kind=kind,
                                         config=cand, error=str(exc)[:120]))
                        continue
                    tflops = flops * (2.5 if kind == "bwd" else 1.0) / ms * 1e-9
                    rows.append(dict(head_dim=head_dim, workload=name, kind=kind, config=cand,
                                     ms=ms, tflops=tflops))
                    print(f"D{head_dim:<4}{name:<11}{kind:<4}{str(cand):<26}{ms:8.3f} ms "
                          f"{tflops:6.0f} TFLOP/s", flush=True)
                table[(key, causal)] = chosen
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("\nbest per (head_dim, workload, kind):")
    best = {}
    for r in rows:
        if "ms" in r:
            key = (r["head_dim"], r["workload"], r["kind"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for (d, w, kind), r in sorted(best.items()):
        print(f"D{d:<4}{w:<11}{kind:<4}{str(r['config']):<26}{r['ms']:8.3f} ms {r['tflops']:6.0f}")


if __name__ == "__main__":
    main()
