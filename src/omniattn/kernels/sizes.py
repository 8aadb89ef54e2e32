"""Host-side sizes of launches (cheaper than Triton's constexpr functions on the host)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b): triton.cdiv is a constexpr function, 6 us per host call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side, like triton.next_power_of_2 (also a constexpr function)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))
