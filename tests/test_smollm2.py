"""The real default model, SmolLM2-135M-Instruct, from its GGUF file: logits against transformers
reading the same file, and a chat answer."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the default model


def test_logprobs_match_transformers_on_the_same_gguf(llm, smollm2_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                              dtype=torch.float32).eval()
    prompts = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=24, logprobs=20, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(ids, outs):
        full = torch.tensor([p + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for step, lp in enumerate(out.outputs[0].logprobs):
            row = ref[len(p) - 1 + step]
            assert out.token_ids[step] == int(row.argmax())  # greedy agrees at every step
            for top in lp.top:
                assert abs(top.logprob - float(row[top.token_id])) < 2e-3, (step, top)


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
