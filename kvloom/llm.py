"""The offline batch API: ``LLM(...).generate(prompts, SamplingParams)`` and ``.chat(messages)``,
driving the engine core in this process with a progress bar."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from kvloom.builder import build_engine
from kvloom.core.config import DEFAULT_MODEL, OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from kvloom.core.engine.pooling import pooling_info
from kvloom.core.messages import AddRequest, PoolingParams, TokenLogprobs
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.output import CompletionText, fan_out
from kvloom.frontends.text import apply_chat_template, has_tokenizer, load_tokenizer
from kvloom.frontends.validation import ModelLimits, validate_pooling, validate_request

logger = logging.getLogger("kvloom")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # why the engine ended it, when finish_reason is "error"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, over every completion
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    prompt_logprobs: list[TokenLogprobs] | None = None  # sampling.prompt_logprobs: prompt tokens 1.. scored

    # The first (usually only) completion, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class EmbeddingOutput:
    """One input's pooled vector (``LLM.embed``)."""

    prompt_token_ids: list[int]
    embedding: list[float]


class LLM:
    """Offline generation over a batch of prompts with continuous batching. Options are
    ``EngineConfig`` fields; ``max_num_batched_tokens`` defaults to 4096 here (2048 when serving)."""

    def __init__(self, model: str = DEFAULT_MODEL, *, config: EngineConfig | None = None, **options: Any) -> None:
        if config is None:
            options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = config or EngineConfig(model=model, **options)
        self.engine = build_engine(self.config)
        # Without a tokenizer (a config-only folder for dummy weights) prompts must be token ids.
        self.tokenizer = (load_tokenizer(self.config.model, self.config.tokenizer)
                          if self.config.tokenizer or has_tokenizer(self.config.model) else None)
        self._ids = itertools.count()
        # Requests are checked as the HTTP server and the gateway check them (validation.py): same limits,
        # same messages, raised as ValueError.
        pooling = self.engine.pooling_config
        self.limits = ModelLimits(self.engine.max_model_len, self.engine.vocab_size, self.engine.task,
                                  pooling_info(pooling, self.engine.hf_config.hidden_size) if pooling else None,
                                  self.config.model)

    def generate(
        self,
        prompts: str | dict | Sequence[str] | Sequence[list[int]] | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``).
        Outputs come back in the order of ``prompts``.
        ``priority`` (one for all, or one per prompt; lower runs first) matters under the ``priority``
        scheduler plugin. ``lora`` names the LoRA adapter to run with (one for all, or one per prompt;
        None: the base model), among those loaded (``lora_modules``, ``load_lora_adapter``)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        encoded = []
        for p in prompts:
            if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                p = _prompt_of(p)
            if isinstance(p, str):
                encoded.append((p, self._require_tokenizer().encode(p, add_special_tokens=True)))
            else:
                encoded.append((None, list(p)))
        return self._run(encoded, sampling_params, use_tqdm, priority, lora)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        priority: int | Sequence[int] = 0,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several, through the model's
        chat template. ``priority`` and ``lora`` are as for ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conv in conversations:
            ids = apply_chat_template(self._require_tokenizer(), list(conv), add_generation_prompt)
            encoded.append((self.tokenizer.decode(ids), ids))
        return self._run(encoded, sampling_params, use_tqdm, priority, lora)

    def stream_chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None
                    ) -> Iterator[str]:
        """Answer one conversation, yielding the reply's text as it is generated (``engine chat``).
        Closing the iterator early (or an interrupt while it runs) aborts the request in the engine."""
        sp = sampling_params or SamplingParams()
        if sp.n != 1:
            raise ValueError(f"stream_chat makes one reply; got n={sp.n}")
        ids = apply_chat_template(self._require_tokenizer(), list(messages))
        sp = validate_request(ids, sp, self.limits, prompt_param="messages").sampling
        rid = str(next(self._ids))
        self.engine.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, sampling=sp, arrival_time=time.time()))
        completion = CompletionText(self.tokenizer, sp, len(ids))
        finished = False
        try:
            while completion.finish_reason is None:
                for delta in self.engine.step():
                    if delta.request_id != rid:
                        continue
                    finished = delta.finish_reason is not None
                    out = completion.add(delta)
                    if out is not None and out.text:
                        yield out.text
        finally:
            if not finished:  # a stop string, a closed iterator or Ctrl-C: nothing may keep running
                self.engine.abort_requests([rid])
            self.engine.flush()

    def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[list[int]], *,
              dimensions: int | None = None, normalize: bool | None = None,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """Each input's embedding (text or token ids), pooled as the model's sentence-transformers config
        says; ``dimensions`` truncates (Matryoshka models), ``normalize`` overrides the config's. Inputs
        are checked as /v1/embeddings checks them (ValueError naming the field and the limit)."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        prompts = [self._require_tokenizer().encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
                   for p in inputs]
        prepared = validate_pooling(prompts, self.limits, PoolingParams(dimensions=dimensions, normalize=normalize))
        rids = [str(next(self._ids)) for _ in prepared]
        vectors: dict[str, list[float]] = {}
        try:
            for rid, p in zip(rids, prepared):
                self.engine.add_request(AddRequest(request_id=rid, prompt_token_ids=p.prompt_token_ids,
                                                   sampling=p.sampling, arrival_time=time.time(), pooling=p.pooling))
            with tqdm(total=len(rids), desc="Embedding", unit="req", disable=not use_tqdm) as bar:
                while len(vectors) < len(rids):
                    for delta in self.engine.step():
                        if delta.finish_reason == "error":
                            raise ValueError(f"input {rids.index(delta.request_id)}: {delta.error}")
                        if delta.embedding is not None:
                            vectors[delta.request_id] = delta.embedding
                            bar.update(1)
        finally:
            if len(vectors) < len(rids):
                self.engine.abort_requests([r for r in rids if r not in vectors])
            self.engine.flush()
        return [EmbeddingOutput(p.prompt_token_ids, vectors[rid]) for rid, p in zip(rids, prepared)]

    # --- LoRA adapters -------------------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> dict:
        """Serve the PEFT adapter folder ``path`` as ``name`` (needs ``enable_lora=True``)."""
        return self.engine.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> dict:
        return self.engine.unload_lora_adapter(name)

    def list_lora_adapters(self) -> list[dict]:
        return self.engine.list_lora_adapters()

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer: give prompts as token ids "
                             "or pass tokenizer=PATH")
        return self.tokenizer

    # ---------------------------------------------------------------------------------------------
    def _run(self, encoded, sampling_params, use_tqdm: bool, priority: int | Sequence[int],
             lora: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _per_prompt(sampling_params, len(encoded), "SamplingParams")
        priorities = _per_prompt(priority, len(encoded), "priorities")
        one = lora is None or isinstance(lora, str)
        adapters = [lora] * len(encoded) if one else _per_prompt(lora, len(encoded), "lora names")
        if self.tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        engine = self.engine
        results: list[RequestOutput] = []
        states: dict[str, tuple[RequestOutput, CompletionOutput, CompletionText]] = {}
        admitted: list[str] = []
        try:
            # Admit everything first, so a bad prompt fails the call before any work is done.
            for (text, ids), sp, prio, adapter in zip(encoded, params, priorities, adapters):
                out = RequestOutput(str(next(self._ids)), text, ids, [])
                for i, choice in enumerate(fan_out(sp, sp.n)):
                    rid = out.request_id if sp.n == 1 else f"{out.request_id}-{i}"
                    choice = validate_request(ids, choice, self.limits, priority=prio).sampling
                    engine.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, sampling=choice,
                                                  priority=prio, arrival_time=out.metrics.arrival_time,
                                                  lora_name=adapter or ""))
                    admitted.append(rid)
                    comp = CompletionOutput(i, "", [], None, logprobs=[] if sp.logprobs is not None else None)
                    out.outputs.append(comp)
                    states[rid] = (out, comp, CompletionText(self.tokenizer, choice, len(ids)))
                results.append(out)
        except Exception:
            engine.abort_requests(admitted)
            raise

        total = len(states)
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while states:
                deltas = engine.step()
                now = time.time()  # the step's tokens all arrived now
                for delta in deltas:
                    state = states.get(delta.request_id)
                    if state is None:
                        continue  # the last step of a request a stop string ended
                    out, comp, completion = state
                    if out.metrics.first_token_time is None and delta.new_token_ids:
                        out.metrics.first_token_time = now
                    piece = completion.add(delta)
                    if piece is None:
                        continue
                    comp.text += piece.text
                    comp.token_ids.extend(piece.token_ids)
                    if piece.logprobs and comp.logprobs is not None:
                        comp.logprobs.extend(piece.logprobs)
                    if piece.prompt_logprobs:
                        out.prompt_logprobs = piece.prompt_logprobs
                    if piece.finish_reason is None:
                        continue
                    if completion.stopped_early:
                        engine.abort_requests([delta.request_id])
                    comp.finish_reason = piece.finish_reason
                    comp.stop_reason = piece.stop_reason
                    if delta.finish_reason == "error":
                        # The engine refused or failed it (e.g. a grammar that does not compile): say why,
                        # on the output and in the log, instead of an empty completion with no reason.
                        comp.error = delta.error
                        logger.warning("Request %s ended with an error: %s", delta.request_id, delta.error)
                    out.num_cached_tokens = delta.num_cached_tokens
                    out.metrics.num_draft_tokens += delta.num_draft_tokens
                    out.metrics.num_accepted_tokens += delta.num_accepted_tokens
                    del states[delta.request_id]
                    if all(c.finish_reason for c in out.outputs):
                        out.metrics.finish_time = now
                    bar.update(1)
        finally:
            bar.close()
            if states:  # interrupted: leave nothing running in the engine
                engine.abort_requests(list(states))
            engine.flush()  # a step may still be in flight for requests that have finished
        return results


def _per_prompt(value: Any, n: int, what: str) -> list:
    """One value per prompt from a single value or a sequence of them."""
    values = list(value) if isinstance(value, Sequence) else [value] * n
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts")
    return values


def _prompt_of(p: dict) -> str | list[int]:
    """The text or token ids of a vLLM-style prompt dict; other keys (multimodal data, ...) are refused by name."""
    extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if extra:
        raise ValueError(f"prompt keys {extra} are not supported; give 'prompt' (text) or 'prompt_token_ids'")
    if "prompt_token_ids" in p:
        return list(p["prompt_token_ids"])
    if "prompt" in p:
        return p["prompt"]
    raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
