"""The CPU steps compiled (``torch.compile``, inductor): the norms, rotary, activations, residual adds and
attention's index work of every layer become a few C++ loops around the matmuls, one call a step instead of
~5,500 small ops (docs/benchmarks.md, "CPU: the compiled decode step").

Decode steps (``CompiledDecode``): attention reads a ``DecodeStep`` (``CPUAttentionBackend.decode_step``), indices
built once a step outside the graph, so the traced code sees tensors only. Only the batch and the context length
are dynamic; the step is compiled at start-up for the variants its guards tell apart (a batch of 1, of up to
``INT4_MAX_ROWS`` rows, of more), so no request waits for a compile, and steps then skip the guards.

Steps holding prompt rows (``CompiledPrompts``): the token count is dynamic and attention is one opaque op a layer
(``PromptStep``) reading the step's metadata, as vLLM's compiled models call their attention; one variant, the
rows to sample padded to one count. A step it was not compiled for runs eagerly.

Kernels are cached on disk (inductor's cache, under ``~/.cache/kvloom/inductor``) for the next start. The fused
loops run on the engine's thread count and the guards hold it: a step run with another count (the thread
governor's, under contention) runs eagerly."""

from __future__ import annotations

import logging
import os
import time
import types

import torch

from kvloom.core.model.attention.base import AttentionMetadata
from kvloom.core.model.attention.cpu import (CPUAttentionBackend, PromptStep, _PagedIndex, paged_kernel_serves,
                                             prompt_step)
from kvloom.core.model.cpu_packing import INT4_MAX_ROWS

logger = logging.getLogger("kvloom")

def compile_refusal(model, backend, kv_caches, lora) -> str | None:
    """Why the CPU steps cannot be compiled for this model, or None."""
    from kvloom.core.model.families.decoder import DecoderLayer, DecoderLM

    # before inductor first asks for its cache folder (then it keeps the one it found: /tmp by default)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "kvloom", "inductor"))
    if torch._dynamo.config.disable:
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    if not isinstance(backend, CPUAttentionBackend):
        return f"the {getattr(backend, 'name', type(backend).__name__)} attention backend"
    if not isinstance(model, DecoderLM) or not all(type(layer) is DecoderLayer for layer in model.layers):
        return f"{type(model).__name__}'s layers are not plain decoder layers"
    if lora is not None:
        return "LoRA adapters"
    if any(k.dtype != model.embed_tokens.weight.dtype for k, _ in kv_caches):
        return "a KV cache dtype other than the model's"
    if model.tp.size != 1:
        return "tensor parallelism"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - no C++ compiler: inductor cannot build its CPU kernels
        return f"no C++ compiler ({exc})"
    return None


def _forward(model, ids, positions, step, kv_caches):
    return model(ids, positions, step, kv_caches)


def _compiled_copy(fn, name: str, threads: int):
    """``torch.compile`` of a copy of ``fn`` (dynamo's cache lives on the code object: each engine its own, so
    another model never matches this one's graphs), its loops on ``threads`` threads, guards skipping the modules'
    attributes."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, name)
    # no size/stride asserts around each op call: ~12 a layer, ~0.2 ms of a decode step (3 % at one stream)
    options = {"cpp.threads": threads, "size_asserts": False}
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    return torch.compile(copy, dynamic=None, options=options)


def _layer_groups(model) -> list[int]:
    """Each layer's KV-cache group (a hybrid cache has several; else all 0)."""
    return model.kv_groups or [0] * len(model.layers)


def shares_pages(kv_caches) -> bool:
    """Whether layers share cache tensors (a hybrid cache: ``make_kv_caches``), so that a step writes one several
    times (``DecodeStep.shared_pages``)."""
    return len({id(k) for k, _ in kv_caches}) < len(kv_caches)


def _first_layers(model) -> dict[int, int]:
    """Layer group -> its first layer, whose cache the step's indices are built from."""
    groups = _layer_groups(model)
    return {g: groups.index(g) for g in dict.fromkeys(groups)}


