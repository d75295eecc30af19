"""Regexes compiled as one automaton (xgrammar's ``Regex("...")`` rule) allow exactly what
``compile_regex``'s grammar expansion allows: the same mask at every step of random walks through
each language, on a small byte-level vocabulary; constructs the automaton is not trusted with keep
``compile_regex``."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom.core.engine.structured_output import regex_automaton_grammar

REGEXES = [
    r"([A-Z][a-z]{2,9} [0-9]{1,4}(, )?)+",  # benchmarks/structured_output.py's
    r"[a-z]{3,8}-\d{2}",
    r"\d{3}-\d{4}",
    r"[1-9][0-9]?",
    r"a{0,3}b{1,}c?",
    r"(ab|cd)*e",
    r"[^a-c\s]{2,5}\.",
    r"\w+\s\S{1,3}",
    r"x.y",
    r'caf\u00e9|na\u00efve|"q"|\\',
    r"(the|quick|brown|fox)( (the|quick|brown|fox)){0,4}",
    "(東京|🚀){1,3}!",
]


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    import xgrammar
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=384, stop_token_ids=[2])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _allowed(mask: torch.Tensor) -> list[int]:
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return [t for t in bits.flatten().nonzero()[:, 0].tolist() if t < 384]


@pytest.mark.parametrize("pattern", REGEXES)
def test_the_automaton_allows_what_compile_regex_allows(compiler, pattern):
    import xgrammar

    automaton = regex_automaton_grammar(pattern)
    assert automaton is not None
    reference, fast = compiler.compile_regex(pattern), compiler.compile_grammar(automaton)
    masks = [xgrammar.allocate_token_bitmask(1, 384) for _ in range(2)]
    steps = 0
    for seed in range(6):
        rng = random.Random(seed)
        a, b = xgrammar.GrammarMatcher(reference), xgrammar.GrammarMatcher(fast)
        for _ in range(30):
            a.fill_next_token_bitmask(masks[0])
            b.fill_next_token_bitmask(masks[1])
            assert torch.equal(masks[0], masks[1]), (pattern, seed, steps)
            steps += 1
            allowed = _allowed(masks[0])
            # Walk on ordinary tokens while there are any (the stop token ends the walk).
            token = rng.choice([t for t in allowed if t != 2] or allowed)
            assert a.accept_token(token) and b.accept_token(token)
            if a.is_terminated():
                break
    assert steps > 12  # the walks went past the first mask


@pytest.mark.parametrize("pattern", [r"^ab$", r"(?=a)a", r"(?:ab)+", r"a*?b", r"(a)\1", r"\bfoo", r"(?i)ab", "(("])
def test_constructs_the_automaton_is_not_trusted_with_keep_compile_regex(pattern):
    assert regex_automaton_grammar(pattern) is None
