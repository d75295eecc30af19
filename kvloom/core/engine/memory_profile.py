"""The GPU start-up memory profile: run the largest step once through the target (and a draft) model and
turn PyTorch's own figures into the KV cache's byte budget (capacity.GpuProfile holds the arithmetic)."""

from __future__ import annotations

import logging

import torch

from kvloom.core.engine import capacity

logger = logging.getLogger("kvloom")


@torch.inference_mode()
def profile_free_gpu_memory(engine) -> int:
    """Bytes for the KV cache (both models' when there is a draft model): run the largest step
    through the target and the draft model once, and budget from PyTorch's own figures for this
    engine (capacity.GpuProfile): ``gpu_memory_utilization * total`` less the weights loaded since
    the start-up snapshot, the forwards' activation peak and this process's growth outside PyTorch,
    within what is free on the device."""
    cfg, dev = engine.config, engine.device
    start = engine._gpu_start
    torch.cuda.synchronize(dev)
    weights = torch.cuda.memory_allocated(dev) - start.allocated
    n = min(cfg.max_num_batched_tokens, engine.max_model_len)
    kv_dtype = capacity.kv_cache_dtype(cfg, engine.dtype, dev)
    draft = loaded_draft(engine)
    # A verify step samples a row per draft: up to max_num_seqs * (k + 1) rows of logits.
    proposer = getattr(engine, "proposer", None)  # a TP worker shares this profile and has none
    rows = min(n, cfg.max_num_seqs * (1 + (proposer.num_speculative_tokens if proposer is not None else 0)))
    runs = [ProfileRun(engine.model, engine.attention_backend, engine.hf_config.num_hidden_layers, kv_dtype, n,
                        cfg.block_size, rows, dev)]
    if draft is not None:  # its first forward after a long prompt is as large (chunked the same way)
        runs.append(ProfileRun(draft.model, draft.backend, draft.hf_config.num_hidden_layers, draft.dtype, n,
                                cfg.block_size, cfg.max_num_seqs, dev))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)  # weights and the profile's own KV blocks
    for run in runs:
        run()
    torch.cuda.synchronize(dev)
    activations = max(0, torch.cuda.max_memory_allocated(dev) - before)
    del runs
    profile = capacity.GpuProfile.measure(start, weights, activations, capacity.gpu_memory_snapshot(dev))
    budget = profile.kv_budget(cfg.gpu_memory_utilization)
    mib = 1 << 20  # small models' figures round to 0.00 GiB
    logger.info("Memory profile: total %.1f GiB; this engine: weights %.1f MiB, activation peak %.1f MiB, "
                "outside PyTorch %.1f MiB; KV budget %.2f GiB", profile.total / capacity.GiB,
                weights / mib, activations / mib, profile.non_torch / mib, budget / capacity.GiB)
    if profile.fits() < profile.share(cfg.gpu_memory_utilization):
        logger.warning("Only %.2f GiB of the GPU is free beside other processes and engines: the KV cache "
                       "gets %.2f GiB instead of the %.2f GiB that gpu_memory_utilization=%g would give",
                       profile.available / capacity.GiB, budget / capacity.GiB,
                       max(0, profile.share(cfg.gpu_memory_utilization)) / capacity.GiB,
                       cfg.gpu_memory_utilization)
    return budget


def loaded_draft(engine):
    """The spec_decode draft-model proposer once its model is loaded, else None (an ngram proposer, no
    speculation, or a TP worker, which runs the same profile)."""
    proposer = getattr(engine, "proposer", None)
    return proposer if getattr(proposer, "model", None) is not None else None


class ProfileRun:
    """One forward of ``n`` prompt tokens (the largest step) over KV blocks of its own, then softmax over
    ``rows`` rows of logits: what a model's step costs beyond its weights."""

    def __init__(self, model, backend, layers: int, kv_dtype: torch.dtype, n: int, block_size: int, rows: int,
                 device: torch.device) -> None:
        from kvloom.core.model.attention.base import AttentionMetadata

        self.model, self.n, self.rows, self.device = model, n, rows, device
        blocks = -(-n // block_size)
        shape = backend.kv_cache_shape(blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [(torch.empty(shape, dtype=kv_dtype, device=device),) * 2 for _ in range(layers)]
        self.meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            block_tables=torch.arange(blocks, device=device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([n], device=device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], device=device, dtype=torch.int32),
            num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n],
        )

    def __call__(self) -> None:
        n, dev = self.n, self.device
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), self.meta,
                            self.caches)
        self.model.compute_logits(hidden[: self.rows]).softmax(-1)
