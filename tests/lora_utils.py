"""Tiny PEFT adapters for the LoRA tests, and PEFT-on-transformers greedy references (float32)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

# Three adapters of different ranks and targets: a few attention and MLP modules; every module with
# rsLoRA and a per-module alpha; two modules at rank 2.
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True, alpha_pattern={"o_proj": 4},
              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"]),
}
MAX_RANK = 8


def make_adapter(base: Path, out: Path, seed: int, **spec) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (PEFT's default B of zeros would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec))
    peft_model.save_pretrained(str(out))
    return out


def make_adapters(base: Path, folder: Path, specs: dict = ADAPTERS) -> dict[str, str]:
    return {name: str(make_adapter(base, folder / f"adapter-{name}", 100 + i, **spec))
            for i, (name, spec) in enumerate(specs.items())}


def prompts(lengths=(5, 17, 33, 9, 40, 3, 20, 12), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(k)] for k in lengths]


def peft_greedy(base: Path, adapters: dict[str, str], prompts: list[list[int]], names: list[str | None],
                max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, under its adapter through PEFT (None: the base
    model), one prompt at a time, EOS ignored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    outs: list[list[int] | None] = [None] * len(prompts)
    for name in dict.fromkeys(names):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        with torch.no_grad():
            for i, (p, n) in enumerate(zip(prompts, names)):
                if n != name:
                    continue
                ids = torch.tensor([p])
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
                outs[i] = gen[0, len(p):].tolist()
    return outs
