"""The sweep's pass rule, for the output, the lse (when returned) and each gradient separately:
err(kernel) = max |kernel - ref64|, err(torch) = max |plain - ref64|, where ref64 is
`attention_reference` on float64 inputs and plain is `attention_reference(upcast=False)` in the
input dtype; pass iff err(kernel) <= 2 * err(torch) + 1e-3 * max |ref64| + 1e-4. A NaN or inf of
the kernel where ref64 is finite fails; rows that see no key must be exactly 0 (output and dq).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .configs import SweepConfig

RELATIVE_TOLERANCE = 1e-3  # of max |ref64|
ABSOLUTE_FLOOR = 1e-4  # what a reference of all zeros allows: fp32 sums that cancel to 0
EMPTY_ROWS = "[empty rows]"  # the name suffix of the exact-zero checks of rows seeing no key


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

