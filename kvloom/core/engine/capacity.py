"""KV-cache arithmetic, the one source of truth for the engine's start-up log and ``engine plan``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kvloom.core.config import ConfigError, EngineConfig
from kvloom.core.engine.kv_layout import KVLayout, model_kv_layout

logger = logging.getLogger("kvloom")

GiB = 1 << 30
DEFAULT_CPU_KV_GIB = 1.0


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def model_dims(hf_config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


# e4m3 (3 mantissa bits, range +-448) rather than e5m2: K and V need precision more than range.
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The KV cache's element type: the model dtype, or float8 e4m3 for ``kv_cache_dtype="fp8"``. On a CUDA
    device without float8 conversions (before compute capability 8.9) fp8 is a ConfigError."""
    if config.kv_cache_dtype == "auto":
        return dtype
    if config.kv_cache_dtype != "fp8":
        raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not one of ['auto', 'fp8']")
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                          f"this one is {major}.{minor}: use kv_cache_dtype='auto'")
    return FP8_KV_DTYPE


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tensor_parallel: int = 1, layers: int | None = None) -> int:
    """K and V of every layer for one token (per GPU when the KV heads are split ``tensor_parallel`` ways);
    with ``layers``, of that many (the layers one block of a hybrid cache spans)."""
    all_layers, kv_heads, head_dim = model_dims(hf_config)
    kv_heads_per_rank = max(1, kv_heads // tensor_parallel)
    return 2 * (layers or all_layers) * kv_heads_per_rank * head_dim * dtype_size(dtype)


@dataclass
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # of one block's layers (all of them, unless the cache is hybrid)
    max_model_len: int
    dtype: str = ""  # the cache's element type, for the log line
    # A draft model's own cache (spec_decode method=draft): the same blocks, its own K and V per token.
    draft_bytes_per_token: int = 0
    # Layer groups of a hybrid cache (sliding layers keep only their windows' blocks); None: one group.
    layout: KVLayout | None = None

    @property
    def hybrid(self) -> bool:
        return self.layout is not None and self.layout.hybrid

    @property
    def num_tokens(self) -> int:
        """Tokens of K/V the blocks hold (each for the layers of one block)."""
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_tokens * (self.bytes_per_token + self.draft_bytes_per_token)

    def sequence_blocks(self, num_tokens: int, new_tokens: int = 1) -> int:
        """Blocks one sequence of ``num_tokens`` holds while computing ``new_tokens`` of them."""
        if not self.hybrid:
            return -(-num_tokens // self.block_size)
        return self.layout.sequence_blocks(num_tokens, self.block_size, new_tokens)

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens fit at once (decoding: sliding layers hold their
        windows' blocks only)."""
        return self.num_blocks / self.sequence_blocks(self.max_model_len)

    def describe(self) -> str:
        draft = f" + the draft model {self.draft_bytes_per_token} bytes/token" if self.draft_bytes_per_token else ""
        dtype = f", {self.dtype}" if self.dtype else ""
        concurrency = f"maximum concurrency at max_model_len {self.max_model_len}: {self.max_concurrency:.2f}x"
        if not self.hybrid:
            return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                    f"({self.bytes / GiB:.2f} GiB, {self.bytes_per_token} bytes/token{dtype}{draft}); {concurrency}")
        layout = self.layout
        longest = layout.longest_sequence(self.num_blocks, self.block_size)
        context = (f"a sequence alone up to {longest} tokens" if longest is not None
                   else "a sequence of any length (every layer slides)")
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens of "
                f"{layout.slots} layers each ({self.bytes / GiB:.2f} GiB, {self.bytes_per_token} bytes/token{dtype}"
                f"{draft}); {len(layout.groups)} layer groups ({layout.describe()}), sliding layers keep only "
                f"their windows' blocks: {context}; {concurrency} "
                f"({self.sequence_blocks(self.max_model_len)} blocks a sequence)")


def blocks_for_memory(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    return max(0, int(memory_bytes // (block_size * bytes_per_token)))


def resolve_max_model_len(hf_config, wanted: int | None) -> int:
    """``wanted`` (default: the model's max_position_embeddings), checked against the model's limit."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
    wanted = wanted or model_max
    if wanted > model_max:
        raise ConfigError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={model_max}")
    return wanted


def kv_layout(config: EngineConfig, hf_config, draft_model: bool = False) -> KVLayout:
    """The engine's layer groups: a hybrid cache where the model has sliding layers, unless
    ``hybrid_kv_cache`` is off or a draft model shares the blocks of a model whose every layer slides (the
    draft's cache follows the first group's table, which must keep every block)."""
    layout = model_kv_layout(hf_config, config.hybrid_kv_cache)
    if draft_model and layout.groups[0].window is not None:
        logger.info("Every layer slides and the spec_decode draft model shares its blocks: sliding layers keep "
                    "every block")
        layout = model_kv_layout(hf_config, False)
    return layout


def kv_capacity(config: EngineConfig, hf_config, dtype: torch.dtype, max_model_len: int,
                gpu_kv_budget: Callable[[], int] | None = None, tensor_parallel: int = 1,
                draft_bytes_per_token: int = 0, layout: KVLayout | None = None) -> KVCapacity:
    """The KV cache the engine allocates: ``num_kv_blocks`` if given, else ``kv_cache_memory_gib``, else
    on a GPU ``gpu_kv_budget()`` bytes (the engine profiles, ``engine plan`` estimates), else
    DEFAULT_CPU_KV_GIB. ``dtype`` is the model's; the cache's follows ``config.kv_cache_dtype`` (fp8 halves
    the bytes per token of bf16, so twice the tokens fit). A draft model's cache has as many blocks as the
    target's and comes out of the same memory: a block costs both models' bytes per token. With a hybrid
    ``layout`` a block spans one group's layers, so the same memory holds more blocks. Raises ConfigError
    when not even one block fits."""
    cache_dtype = kv_cache_dtype(config, dtype)
    hybrid = layout is not None and layout.hybrid
    per_token = kv_bytes_per_token(hf_config, cache_dtype, tensor_parallel, layout.slots if hybrid else None)
    both = per_token + draft_bytes_per_token
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory_gib is not None:
        blocks = blocks_for_memory(int(config.kv_cache_memory_gib * GiB), config.block_size, both)
    elif gpu_kv_budget is not None:
        blocks = blocks_for_memory(gpu_kv_budget(), config.block_size, both)
    else:
        blocks = blocks_for_memory(int(DEFAULT_CPU_KV_GIB * GiB), config.block_size, both)
    if blocks < 1:
        raise ConfigError("no memory is left for the KV cache: lower max_num_batched_tokens or raise "
                          f"gpu_memory_utilization={config.gpu_memory_utilization}")
    return KVCapacity(blocks, config.block_size, per_token, max_model_len, str(cache_dtype).removeprefix("torch."),
                      draft_bytes_per_token, layout if hybrid else None)


# --- the GPU memory profile's arithmetic --------------------------------------------------------------
# Left beside the KV cache for what the profile cannot see: allocator fragmentation, the sampler's small
# per-step tensors.
PROFILE_RESERVE_BYTES = 64 << 20


@dataclass(frozen=True)
class GpuMemorySnapshot:
    """The device's memory as this process sees it at one moment, in bytes."""

    total: int
    free: int  # held by no process
    allocated: int  # by this process's PyTorch tensors
    reserved: int  # by this process's PyTorch caching allocator (allocated + cached)

    @property
    def outside_torch(self) -> int:
        """In use but not through this process's PyTorch allocator: other processes, and this process's
        CUDA context and libraries' workspaces."""
        return self.total - self.free - self.reserved


def gpu_memory_snapshot(device: torch.device) -> GpuMemorySnapshot:
    import gc

    gc.collect()  # an engine dropped earlier in this process may hold its KV cache in a reference cycle
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemorySnapshot(total, free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class GpuProfile:
    """What one engine's start-up profile measured, in bytes: its own use only. Another process's
    memory, or another engine's in this process, is not this engine's to count."""

    total: int
    available: int  # what the KV cache can still be allocated from: free on the device, plus PyTorch's cache
    weights: int  # allocated while the target (and draft) model loaded
    activations: int  # the peak of the profile forwards above what was allocated before them
    non_torch: int  # this process's growth outside PyTorch since the engine began (cuBLAS workspaces, ...)

    @classmethod
    def measure(cls, start: GpuMemorySnapshot, weights: int, activations: int,
                end: GpuMemorySnapshot) -> "GpuProfile":
        """From the snapshots before loading (``start``) and after the profile (``end``). The growth
        outside PyTorch between them is taken as this engine's (a process that allocates in that window
        would be counted too: the window is the engine's start-up)."""
        return cls(end.total, end.free + end.reserved - end.allocated, weights, activations,
                   max(0, end.outside_torch - start.outside_torch))

    def kv_budget(self, utilization: float) -> int:
        """``utilization * total`` less this engine's weights, activation peak and growth outside PyTorch;
        never more than fits beside what others hold now, with the activation peak still to come."""
        return max(0, min(self.share(utilization), self.fits()))

    def share(self, utilization: float) -> int:
        return int(utilization * self.total) - self.weights - self.activations - self.non_torch \
            - PROFILE_RESERVE_BYTES

    def fits(self) -> int:
        return self.available - self.activations - PROFILE_RESERVE_BYTES
