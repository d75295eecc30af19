"""Attention on the CPU: the paged cache laid out head-major, and the per-step index work done once.

The reference backend (``kvloom.core.model.attention.base.TorchAttentionBackend``) keeps the GPU kernels' layout,
``[num_blocks, block_size, num_kv_heads, head_dim]``; gathering a sequence's blocks from it yields
``[L, Hkv, D]``, which every matmul then has to copy into ``[Hkv, L, D]``. Here a block is
``[num_kv_heads, block_size, head_dim]``, so one ``index_select`` over ``(block, head)`` rows yields
``[B, Hkv, L, D]`` already contiguous, and decode attention is two batched matmuls (the query heads
that share a KV head are that head's rows: no K/V expansion for GQA). The indices (cache rows to
write, blocks to gather, the padding mask) depend only on the step, so they are built at the first
layer and reused by the other layers.

Decode rows over a float32 or bfloat16 cache skip that gather where the C++ kernel builds
(``kvloom.kernels.cpu_attention``): it walks each row's block table and reads the cached rows where they lie,
20 % off a 32-stream step on SmolLM2 (docs/benchmarks.md, "CPU: decode attention in place");
``KVLOOM_CPU_PAGED_DECODE=0`` keeps the gather.

In bf16 on a CPU with AVX512-BF16, prompt rows attend in a C++ kernel (``cpu_attention.prompt_attention``: scores
and softmax in float32, the probabilities rounded to bf16 for the values, as decode rows' are; 144 -> 60 ms of
SmolLM2's 4,096-token prompt step). ``KVLOOM_CPU_PROMPT_ATTENTION=0``, fp16, soft-caps, sinks, or a window
narrower than the span keep batched matmuls (scores in the model dtype, softmax in float32, as transformers' eager
attention does), faster there than PyTorch's fused CPU kernel; in float32 the fused kernel
(``scaled_dot_product_attention``) is the faster one and is used. Prompts of equal length are batched together (as
views when they are adjacent in the batch), and a prompt's fresh K/V are read directly when nothing is cached before
it. A chunk after a cached prefix goes through the same formula as a whole prompt, so in bf16 prefix caching changes
outputs only as far as its smaller matmuls round differently (``benchmarks/prefix_cache_ab.py`` on the GGUF: none of
32 greedy sequences with the prompt kernel, 1 with the batched matmuls, 15 with two formulas).

The backend rotates q and k itself (``fuses_rotary``): in bf16 with the C++ library, one pass rotates them (float32
arithmetic on the bf16 tables, rounded once) and writes the step's K/V rows (``cpu_attention.rope_write``); other
dtypes and fp8 caches take the reference's rotary and ``index_copy_``, as does ``KVLOOM_CPU_ROPE_WRITE=0``.

An fp8 cache (``kv_cache_dtype="fp8"``) is quantized on write and dequantized on read: the gathers move
half the bytes, then one conversion per gathered tensor gives the model dtype; a prompt with nothing
cached before it attends to its fresh, unquantized K/V.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvloom.core.model.attention.base import AttentionMetadata
from kvloom.core.model.cpu_packing import INT4_MAX_ROWS
from kvloom.kernels import cpu_attention, cpu_ops, reference
from kvloom.kernels.reference import dequantize_kv, is_fp8, quantize_kv


@dataclass
class _DecodeIndex:
    """Which cache rows the decode rows read, for one window (None: every position)."""

    rows: torch.Tensor  # [nd * Hkv * nblk] rows of the cache viewed as [num_blocks * Hkv, bs, D]
    blocks: int  # nblk: blocks gathered per sequence
    bias: torch.Tensor  # [nd, 1, 1, nblk * bs] 0 where attended, -inf on padding and outside the window
    mask: torch.Tensor  # the same as bool: True where attended


@dataclass
class _StepIndex:
    write_rows: torch.Tensor  # [T * Hkv] rows of the cache viewed as [num_blocks * Hkv * block_size, D]
    decode: dict  # window -> _DecodeIndex, built when a layer with that window first decodes in the step
    prefill_groups: list[tuple[list[int], int, int, int | None]]  # (sequences, q_len, s_len, first row if
    # their queries are one contiguous run of the flat batch, else None), equal shapes grouped
    starts: list[int]  # each sequence's first query in the flat batch
    paged: bool | None = None  # whether the step's decode rows read in place (``paged_kernel_serves``), once a step
    masks: dict = field(default_factory=dict)  # a prompt group's mask and additive bias, the same in every layer


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in the scores' dtype. For bf16/fp16 PyTorch's CPU kernel computes in float32
    and rounds once: the same values as ``softmax(dtype=float32).to(dtype)``, without the float32 copy."""
    return torch.softmax(scores, dim=-1)


