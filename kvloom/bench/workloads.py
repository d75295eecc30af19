"""Benchmark workloads: the requests a load test sends. Synthetic prompts are token ids over
/v1/completions (exact lengths) or words over /v1/chat/completions; a JSONL file gives real prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

# Words for chat prompts (the chat API takes text, not token ids); most are one token in common vocabularies.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


@dataclass
class BenchRequest:
    """One request: ``prompt`` (token ids or text) for /v1/completions, or ``messages`` for chat."""

    output_len: int
    prompt: list[int] | str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_len: int | None = None  # known only for token-id prompts

    def body(self, endpoint: str, model: str, ignore_eos: bool, extra: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": self.output_len, **extra}
        if ignore_eos:
            body["ignore_eos"] = True  # exact output lengths (vLLM, SGLang and kvloom take this extension)
        if endpoint == "chat":
            body["messages"] = self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]
        else:
            if self.prompt is None:
                raise ValueError("a chat-only prompt (messages) cannot go to /v1/completions: use --endpoint chat")
            body["prompt"] = self.prompt
        return body


def parse_range(text: str | int, name: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` -> (64, 256), both inclusive."""
    lo, _, hi = str(text).partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give N or LOW:HIGH with integers") from None
    if low < 1 or high < low:
        raise ValueError(f"{name}={text!r}: need 1 <= LOW <= HIGH")
    return low, high


@dataclass
class Workload:
    """Makes ``num_requests`` requests, the same ones for the same seed (so A/B runs compare like with like)."""

    kind: str = "random"  # random | shared-prefix | jsonl
    endpoint: str = "completions"  # completions | chat
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (32, 32)
    token_range: tuple[int, int] = (1000, 10000)  # token ids drawn from [low, high)
    prefix_len: int = 256
    num_prefixes: int = 1
    prompts_file: str | None = None
    seed: int = 0
    _file_rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def describe(self) -> dict[str, Any]:
        d = {"kind": self.kind, "endpoint": self.endpoint, "output_len": list(self.output_len), "seed": self.seed}
        if self.kind == "jsonl":
            d["prompts_file"] = self.prompts_file
        else:
            d["input_len"] = list(self.input_len)
            d["prompt_units"] = "token ids" if self.endpoint == "completions" else "words"
        if self.kind == "shared-prefix":
            d.update(prefix_len=self.prefix_len, num_prefixes=self.num_prefixes)
        return d

    def requests(self, num_requests: int) -> list[BenchRequest]:
        rng = random.Random(self.seed)
        if self.kind == "jsonl":
            return self._from_file(num_requests, rng)
        if self.kind not in ("random", "shared-prefix"):
            raise ValueError(f"workload {self.kind!r} is not one of random, shared-prefix, jsonl")
        prefixes = [self._units(rng, self.prefix_len) for _ in range(self.num_prefixes)] \
            if self.kind == "shared-prefix" else [[]]
        out = []
        for i in range(num_requests):
            prefix = prefixes[i % len(prefixes)]
            body = self._units(rng, rng.randint(*self.input_len))
            out_len = rng.randint(*self.output_len)
            if self.endpoint == "completions":
                out.append(BenchRequest(out_len, prompt=prefix + body, prompt_len=len(prefix) + len(body)))
            elif prefix:
                out.append(BenchRequest(out_len, messages=[{"role": "system", "content": " ".join(prefix)},
                                                           {"role": "user", "content": " ".join(body)}]))
            else:
                out.append(BenchRequest(out_len, prompt=" ".join(body)))
        return out

    def _units(self, rng: random.Random, n: int) -> list:
        if self.endpoint == "completions":
            return [rng.randrange(*self.token_range) for _ in range(n)]
        return [rng.choice(WORDS) for _ in range(n)]

    def _from_file(self, num_requests: int, rng: random.Random) -> list[BenchRequest]:
        """Lines ``{"prompt": ...}`` or ``{"messages": [...]}``, optionally with ``output_len`` (or
        ``max_tokens``); used in order, repeated when more requests are asked for than lines."""
        if not self._file_rows:
            if not self.prompts_file:
                raise ValueError("the jsonl workload needs --prompts-file FILE.jsonl")
            with open(self.prompts_file) as f:
                self._file_rows = [json.loads(line) for line in f if line.strip()]
            for i, row in enumerate(self._file_rows, 1):
                if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
                    raise ValueError(f"{self.prompts_file} line {i}: need a 'prompt' or 'messages' field")
            if not self._file_rows:
                raise ValueError(f"{self.prompts_file} has no prompts")
        out = []
        for i in range(num_requests):
            row = self._file_rows[i % len(self._file_rows)]
            out_len = int(row.get("output_len") or row.get("max_tokens") or rng.randint(*self.output_len))
            prompt = row.get("prompt")
            out.append(BenchRequest(out_len, prompt=prompt, messages=row.get("messages"),
                                    prompt_len=len(prompt) if isinstance(prompt, list) else None))
        return out
