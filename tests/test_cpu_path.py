"""The CPU-specific pieces against the plain references: the head-major attention backend, the packed
linear layers, the per-step rotary tables, the malloc settings and the CPU's default dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.core.model.attention.base import AttentionMetadata, TorchAttentionBackend
from kvloom.core.model.attention.cpu import CPUAttentionBackend, paged_kernel_serves
from kvloom.core.model.cpu_packing import pack_linear_layers
from kvloom.kernels import cpu_attention
from kvloom.kernels import reference as ref
from kvloom.kernels.cpu_linear import PackedLinear, packing_supported

BS, HKV, GROUP, D = 4, 2, 3, 16


def _step(query_lens, seq_lens, num_blocks=40, seed=0):
    """Random block tables and metadata for one step (decodes first, as the runner orders them)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, offset = [], [], 0
    for q_len, s_len in zip(query_lens, seq_lens):
        n = -(-s_len // BS)
        blocks, offset = perm[offset: offset + n], offset + n
        tables.append(blocks)
        slots += [blocks[p // BS] * BS + p % BS for p in range(s_len - q_len, s_len)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                                     dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        num_decodes=sum(1 for q in query_lens if q == 1), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1], [5, 9, 13]),  # decodes only
    ([7, 7, 3], [7, 7, 3]),  # fresh prompts, two of equal length (batched together)
    ([1, 1, 6, 4], [9, 2, 6, 11]),  # decodes, a fresh prompt, a chunk over a cached prefix
    ([5, 5], [5, 5]),  # one group of prompts that is the whole batch (its result is the output)
    ([1, 6, 4, 6], [9, 6, 11, 6]),  # two equal prompts that are not adjacent in the batch
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [
    {}, {"window": 5}, {"window": 3, "softcap": 5.0}, {"sinks": True}, {"window": 6, "softcap": 2.0, "sinks": True},
], ids=["full", "window", "window-softcap", "sinks", "window-softcap-sinks"])
@pytest.mark.parametrize("paged", [True, False], ids=["in-place", "gathered"])
def test_cpu_backend_matches_the_reference_layout(query_lens, seq_lens, dtype, variant, paged, monkeypatch):
    """Two layers over the same step: the head-major backend and the reference backend see the same
    K/V history (written in their own layouts) and must give the same outputs, with each layer variant
    (windows narrower than the sequences, soft-capped scores, sinks), the decode rows read in place
    (``kvloom.kernels.cpu_attention``) or gathered."""
    monkeypatch.setenv("KVLOOM_CPU_PAGED_DECODE", "1" if paged else "0")
    assert paged_kernel_serves(torch.zeros(1, HKV, BS, D, dtype=dtype), HKV * GROUP) == (
        paged and cpu_attention.available())
    num_blocks = 40
    gen = torch.Generator().manual_seed(1)
    history = {}  # the K/V both caches hold before the step, keyed by slot
    cpu, reference = CPUAttentionBackend(), TorchAttentionBackend()
    caches = {
        "cpu": [tuple(torch.zeros(cpu.kv_cache_shape(num_blocks, BS, HKV, D), dtype=dtype) for _ in range(2))
                for _ in range(2)],
        "ref": [tuple(torch.zeros(reference.kv_cache_shape(num_blocks, BS, HKV, D), dtype=dtype) for _ in range(2))
                for _ in range(2)],
    }
    meta_of = {"cpu": _step(query_lens, seq_lens), "ref": _step(query_lens, seq_lens)}
    meta = meta_of["ref"]
    # cached prefix: every position before the step's queries, in both layouts
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for p in range(s_len - q_len):
            block = int(meta.block_tables[b, p // BS])
            history[(block, p % BS)] = [torch.randn(2, HKV, D, generator=gen).to(dtype) for _ in range(2)]
    for layer in range(2):
        for (block, off), kvs in history.items():
            k, v = kvs[layer]
            for name, (kc, vc) in (("cpu", caches["cpu"][layer]), ("ref", caches["ref"][layer])):
                if name == "cpu":
                    kc[block, :, off], vc[block, :, off] = k, v
                else:
                    kc[block, off], vc[block, off] = k, v
    total = sum(query_lens)
    variant = dict(variant)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(HKV * GROUP, generator=gen)
    for layer in range(2):
        q = torch.randn(total, HKV * GROUP, D, generator=gen).to(dtype)
        k = torch.randn(total, HKV, D, generator=gen).to(dtype)
        v = torch.randn(total, HKV, D, generator=gen).to(dtype)
        got = cpu.forward(q, k, v, caches["cpu"][layer], meta_of["cpu"], D**-0.5, **variant)
        want = reference.forward(q, k, v, caches["ref"][layer], meta_of["ref"], D**-0.5, **variant)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        # the new K/V landed at the same (block, offset) in both layouts
        torch.testing.assert_close(caches["cpu"][layer][0].transpose(1, 2), caches["ref"][layer][0], atol=0, rtol=0)
    assert meta_of["cpu"].backend_data is not None  # built once at the first layer, reused by the second


@pytest.mark.skipif(not packing_supported(torch.float32), reason="this PyTorch build has no oneDNN packed linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33, 100])
def test_packed_linear_matches_f_linear(dtype, rows):
    if not packing_supported(dtype):
        pytest.skip(f"no oneDNN packed linear for {dtype} here")
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40, dtype=dtype), torch.randn(48, dtype=dtype)
    x = torch.randn(rows, 40, dtype=dtype)
    packed = PackedLinear(weight, bias, batch_hint=32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed(x).float(), F.linear(x, weight, bias).float(), atol=tol, rtol=tol)
    # 3-D inputs and strided views run too
    x3 = torch.randn(2, rows, 80, dtype=dtype)[..., ::2]
    torch.testing.assert_close(packed(x3).float(), F.linear(x3, weight, bias).float(), atol=tol, rtol=tol)


_SHAPES_SCRIPT = """
import random, torch
from kvloom.core.worker.cpu_malloc import keep_freed_memory
keep_freed_memory()
from kvloom.kernels.cpu_linear import PackedLinear

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

layer = PackedLinear(torch.randn(1536, 576) * 0.02, None, 32)
with torch.no_grad():
    layer(torch.randn(17, 576))
    start = rss_mb()
    for rows in random.Random(0).sample(range(17, 1025), 200):
        layer(torch.randn(rows, 576))
print(rss_mb() - start)
"""


@pytest.mark.skipif(not packing_supported(torch.float32), reason="this PyTorch build has no oneDNN packed linear")
def test_packed_linears_meet_few_shapes_so_the_engine_does_not_grow_with_every_step_size():
    import subprocess
    import sys

    from tests.server_utils import REPO_ROOT, server_env

    # 200 different row counts, as a server's steps bring them: oneDNN kept a primitive and its memory per
    # count (+160 to +167 MB); rounded to ~40 shapes they stay few (+28 to +43 MB, 84 once beside a busy core).
    out = subprocess.run([sys.executable, "-c", _SHAPES_SCRIPT], env=server_env(), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 110


_ATTENTION_SHAPES_SCRIPT = """
from kvloom.core.worker.cpu_threads import prepare_openmp
prepare_openmp()  # as the engine process does, before torch loads
import random, torch
from kvloom.core.worker.cpu_malloc import keep_freed_memory, release_free_memory
keep_freed_memory()

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

rng = random.Random(0)
q = torch.randn(3, 8, 64, dtype=torch.bfloat16)
q @ q.transpose(1, 2)
start = rss_mb()
for _ in range(1200):  # attention's batched matmuls, a new (queries, keys) shape every time
    queries, keys = rng.randint(1, 600), rng.randint(1, 600)
    scores = torch.randn(3, queries, 64, dtype=torch.bfloat16) @ torch.randn(3, 64, keys, dtype=torch.bfloat16)
    scores @ torch.randn(3, keys, 64, dtype=torch.bfloat16)
release_free_memory()  # as the engine does every minute
print(rss_mb() - start)
"""


def test_the_engine_does_not_keep_memory_for_every_attention_shape_it_met():
    import subprocess
    import sys

    from tests.server_utils import REPO_ROOT, server_env

    # oneDNN's and ideep's caches kept an entry per bf16 matmul shape, 1,024 each: +932 MB here, and a
    # serving engine meets new attention shapes every step. Capped (prepare_openmp: +253 MB) and with
    # the heap's free pages given back (+150 MB), the growth stops within a few hundred MB.
    env = {k: v for k, v in server_env().items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _ATTENTION_SHAPES_SCRIPT], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 300


def test_padded_rows_are_few_and_close():
    from kvloom.kernels.cpu_linear import padded_rows

    counts = range(1, 8193)
    assert all(rows <= padded_rows(rows) <= rows * 1.125 or padded_rows(rows) - rows < 8 for rows in counts)
    assert [padded_rows(rows) for rows in (1, 16, 17, 64, 65, 128, 129, 2048, 2049)] == \
        [1, 16, 24, 64, 72, 128, 144, 2048, 2304]
    assert len({padded_rows(rows) for rows in counts}) < 100


@pytest.mark.skipif(not packing_supported(torch.float32), reason="this PyTorch build has no oneDNN packed linear")
def test_packing_replaces_every_linear_and_ties_the_output(tiny_llama):
    from kvloom.core.model.loader import build_model, load_hf_config

    config = load_hf_config(tiny_llama)
    common = dict(load_format="safetensors", device=torch.device("cpu"), dtype=torch.float32,
                  backend=CPUAttentionBackend(), max_positions=64)
    plain = build_model(tiny_llama, config, pack_cpu_weights=False, **common)
    packed = build_model(tiny_llama, config, **common)
    # Packing is a step after loading of every dense layer: each holds its weight packed, none plain.
    layers = packed.linear_layers()
    assert len(layers) == len(plain.linear_layers()) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down; lm_head
    assert all(isinstance(layer.packed, PackedLinear) and "weight" not in layer._parameters for layer in layers)
    assert all(isinstance(layer.weight, torch.nn.Parameter) for layer in plain.linear_layers())
    h = torch.randn(5, config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(h), plain.compute_logits(h), atol=1e-5, rtol=1e-5)
    assert pack_linear_layers(packed) == 0  # nothing left to pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_match_the_oracle(dtype):
    torch.manual_seed(0)
    cache = torch.randn(50, D)
    positions = torch.randint(0, 50, (9,))
    q, k = torch.randn(9, 6, D, dtype=dtype), torch.randn(9, 2, D, dtype=dtype)
    # transformers' formula, written out: x * cos + rotate_half(x) * sin, in float32
    half = D // 2
    cs = cache[positions]
    cos, sin = cs[:, :half].repeat(1, 2)[:, None], cs[:, half:].repeat(1, 2)[:, None]

    def rotate_half(x):
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    want = [(x.float() * cos + rotate_half(x.float()) * sin).to(dtype) for x in (q, k)]
    got = ref.apply_rotary(ref.rotary_tables(positions, cache, dtype), q, k)
    assert all(torch.equal(a, b) for a, b in zip(ref.rotary_embedding(positions, q, k, cache), want))  # the oracle
    for g, w in zip(got, want):
        if dtype == torch.float32:
            assert torch.equal(g, w)  # bit-identical: transformers' parity rests on it
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_in_the_model_dtype_is_float32_softmax_rounded_once(dtype):
    from kvloom.core.model.attention.cpu import _softmax

    scores = (torch.randn(4, 3, 40, 70, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    scores[..., -9:] = float("-inf")  # masked keys, as the causal and padding biases make them
    assert torch.equal(_softmax(scores), torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_of_adjacent_q_k_views_is_the_separate_rotation(dtype):
    """q and k cut from one fused qkv output are rotated as one tensor: the same bits as rotating each."""
    torch.manual_seed(0)
    cache, positions = torch.randn(50, D), torch.randint(0, 50, (9,))
    q, k, _ = torch.randn(9, (6 + 2 + 2) * D, dtype=dtype).split([6 * D, 2 * D, 2 * D], dim=-1)
    q, k = q.reshape(9, 6, D), k.reshape(9, 2, D)
    assert ref._adjacent_heads(q, k) and not ref._adjacent_heads(q.contiguous(), k.contiguous())
    tables = ref.rotary_tables(positions, cache, dtype)
    joint, separate = ref.apply_rotary(tables, q, k), ref.apply_rotary(tables, q.contiguous(), k.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(joint, separate))


def test_kept_rows_give_the_same_hidden_states(tiny_llama):
    """``keep`` (the rows a step samples from) skips the last layer's MLP for the other rows only."""
    from kvloom.core.model.loader import build_model, load_hf_config

    config = load_hf_config(tiny_llama)
    backend = CPUAttentionBackend()
    model = build_model(tiny_llama, config, load_format="safetensors", device=torch.device("cpu"),
                        dtype=torch.float32, backend=backend, max_positions=64)
    query_lens = [1, 6, 4]
    seq_lens = [9, 6, 11]
    heads = model.num_kv_heads
    total, rows = sum(query_lens), torch.tensor([0, 6, 10])
    ids = torch.randint(0, config.vocab_size, (total,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    outs = []
    for keep in (None, rows):
        caches = [tuple(torch.zeros(backend.kv_cache_shape(40, BS, heads, model.head_dim)) for _ in range(2))
                  for _ in model.layers]
        with torch.inference_mode():
            outs.append(model(ids, positions, _step(query_lens, seq_lens), caches, keep=keep))
    assert outs[1].shape[0] == len(rows)
    torch.testing.assert_close(outs[1], outs[0][rows], atol=1e-5, rtol=1e-5)


def test_malloc_settings_are_applied_once():
    from kvloom.core.worker import cpu_malloc

    first = cpu_malloc.keep_freed_memory()
    assert cpu_malloc.keep_freed_memory() == first
    import platform

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first is True


def test_auto_dtype_follows_the_checkpoint_on_cpu(tiny_llama):
    from kvloom.core.engine.core import resolve_dtype
    from kvloom.core.model.loader import load_hf_config
    from kvloom.kernels.cpu_linear import cpu_has_native_bf16

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, load_hf_config(tiny_llama)) == torch.float32  # a float32 checkpoint
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", cpu, load_hf_config(tiny_llama, {"dtype": "bfloat16"})) == native
    assert resolve_dtype("float32", cpu, None) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), None) == torch.bfloat16


def test_offline_llm_takes_a_larger_step_budget_than_the_server(tiny_llama):
    from kvloom import LLM
    from kvloom.core.config import EngineConfig
    from kvloom.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

    assert EngineConfig().max_num_batched_tokens < OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert LLM(str(tiny_llama)).engine.config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert LLM(str(tiny_llama), max_num_batched_tokens=64).engine.config.max_num_batched_tokens == 64
    assert LLM(config=EngineConfig(model=str(tiny_llama))).engine.config.max_num_batched_tokens == \
        EngineConfig().max_num_batched_tokens  # an explicit config is taken as given


def test_window_reads_no_block_before_it():
    """The CPU backend gathers only the blocks a sliding layer's window covers: blocks wholly before it, filled
    with NaN, leave decode rows and a chunk over a cached prefix exactly as the reference computes them on
    clean caches (a sliding layer can so give those blocks back while its request runs)."""
    window = 6
    query_lens, seq_lens = [1, 1, 5], [23, 9, 30]
    meta_cpu, meta_ref = _step(query_lens, seq_lens), _step(query_lens, seq_lens)
    cpu, reference = CPUAttentionBackend(), TorchAttentionBackend()
    gen = torch.Generator().manual_seed(2)
    k_ref = torch.randn(40, BS, HKV, D, generator=gen)
    v_ref = torch.randn(40, BS, HKV, D, generator=gen)
    k_cpu, v_cpu = k_ref.transpose(1, 2).contiguous(), v_ref.transpose(1, 2).contiguous()
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        first = max(0, s_len - q_len - window + 1) // BS  # the first block the window of its first query covers
        for blk in meta_cpu.block_tables[b, :first].tolist():
            k_cpu[blk], v_cpu[blk] = float("nan"), float("nan")
    q = torch.randn(7, HKV * GROUP, D, generator=gen)
    k = torch.randn(7, HKV, D, generator=gen)
    v = torch.randn(7, HKV, D, generator=gen)
    got = cpu.forward(q, k, v, (k_cpu, v_cpu), meta_cpu, D**-0.5, window=window)
    want = reference.forward(q, k, v, (k_ref, v_ref), meta_ref, D**-0.5, window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
