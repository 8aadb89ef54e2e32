"""`shard` / `unshard`: between a full-sequence tensor (the same on every rank) and this rank's
part of it, differentiable; and the process group a call names."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather, group_info
from .layout import check_divides, check_layout, to_global, to_shards


class _Shard(torch.autograd.Function):
    """This rank's part of a replicated tensor; the backward all-gathers the parts' gradients,
    so the replicated input gets the same full gradient on every rank."""

    @staticmethod
    def forward(ctx, x, group, dim, layout):
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        rank, world = group_info(group)
        return to_shards(x, layout, world, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return to_global(all_gather(grad, ctx.group), ctx.layout, ctx.dim), None, None, None


class _Unshard(torch.autograd.Function):
    """The full tensor from every rank's part; the backward takes this rank's part of the
    gradient (the full tensor is replicated: every rank holds the same gradient of it)."""

    @staticmethod
    def forward(ctx, x, group, dim, layout):
        ctx.group, ctx.dim, ctx.layout = group, dim, layout
        return to_global(all_gather(x, group), layout, dim)

    @staticmethod
    def backward(ctx, grad):
        rank, world = group_info(ctx.group)
        return to_shards(grad, ctx.layout, world, ctx.dim)[rank], None, None, None


def _checked_dim(name: str, x, dim) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def shard(x: torch.Tensor, group=None, *, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full-sequence tensor x (the same on every rank) along `dim`:
    (..., S, ...) -> (..., S/P, ...), S a multiple of 2P (zigzag) or P (contiguous).

    Differentiable: x's gradient is the full one on every rank (the parts' gradients are
    all-gathered), as for a replicated tensor. group: a ProcessGroup, a 1-D DeviceMesh or None
    (the default group)."""
    dim = _checked_dim("x", x, dim)
    check_layout(layout)
    group = resolve_group(group)
    check_divides("x", x.shape[dim], layout, group_info(group)[1], per_rank=False)
    return _Shard.apply(x, group, dim, layout)


def unshard(x_local: torch.Tensor, group=None, *, dim: int = 1,
            layout: str = "zigzag") -> torch.Tensor:
    """The full-sequence tensor, on every rank, from each rank's part along `dim`:
    (..., S/P, ...) -> (..., S, ...) in global order (an all-gather).

    Differentiable: the full tensor is taken as replicated (every rank computes the same
    function of it), so x_local's gradient is this rank's part of the full gradient, without
    communication. To sum gradients that differ by rank, use torch.distributed.nn's
    all_gather instead."""
    dim = _checked_dim("x_local", x_local, dim)
    check_layout(layout)
    group = resolve_group(group)
    check_divides("x_local", x_local.shape[dim], layout, group_info(group)[1], per_rank=True)
    return _Unshard.apply(x_local, group, dim, layout)


def resolve_group(group):
    """A ProcessGroup from None (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("omniattn.distributed needs torch.distributed initialised: call "
                         "torch.distributed.init_process_group first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group is a {group.ndim}-D DeviceMesh; pass its context-parallel "
                             f"dimension, e.g. mesh['cp'] or mesh.get_group('cp')")
        return group.get_group()
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                    f"got {type(group).__name__}")
