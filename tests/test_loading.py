"""Model loading: sharded safetensors, dummy weights, GGUF metadata, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.config import ConfigError
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_sharded_safetensors_load_like_a_single_file(tmp_path, tiny_llama):
    sharded = make_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one = [o.token_ids for o in LLM(str(tiny_llama)).generate(PROMPTS, GREEDY, use_tqdm=False)]
    many = [o.token_ids for o in LLM(str(sharded)).generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert one == many


def test_dummy_weights_from_a_config_only_folder_are_deterministic(tmp_path, tiny_llama):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    a = LLM(str(folder), load_format="dummy", seed=3)
    assert a.tokenizer is None
    first = [o.token_ids for o in a.generate(PROMPTS, GREEDY, use_tqdm=False)]
    again = [o.token_ids for o in LLM(str(folder), load_format="dummy", seed=3).generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert first == again
    with pytest.raises(ValueError, match="has no tokenizer"):
        a.generate(["text needs a tokenizer"], GREEDY, use_tqdm=False)


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: .*LlamaForCausalLM"):
        LLM(str(folder), load_format="dummy")


def test_unknown_model_path_is_named():
    with pytest.raises(FileNotFoundError, match="model '/no/such/model' not found"):
        LLM("/no/such/model")


def test_max_model_len_over_the_model_limit_is_rejected(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds the model's max_position_embeddings=512"):
        LLM(str(tiny_llama), max_model_len=100000)


def test_gguf_metadata_becomes_a_llama_config(smollm2_path):
    from kvloom.core.model.loader import load_hf_config

    cfg = load_hf_config(smollm2_path)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.eos_token_id == 2
