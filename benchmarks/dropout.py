"""Cost of dropout on the kernels: dense B2 H16 D128 8k bf16, ms fwd / fwd+bwd (median of
triton.testing.do_bench) at p = 0 and p = 0.1. --json writes the numbers."""
from __future__ import annotations

import argparse
import json

import torch
import triton

import omniattn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    results = []
    for p in (0.0, 0.1):
        def forward():
            return omniattn.attention(q, k, v, dropout_p=p)

        def forward_backward():
            torch.autograd.grad(forward(), (q, k, v), dout)

        fwd = triton.testing.do_bench(forward, warmup=25, rep=100, return_mode="median")
        both = triton.testing.do_bench(forward_backward, warmup=25, rep=100, return_mode="median")
        results.append({"dropout_p": p, "fwd_ms": fwd, "fwd_bwd_ms": both})
        print(f"dropout {p:.1f}: {fwd:.3f} / {both:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": "B2 H16 8k D128 bf16",
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
