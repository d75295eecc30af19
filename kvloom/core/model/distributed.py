"""Tensor parallelism over ``torch.distributed``: which sizes a model splits into, the process group
(gloo on the CPU, NCCL on GPUs, always with a timeout) and the collectives the model runs (the
all-reduce after a row-parallel layer or the vocab-parallel embedding, the gather of logit shards)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from kvloom.core.config import ConfigError

# A collective that waits this long has lost a rank: it raises instead of hanging the engine. Generous,
# because a loaded 2-core CI machine can stall a rank for many seconds.
COLLECTIVE_TIMEOUT_S = 120.0
# The engine and its workers meet on a TCPStore of the loopback interface.
STORE_HOST = "127.0.0.1"
# NVLink multicast (NVLS) is off: the GPU machines this runs on fail to set it up.
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0"}


def tp_refusal(hf_config, tp: int) -> str | None:
    """Why the engine cannot split this model ``tp`` ways (None when it can)."""
    if tp == 1:
        return None
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sizes = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
             ("intermediate_size", hf_config.intermediate_size), ("vocab_size", hf_config.vocab_size)]
    # MoE: each expert's (and the shared expert's) intermediate dim is split too
    sizes += [(name, getattr(hf_config, name)) for name in ("moe_intermediate_size", "shared_expert_intermediate_size")
              if getattr(hf_config, name, None)]
    for name, value in sizes:
        if value % tp:
            extra = (" (replicating KV heads across ranks is not implemented)"
                     if name == "num_key_value_heads" and tp % value == 0 else "")
            return f"tensor_parallel_size={tp} does not divide the model's {name}={value}{extra}"
    return None


def check_tp_size(hf_config, tp: int) -> None:
    """Raise ConfigError naming the size that ``tp`` does not divide."""
    reason = tp_refusal(hf_config, tp)
    if reason is not None:
        raise ConfigError(reason)


@dataclass
class TensorParallel:
    """This rank's place in the group. ``group`` is None for a model built only to be sized (``engine
    plan``) or a group of one; collectives are then no-ops."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``[T, n]`` shard into ``[T, size * n]`` (on every rank: an all-gather
        is the collective NCCL captures in CUDA graphs as readily as the all-reduce)."""
        if self.size == 1 or self.group is None:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1 and self.group is not None:
            import torch.distributed as dist

            dist.broadcast(x, src=src, group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The minimum of ``value`` over the ranks (KV capacity: every rank must hold every block)."""
        if self.size == 1 or self.group is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, size: int, store_port: int, device: torch.device,
               timeout_s: float = COLLECTIVE_TIMEOUT_S, store=None) -> TensorParallel:
    """Join the group of ``size`` ranks that meet at ``127.0.0.1:store_port`` (rank 0 passes the store it
    created). The process's default group: a process runs one engine's ranks at a time."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; one tensor-parallel "
                           "engine runs per process")
    if device.type == "cuda":
        os.environ.update(WORKER_ENV)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(STORE_HOST, store_port, size, False, timeout=timeout)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout)
    return TensorParallel(rank, size, dist.group.WORLD)


def destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_rank(config) -> int | None:
    """CPU threads of one rank: ``threads`` if set, else the process's cores shared by the ranks (each
    rank using every core would oversubscribe them N times over)."""
    if config.tensor_parallel_size == 1 or config.threads is not None:
        return config.threads
    from kvloom.core.worker.cpu_threads import available_cores

    return max(1, available_cores() // config.tensor_parallel_size)
