"""Context parallelism over torch.distributed: one sequence sharded over a process group's
ranks (NCCL on GPUs, gloo on CPU), every mask in global positions."""
from .attention import DistributedPlan, attention, explain
from .sharding import shard, unshard

__all__ = ["DistributedPlan", "attention", "explain", "shard", "unshard"]