def _mark_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledDecode:
    """Runs decode-only steps of ``model`` compiled; called as ``(ids, positions, metadata)``."""

    def __init__(self, model, backend: CPUAttentionBackend, kv_caches, adjust_threads=None) -> None:
        # one engine's three variants, and room for other models' in the same process (tests, LLM objects)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.shared_pages = shares_pages(kv_caches)
        self.compiled = None  # made by ``warm_up``, for its thread count
        self.windows: dict[int, set] = {}  # layer group -> the windows its layers attend with
        for group, layer in zip(_layer_groups(model), model.layers):
            self.windows.setdefault(group, set()).add(layer.self_attn.variant.get("window"))
        self.first_layer = _first_layers(model)
        self.adjust_threads = adjust_threads
        self.threads = 0  # the thread count compiled for (0: not yet)
        # decode attention in place (kvloom.kernels.cpu_attention) where the kernel takes this cache
        self.paged = paged_kernel_serves(kv_caches[0][0], model.layers[0].self_attn.num_heads)

    def steps(self, meta: AttentionMetadata | list[AttentionMetadata]):
        dtype = self.model.embed_tokens.weight.dtype
        metas = meta if isinstance(meta, (list, tuple)) else [meta]
        steps = [self.backend.decode_step(m, self.kv_caches[self.first_layer[g]][0], dtype, self.windows[g],
                                          paged=self.paged, shared_pages=self.shared_pages)
                 for g, m in enumerate(metas)]
        for step in steps:  # the batch and the context's length vary step to step: never constants of the code
            _mark_rows(step.write_rows)
            for index in step.decode.values():
                if isinstance(index, _PagedIndex):
                    _mark_rows(index.tables, index.starts, index.ends)
                    torch._dynamo.maybe_mark_dynamic(index.tables, 1)
                    continue
                rows, bias = index
                _mark_rows(rows, bias)
                torch._dynamo.maybe_mark_dynamic(bias, 3)
        return steps if isinstance(meta, (list, tuple)) else steps[0]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        if self.adjust_threads is not None:
            self.adjust_threads()
        step = self.steps(meta)
        if torch.get_num_threads() != self.threads:
            return self.model(ids, positions, step, self.kv_caches)
        _mark_rows(ids, positions)
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.compiled(self.model, ids, positions, step, self.kv_caches)
        except RuntimeError as exc:
            if "skip_guard_eval_unsafe" not in str(exc):
                raise
        logger.warning("CPU decode step: a shape the start-up did not compile for (batch %d); compiling it now",
                       ids.shape[0])
        return self.compiled(self.model, ids, positions, step, self.kv_caches)

    @torch.inference_mode()
    def warm_up(self, max_rows: int, block_size: int, metas, threads: int) -> float:
        """Compile for the batch sizes the guards tell apart (1, a few, ``max_rows``) at ``threads`` threads (the
        guards hold the count too) before any request comes; ``metas(n, length)``: decode metadata of ``n`` rows
        with ``length`` cached positions each. Returns the seconds it took."""
        t0 = time.perf_counter()
        # The fused loops parallelize over the engine's threads (at 32 rows the KV gathers alone would take
        # ~10 ms on one); loops too small to split stay serial. Only the batch and the context length are
        # dynamic (marked in ``steps``): weights and the cache's shape are static, so the guards are C++ tensor
        # checks rather than Python shape formulas.
        # Guards skip the modules' attributes (a loaded model's do not change; ~0.5 ms a step at batch 1 on SmolLM2),
        # hence each engine's own copy of the function (``_compiled_copy``).
        self.compiled = _compiled_copy(_forward, f"decode_{id(self):x}", threads)
        current = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for n in sorted({1, min(2, max_rows), max_rows}):
                meta = metas(n, 3 * block_size)  # 3 blocks: 1 would be specialized, 2 might equal a head size
                ids, positions = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
                _mark_rows(ids, positions)
                self.compiled(self.model, ids, positions, self.steps(meta), self.kv_caches)
        finally:
            torch.set_num_threads(current)
        self.threads = threads
        return time.perf_counter() - t0


class CompiledPrompts:
    """Runs steps holding prompt rows compiled: the layers' norms, rotary, activations and residual adds fused
    around the matmuls as in the decode step, attention one opaque op per layer (``PromptStep``), the token
    count dynamic. Called as ``(ids, positions, metadata, keep)``; a step of a shape no compiled variant takes
    (or at another thread count) runs eagerly rather than compile while requests wait."""

    def __init__(self, model, backend: CPUAttentionBackend, kv_caches, adjust_threads=None) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.shared_pages = shares_pages(kv_caches)
        self.first_layer = _first_layers(model)
        self.adjust_threads = adjust_threads
        self.compiled = None
        self.threads = 0

    def _steps(self, metas: list[AttentionMetadata]) -> list[PromptStep]:
        steps = []
        for g, m in enumerate(metas):
            index = m.backend_data = self.backend._index(m, self.kv_caches[self.first_layer[g]][0])
            _mark_rows(index.write_rows)
            steps.append(PromptStep(index.write_rows, g, self.shared_pages))
        return steps

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata | list[AttentionMetadata], keep: torch.Tensor | None) -> torch.Tensor:
        if self.adjust_threads is not None:
            self.adjust_threads()
        if torch.get_num_threads() != self.threads or keep is None or keep.shape[0] == 0:
            return self.model(ids, positions, meta, self.kv_caches, keep=keep)
        return self._run(ids, positions, meta, keep, "eager_on_recompile")

    def _run(self, ids, positions, meta, keep, stance: str):
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        steps = self._steps(metas)
        kept = keep.shape[0]
        if kept < KEEP_ROWS:  # one compiled variant for every count: the last row repeated, its copies dropped
            keep = torch.cat([keep, keep[-1:].expand(KEEP_ROWS - kept)])
        _mark_rows(ids, positions, keep)
        with prompt_step(metas, self.backend), torch.compiler.set_stance(stance):
            out = self.compiled(self.model, ids, positions, steps if isinstance(meta, (list, tuple)) else steps[0],
                                self.kv_caches, keep)
        return out[:kept]

    @torch.inference_mode()
    def warm_up(self, block_size: int, metas, threads: int) -> float:
        """Compile at ``threads`` threads before any request comes (one variant: the token count is dynamic, the
        kept rows padded to ``KEEP_ROWS``); ``metas(n, length)``: metadata of ``n`` prompts of ``length`` tokens.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self.compiled = _compiled_copy(_forward_keep, f"prompts_{id(self):x}", threads)
        current = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            length = 2 * block_size + 3  # more tokens than the 4-bit matmuls' cut, not a multiple of a block
            self._run(torch.zeros(length, dtype=torch.long), torch.arange(length), metas(1, length),
                      torch.tensor([length - 1]), "default")
        finally:
            torch.set_num_threads(current)
        self.threads = threads
        return time.perf_counter() - t0


# Kept rows padded to more than the 4-bit matmuls' cut: the last layer's matmuls over them take one path whatever
# the count, so one compiled variant serves every step (the padding: at most a few rows' MLP).
KEEP_ROWS = INT4_MAX_ROWS + 1


def _forward_keep(model, ids, positions, step, kv_caches, keep):
    return model(ids, positions, step, kv_caches, keep=keep)
