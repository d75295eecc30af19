"""A tensor-parallel worker: rank 1..N-1 of an engine (rank 0 is the engine process, see tp_executor).
It loads its shard of the model and its heads' KV cache, then runs the forward of every plan rank 0
sends, until told to stop. Its process starts as ``python -m kvloom.launch.tp_worker``."""

from __future__ import annotations

import logging

import msgspec

from kvloom.core.config import EngineConfig

logger = logging.getLogger("kvloom.tp_worker")


class TPWorker:
    """What rank R holds: the same model, capacity and runner as rank 0 builds in ``EngineCore``, with the
    same arithmetic, so every collective of a step pairs up."""

    def __init__(self, config: EngineConfig, rank: int, store_port: int, parts) -> None:
        """``parts``: the engine's ``EngineParts`` (the same weight format as rank 0)."""
        import torch

        from kvloom.core.config import resolve_device, resolve_dtype
        from kvloom.core.engine import capacity
        from kvloom.core.model.attention.selector import get_attention_backend
        from kvloom.core.model.distributed import STORE_HOST, init_group, threads_per_rank
        from kvloom.core.model.files import resolve_model
        from kvloom.core.model.loader import build_model, load_hf_config
        from kvloom.core.worker.cpu_malloc import keep_freed_memory
        from kvloom.core.worker.cpu_threads import configure_threads
        from kvloom.core.worker.model_runner import make_kv_caches
        from kvloom.core.worker.tp_executor import TPWorkerRunner

        self.device = device = resolve_device(config.device)
        if device.type == "cuda":
            device = self.device = torch.device("cuda", rank)
        self.config = config = config.for_device(device.type)
        size = config.tensor_parallel_size
        store = torch.distributed.TCPStore(STORE_HOST, store_port, size, False)
        store.set(f"kvloom/ready/{rank}", "1")
        self.tp = tp = init_group(rank, size, store_port, device, store=store)
        if device.type == "cpu":
            keep_freed_memory()
            configure_threads(threads_per_rank(config))
        self.hf_config = load_hf_config(resolve_model(config.model), config.hf_overrides)
        self.dtype = resolve_dtype(config.dtype, device, self.hf_config)
        self.max_model_len = capacity.resolve_max_model_len(self.hf_config, config.max_model_len)
        kernels = config.kernels()
        self.attention_backend = get_attention_backend(device, kernels)
        # What the shared memory profile (memory_profile.profile_free_gpu_memory) counts from.
        self._gpu_start = capacity.gpu_memory_snapshot(device) if device.type == "cuda" else None
        self.model = build_model(
            resolve_model(config.model), self.hf_config, load_format=config.load_format, device=device,
            dtype=self.dtype, backend=self.attention_backend, max_positions=self.max_model_len, seed=config.seed,
            quantization=parts.make_quantization(self.hf_config, config), tp=tp, kernels=kernels,
        )
        lora = None
        if config.enable_lora:  # the same slots as rank 0's, holding this rank's share of each adapter
            from kvloom.core.model.lora import LoRAPool

            lora = LoRAPool(self.model, config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras)
        profile = self._profile if device.type == "cuda" else None
        layout = capacity.kv_layout(config, self.hf_config)  # rank 0's (no draft model under tensor parallelism)
        cap = capacity.kv_capacity(config, self.hf_config, self.dtype, self.max_model_len, profile, size,
                                   layout=layout)
        blocks = tp.min_int(cap.num_blocks, device)
        shape = self.attention_backend.kv_cache_shape(blocks, config.block_size, self.model.num_kv_heads,
                                                      self.model.head_dim)
        cache_dtype = capacity.kv_cache_dtype(config, self.dtype, device)
        kv_caches = make_kv_caches(self.hf_config.num_hidden_layers, shape, cache_dtype, device, layout)
        num_groups = len(layout.groups) if layout.hybrid else 1
        self.model.kv_groups = layout.group_of_layer() if num_groups > 1 else None
        share_tokens = config.async_scheduling == "on" or (config.async_scheduling == "auto" and device.type == "cuda")
        self.runner = TPWorkerRunner(self.model, kv_caches, config.block_size, device, config.seed, num_groups, tp=tp,
                                     share_tokens=share_tokens, lora=lora)
        if device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len)
        logger.info("Tensor-parallel rank %d of %d ready: %d KV blocks", rank, size, blocks)
        from kvloom.core.engine.core import freeze_startup_heap

        freeze_startup_heap()  # as rank 0's engine does

    def _profile(self) -> int:
        from kvloom.core.engine.memory_profile import profile_free_gpu_memory

        # The same profile as rank 0's, at the same time: its forward runs the same collectives.
        return profile_free_gpu_memory(self)

    def serve(self, address: str) -> int:
        import zmq

        from kvloom.core.engine.step import SchedulerOutput
        from kvloom.core.worker.tp_executor import STEP, STOP

        decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while True:
                frames = sock.recv_multipart()
                if frames[0] == STOP:
                    return 0
                if frames[0] != STEP or len(frames) != 2:
                    raise RuntimeError(f"unexpected message from rank 0: {frames[0]!r}")
                self.runner.execute(decoder.decode(frames[1]))
        finally:
            sock.close()
            ctx.term()