# The compiled decode step's attention runs torch's fused CPU kernel up to this many rows (the bf16 batched
# matmuls beyond, faster at 32): at batch 1 it saved ~1 ms a token on SmolLM2 (docs/benchmarks.md); the 4-bit
# matmuls' cut, so it adds no variant to compile.
SDPA_DECODE_ROWS = INT4_MAX_ROWS


def _block_rows(table_cols: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows ``block * Hkv + head`` of each table row's blocks ``[seq, blocks]``, ordered ``[seq, head, block]``."""
    heads = torch.arange(num_kv_heads, device=table_cols.device)
    rows = table_cols[:, None, :].long() * num_kv_heads + heads[None, :, None]
    return rows.reshape(-1)


def _first_block(s_len: int, q_len: int, window: int | None, bs: int) -> int:
    """The first cache block a chunk of ``q_len`` queries ending at ``s_len`` reads (its window's start)."""
    if window is None:
        return 0
    return max(0, s_len - q_len - window + 1) // bs


def _window_key(window: int | None, longest: int) -> int | None:
    """The window decode rows of at most ``longest`` positions read through: None where every row sees its
    whole sequence."""
    return None if window is not None and longest <= window else window


@dataclass
class _PagedIndex:
    """What ``cpu_attention.paged_decode`` reads for the decode rows: their block tables and the positions
    ``starts <= p < ends`` each attends (its window's, or the whole sequence)."""

    tables: torch.Tensor  # int32 [nd, W]
    starts: torch.Tensor  # int64 [nd]
    ends: torch.Tensor  # int64 [nd]


def paged_kernel_serves(k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether decode rows over this cache go through ``cpu_attention.paged_decode`` (in place) rather than the
    gather: a float32 or bfloat16 cache of shapes it takes, and the kernel built."""
    _, num_kv_heads, bs, head_dim = k_cache.shape
    return (cpu_attention.enabled() and cpu_attention.supports(k_cache.dtype, num_heads, num_kv_heads, head_dim, bs)
            and cpu_attention.available())


def _paged_index(meta: AttentionMetadata, window: int | None) -> _PagedIndex:
    nd = meta.num_decodes
    ends = meta.seq_lens[:nd].long()
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp_(min=0)
    return _PagedIndex(meta.block_tables[:nd].int(), starts, ends)


@dataclass
class PromptStep:
    """A step holding prompt rows, run compiled (``kvloom.core.worker.cpu_compile.CompiledPrompts``): the traced
    layers write the cache rows and call ``prompt_attention``, an opaque op that attends with the step's metadata
    (``prompt_step``), whose per-sequence shapes would otherwise be constants of the compiled code."""

    write_rows: torch.Tensor
    group: int  # the layer group whose metadata the op reads (a hybrid cache has one per group)
    shared_pages: bool = False  # layers share cache tensors (a hybrid cache): the write is an opaque op


# the running compiled step's metadata (by layer group) and backend, read by ``prompt_attention``
_PROMPT_STEP: tuple[list[AttentionMetadata], "CPUAttentionBackend"] | None = None


@contextlib.contextmanager
def prompt_step(metas: list[AttentionMetadata], backend: "CPUAttentionBackend"):
    """The metadata ``prompt_attention`` reads while a compiled step runs."""
    global _PROMPT_STEP
    _PROMPT_STEP = (metas, backend)
    try:
        yield
    finally:
        _PROMPT_STEP = None


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, group: int, scale: float, window: int, softcap: float,
                      sinks: torch.Tensor | None, k_scale: float, v_scale: float) -> torch.Tensor:
    """``CPUAttentionBackend._attend`` for a compiled step (``PromptStep``), K/V already written: ``window`` -1
    for none, ``softcap`` 0.0 for none."""
    if _PROMPT_STEP is None:
        raise RuntimeError("kvloom::cpu_prompt_attention called outside a compiled prompt step")
    metas, backend = _PROMPT_STEP
    meta = metas[group]
    out = backend._attend(q, k, v, k_cache, v_cache, meta, meta.backend_data, scale, (k_scale, v_scale),
                          None if window < 0 else window, softcap or None, sinks)
    return out.contiguous()  # the strides the compiled code assumes (the fake's, below)


prompt_attention = cpu_ops.define(
    "cpu_prompt_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, int group, float scale, "
    "int window, float softcap, Tensor? sinks, float k_scale, float v_scale) -> Tensor", _prompt_attention,
    lambda q, *rest: torch.empty_like(q, memory_format=torch.contiguous_format))


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_rows: torch.Tensor,
             k_scale: float, v_scale: float) -> None:
    """A step's new K/V into their cache rows (``_StepIndex.write_rows``)."""
    head_dim = k_cache.shape[-1]
    if is_fp8(k_cache.dtype):  # index_copy_ has no float8 kernels: copy the quantized bytes
        for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            rows = quantize_kv(x.reshape(-1, head_dim), cache.dtype, s).view(torch.uint8)
            cache.view(torch.uint8).view(-1, head_dim).index_copy_(0, write_rows, rows)
    else:
        k_cache.view(-1, head_dim).index_copy_(0, write_rows, k.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, write_rows, v.reshape(-1, head_dim))


# The same as one op that mutates the cache where it lies. Traced as index_copy_, a write to a cache tensor that
# several layers of a step write (a hybrid cache's shared pages) makes the compiled code copy the whole tensor at each
# write but the last, to keep each layer's view of it (Gemma 3 270M: 238 ms a token against 34 eagerly).
kv_write_op = cpu_ops.define("cpu_kv_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                             "Tensor write_rows, float k_scale, float v_scale) -> ()", kv_write, lambda *args: None)


def _write_step(q, k, v, rope, k_cache, v_cache, write_rows, k_scale: float, v_scale: float, opaque: bool):
    """The step's K/V into their cache rows, and q and k as attention takes them: with ``rope``, rotated by
    ``cpu_attention.rope_write`` (an op where a step is compiled: it writes the cache where it lies), else as they
    came, written by ``kv_write`` (its op where ``opaque``: a hybrid cache's shared pages)."""
    if rope is not None:
        write = cpu_attention.rope_write_op if torch.compiler.is_compiling() else cpu_attention.rope_write
        return write(q, k, v, rope[0], rope[1], k_cache, v_cache, write_rows)
    (kv_write_op if opaque else kv_write)(k, v, k_cache, v_cache, write_rows, k_scale, v_scale)
    return q, k


@dataclass
class DecodeStep:
    """A decode-only step's indices, built before the layers run (``CPUAttentionBackend.decode_step``): what the
    compiled decode step (``kvloom.core.worker.cpu_compile``) hands its layers instead of the metadata, so the
    traced code reads tensors only."""

    write_rows: torch.Tensor
    decode: dict  # a layer's window (None: full attention) -> (cache rows to gather, additive mask), or a
    # _PagedIndex where the in-place kernel serves
    shared_pages: bool = False  # layers share cache tensors (a hybrid cache): the write is an opaque op


class CPUAttentionBackend:
    name = "cpu"
    # forward takes the step's rotary tables (``rope``): in bf16 one kernel rotates q and k and writes the cache
    # (``cpu_attention.rope_write``), elsewhere the reference's rotary and the cache write as before
    fuses_rotary = True

    def decode_step(self, meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype,
                    windows: set, paged: bool = False, shared_pages: bool = False) -> DecodeStep:
        """The indices of a decode-only step for layers with these ``windows`` (None: full attention);
        ``paged``: for the in-place kernel (``paged_kernel_serves``) rather than the gather; ``shared_pages``:
        layers share cache tensors (``DecodeStep``)."""
        write_rows = self._index(meta, k_cache).write_rows
        if paged:
            return DecodeStep(write_rows, {window: _paged_index(meta, window) for window in windows}, shared_pages)
        longest = max(meta.seq_lens_cpu)
        decode = {}
        for window in windows:
            key = _window_key(window, longest)
            # two blocks at least: a gather of one block would take another shape in the compiled code
            index = self._decode_index(meta, k_cache, dtype, key, min_blocks=2)
            decode[window] = (index.rows, index.bias)
        return DecodeStep(write_rows, decode, shared_pages)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def _index(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> _StepIndex:
        _, num_kv_heads, bs, _ = k_cache.shape
        slots = meta.slot_mapping.long()
        heads = torch.arange(num_kv_heads, device=slots.device)
        # token at slot s, head h -> row ((s // bs) * Hkv + h) * bs + s % bs
        write_rows = (((slots // bs) * num_kv_heads)[:, None] + heads[None, :]) * bs + (slots % bs)[:, None]
        nd = meta.num_decodes
        groups: dict[tuple[int, int], list[int]] = {}
        for i in range(nd, meta.num_seqs):
            groups.setdefault((meta.query_lens_cpu[i], meta.seq_lens_cpu[i]), []).append(i)
        starts = [0]
        for n in meta.query_lens_cpu[:-1]:
            starts.append(starts[-1] + n)
        prefill_groups = []
        for (q_len, s_len), seqs in groups.items():
            contiguous = all(starts[i] == starts[seqs[0]] + j * q_len for j, i in enumerate(seqs))
            prefill_groups.append((seqs, q_len, s_len, starts[seqs[0]] if contiguous else None))
        return _StepIndex(write_rows.reshape(-1), {}, prefill_groups, starts)

    @staticmethod
    def _decode_index(meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype,
                      window: int | None, min_blocks: int = 1) -> _DecodeIndex:
        """The blocks each decode row reads: all of its sequence's, or only those its window covers (so a
        long sequence with a small window gathers a few blocks, whatever its length); at least
        ``min_blocks``, the extra ones masked out."""
        _, num_kv_heads, bs, _ = k_cache.shape
        nd = meta.num_decodes
        lens_cpu = meta.seq_lens_cpu[:nd]
        lens = meta.seq_lens[:nd].long()
        tables = meta.block_tables[:nd]
        device = tables.device
        if window is None:
            nblk = max(-(-max(lens_cpu) // bs), min_blocks)
            if nblk <= tables.shape[1]:
                table_cols = tables[:, :nblk]
            else:  # min_blocks past the table's width: repeat its last block, masked out below
                table_cols = tables[:, torch.arange(nblk, device=device).clamp_(max=tables.shape[1] - 1)]
            first_pos = torch.zeros_like(lens)
        else:
            first_blocks = [max(0, n - window) // bs for n in lens_cpu]
            nblk = max(max(-(-n // bs) - f for n, f in zip(lens_cpu, first_blocks)), min_blocks)
            first_blk = torch.tensor(first_blocks, dtype=torch.long, device=device)
            cols = (first_blk[:, None] + torch.arange(nblk, device=device)[None, :]).clamp_(max=tables.shape[1] - 1)
            table_cols = torch.gather(tables, 1, cols)
            first_pos = (lens - window).clamp_(min=0)
            lens, first_pos = lens - first_blk * bs, first_pos - first_blk * bs  # relative to the first gathered
        pos = torch.arange(nblk * bs, device=device)[None, :]
        mask = (pos < lens[:, None]) & (pos >= first_pos[:, None])
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
        return _DecodeIndex(_block_rows(table_cols, num_kv_heads), nblk, bias[:, None, None, :], mask[:, None, None, :])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        rope=None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward`` (the layer's variant: ``window``, ``softcap``, ``sinks``); ``rope``: the
        step's ``(cos, sin)`` (``reference.rotary_tables``) when q and k come unrotated."""
        k_cache, v_cache = kv_cache
        if rope is not None and not cpu_attention.rope_serves(q, k, v, k_cache, rope[0]):
            q, k = reference.apply_rotary(rope, q, k)
            rope = None
        if isinstance(meta, DecodeStep):  # plain ops, traceable: the compiler fuses the mask and scale in
            q, k = _write_step(q, k, v, rope, k_cache, v_cache, meta.write_rows, k_scale, v_scale, meta.shared_pages)
            if isinstance(meta.decode[window], _PagedIndex):
                return self._paged(q, k_cache, v_cache, meta.decode[window], scale, softcap, sinks)
            rows, bias = meta.decode[window]
            explicit = softcap is not None or sinks is not None
            index = _DecodeIndex(rows, bias.shape[-1] // k_cache.shape[2], bias, bias == 0 if explicit else None)
            return self._decode(q, k_cache, v_cache, index, scale, softcap=softcap, sinks=sinks,
                                sdpa=q.shape[0] <= SDPA_DECODE_ROWS)
        if isinstance(meta, PromptStep):  # the cache write traced (or opaque: shared pages); the attention opaque
            q, k = _write_step(q, k, v, rope, k_cache, v_cache, meta.write_rows, k_scale, v_scale, meta.shared_pages)
            return prompt_attention(q, k, v, k_cache, v_cache, meta.group, scale, -1 if window is None else window,
                                    0.0 if softcap is None else float(softcap), sinks, k_scale, v_scale)
        index = meta.backend_data
        if index is None:  # first layer of the step
            index = meta.backend_data = self._index(meta, k_cache)
        q, k = _write_step(q, k, v, rope, k_cache, v_cache, index.write_rows, k_scale, v_scale, False)
        return self._attend(q, k, v, k_cache, v_cache, meta, index, scale, (k_scale, v_scale), window, softcap, sinks)

    def _attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, index: _StepIndex, scale: float,
                kv_scales: tuple[float, float], window: int | None, softcap: float | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of a step's rows after its K/V are written: decode rows, then prompt chunks by group."""
        head_dim = k_cache.shape[-1]
        explicit = softcap is not None or sinks is not None  # scores written out (no fused kernel does these)
        nd = meta.num_decodes
        if index.paged is None:
            index.paged = bool(nd) and paged_kernel_serves(k_cache, q.shape[1])
        paged = index.paged
        if paged:
            dec = index.decode.get(("paged", window))
            if dec is None:
                dec = index.decode[("paged", window)] = _paged_index(meta, window)
        elif nd:
            window_key = _window_key(window, max(meta.seq_lens_cpu[:nd]))
            dec = index.decode.get(window_key)
            if dec is None:
                dec = index.decode[window_key] = self._decode_index(meta, k_cache, q.dtype, window_key)
        if nd == meta.num_seqs:
            if paged:
                return self._paged(q, k_cache, v_cache, dec, scale, softcap, sinks)
            return self._decode(q, k_cache, v_cache, dec, scale, kv_scales, softcap, sinks)
        num_tokens, num_heads, _ = q.shape
        if nd == 0 and len(index.prefill_groups) == 1 and index.prefill_groups[0][3] == 0:
            out = None  # one group of prompts covering the whole batch: its result is the output
        else:
            out = q.new_empty(num_tokens, num_heads, head_dim)
        if paged:
            out[:nd] = self._paged(q[:nd], k_cache, v_cache, dec, scale, softcap, sinks)
        elif nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, dec, scale, kv_scales, softcap, sinks)
        starts = index.starts
        bs = k_cache.shape[2]
        kernel = not explicit and cpu_attention.prompt_serves(q.dtype, num_heads, k_cache.shape[1], head_dim)
        for seqs, q_len, s_len, first in index.prefill_groups:
            n = len(seqs)
            if first is not None:  # one run of the flat batch: views, no copies
                qs = q[first: first + n * q_len].unflatten(0, (n, q_len))  # [n, Q, Hq, D]
            else:
                qs = torch.stack([q[starts[i]: starts[i] + q_len] for i in seqs])
            first_key = 0
            if q_len == s_len:  # nothing cached before: attend to the fresh K/V
                if first is not None:
                    ks = k[first: first + n * q_len].unflatten(0, (n, q_len))
                    vs = v[first: first + n * q_len].unflatten(0, (n, q_len))
                else:
                    ks = torch.stack([k[starts[i]: starts[i] + q_len] for i in seqs])
                    vs = torch.stack([v[starts[i]: starts[i] + q_len] for i in seqs])
                keys, values = ks.transpose(1, 2), vs.transpose(1, 2)  # [n, Hkv, Q, D] views
            else:  # a chunk after a cached prefix: gather the history its window reads
                first_key = _first_block(s_len, q_len, window, bs) * bs
                keys, values = self._gather_prefix(k_cache, v_cache, meta.block_tables[seqs], first_key // bs,
                                                   s_len, q.dtype, kv_scales)
            # the keys' positions start at first_key; a window narrower than the span needs a mask of its own
            windowed = window is not None and s_len - first_key > window
            if kernel and not windowed:  # causal over the keys from first_key, in C++ (``prompt_attention``)
                o = cpu_attention.prompt_attention(qs, keys, values, scale)
            else:
                mask = None
                mask_key = (q_len, s_len, first_key, window if windowed else None)
                if q_len != s_len or windowed:
                    mask = index.masks.get(mask_key)
                    if mask is None:
                        mask = index.masks[mask_key] = reference.visible(
                            torch.arange(s_len - q_len, s_len, device=q.device),
                            torch.arange(first_key, s_len, device=q.device), window)
                if explicit:
                    o = self._prefill_explicit(qs, keys, values, scale, mask, softcap, sinks, s_len - first_key)
                elif q.dtype != torch.float32:
                    group = q.shape[1] // k_cache.shape[1]
                    bias_key = (mask_key, group, q.dtype)
                    bias = index.masks.get(bias_key)
                    if bias is None:
                        bias = index.masks[bias_key] = self._prefill_bias(q_len, s_len - first_key, group, q.dtype,
                                                                          mask)
                    o = self._prefill_grouped(qs, keys, values, scale, bias)
                elif mask is None:
                    o = F.scaled_dot_product_attention(qs.transpose(1, 2), keys, values, is_causal=True, scale=scale,
                                                       enable_gqa=True).transpose(1, 2)
                else:
                    o = F.scaled_dot_product_attention(qs.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                                       enable_gqa=True).transpose(1, 2)
            if out is None:
                return o.flatten(0, 1)
            if first is not None:
                out[first: first + n * q_len] = o.flatten(0, 1)
            else:
                for j, i in enumerate(seqs):
                    out[starts[i]: starts[i] + q_len] = o[j]
        return out

    @staticmethod
    def _paged(q, k_cache, v_cache, index: _PagedIndex, scale: float, softcap, sinks) -> torch.Tensor:
        return cpu_attention.paged_decode(q, k_cache, v_cache, index.tables, index.starts, index.ends, scale,
                                          0.0 if softcap is None else float(softcap), sinks)

    @staticmethod
    def _decode(q, k_cache, v_cache, index: _DecodeIndex, scale: float, kv_scales=(1.0, 1.0), softcap=None,
                sinks=None, sdpa: bool = False) -> torch.Tensor:
        _, num_kv_heads, bs, head_dim = k_cache.shape
        batch, num_heads, _ = q.shape
        length = index.blocks * bs
        keys = k_cache.view(-1, bs, head_dim).index_select(0, index.rows).view(batch, num_kv_heads, length, head_dim)
        values = v_cache.view(-1, bs, head_dim).index_select(0, index.rows).view(batch, num_kv_heads, length, head_dim)
        keys, values = dequantize_kv(keys, q.dtype, kv_scales[0]), dequantize_kv(values, q.dtype, kv_scales[1])
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if softcap is not None or sinks is not None:
            sinks = None if sinks is None else sinks.view(num_kv_heads, -1, 1)
            out = reference.attend(grouped, keys, values, index.mask, scale, softcap, sinks)
            return out.view(batch, num_heads, head_dim)
        if q.dtype == torch.float32 or sdpa:
            # float32 batched matmuls this small run in MKL at a fraction of the fused kernel's speed; in bf16
            # the fused kernel wins where the step has few rows (``sdpa``, the compiled step's)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=index.bias, scale=scale)
            return out.view(batch, num_heads, head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2))  # [B, Hkv, G, L]
        scores.mul_(scale).add_(index.bias)
        return torch.matmul(_softmax(scores), values).view(batch, num_heads, head_dim)

    @staticmethod
    def _prefill_bias(length: int, total: int, group: int, dtype: torch.dtype,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """``_prefill_grouped``'s mask as an additive bias the matmul starts from (-inf where a key is hidden), one
        copy per query head of the group, ``[G * Q, S]``: cheaper than masking the scores afterwards. ``mask``
        (``[Q, S]`` bool): which keys each query sees, where that is not plain causality over the last ``Q``."""
        hidden = torch.ones(length, total, dtype=torch.bool).triu_(total - length + 1) if mask is None else ~mask
        return torch.zeros(length, total, dtype=dtype).masked_fill_(hidden, float("-inf")).repeat(group, 1)

    @staticmethod
    def _prefill_grouped(q, keys, values, scale: float, bias: torch.Tensor) -> torch.Tensor:
        """Causal attention of prompt chunks, ``q`` ``[n, Q, Hq, D]`` at the last ``Q`` of ``S`` positions, over
        ``keys``/``values`` ``[n, Hkv, S, D]`` (the fresh K/V, or the gathered history of a chunk after a
        cached prefix: one formula for both), as two batched matmuls per KV head with its query heads
        stacked along the rows. For bf16/fp16, where it beats the fused CPU kernel (docs/benchmarks.md);
        scores in the model dtype, softmax in float32, as in decode. ``bias``: ``_prefill_bias``."""
        n, length, num_heads, head_dim = q.shape
        num_kv_heads, total = keys.shape[1], keys.shape[2]
        group = num_heads // num_kv_heads
        grouped = q.view(n, length, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(n * num_kv_heads, group * length, head_dim) * scale
        keys_t = keys.transpose(-1, -2).reshape(n * num_kv_heads, head_dim, total)
        scores = torch.baddbmm(bias, grouped, keys_t)  # [n * Hkv, G * Q, S]
        out = torch.matmul(_softmax(scores).view(n, num_kv_heads, group * length, total), values)
        return out.view(n, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4).reshape(
            n, length, num_heads, head_dim)

    @staticmethod
    def _prefill_explicit(q, keys, values, scale: float, mask: torch.Tensor | None, softcap, sinks,
                          total: int) -> torch.Tensor:
        """Prompt chunks with soft-capped scores or sinks (``reference.attend``): ``q`` ``[n, Q, Hq, D]``,
        ``keys``/``values`` ``[n, Hkv, S, D]``, the query heads of a KV head stacked as its group."""
        n, length, num_heads, head_dim = q.shape
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        grouped = q.view(n, length, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [n, Hkv, G, Q, D]
        if mask is None:
            mask = torch.ones(length, total, dtype=torch.bool, device=q.device).tril_(total - length)
        sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1, 1)
        out = reference.attend(grouped, keys[:, :, None], values[:, :, None], mask, scale, softcap, sinks)
        return out.permute(0, 3, 1, 2, 4).reshape(n, length, num_heads, head_dim)

    @staticmethod
    def _gather_prefix(k_cache, v_cache, block_tables: torch.Tensor, first_block: int, length: int,
                       dtype: torch.dtype, kv_scales=(1.0, 1.0)):
        """K and V of cached tokens ``first_block * bs .. length`` of each table row: ``[n, Hkv, L, D]``."""
        _, num_kv_heads, bs, head_dim = k_cache.shape
        nblk = -(-length // bs) - first_block
        rows = _block_rows(block_tables[:, first_block: first_block + nblk], num_kv_heads)
        n = block_tables.shape[0]
        span = length - first_block * bs
        keys = k_cache.view(-1, bs, head_dim).index_select(0, rows).view(n, num_kv_heads, nblk * bs, head_dim)
        values = v_cache.view(-1, bs, head_dim).index_select(0, rows).view(n, num_kv_heads, nblk * bs, head_dim)
        return (dequantize_kv(keys[:, :, :span], dtype, kv_scales[0]),
                dequantize_kv(values[:, :, :span], dtype, kv_scales[1]))
