"""The pooling routes: /v1/embeddings (OpenAI's shape, vLLM's extensions) for embedding models, and
/v1/score and /v1/rerank (vLLM's, Jina's and Cohere's shapes) for yes/no rerankers. Each input is one
prefill-only engine request; they go through the same keys, quotas, admission and metrics as generation."""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from msgspec import Struct
from starlette.requests import Request

from kvloom.core.messages import PoolingParams
from kvloom.frontends.access_log import note_prompt_tokens
from kvloom.frontends.admission import check_timeout, replace_prepared
from kvloom.frontends.asgi import cancel_on_disconnect, json_response
from kvloom.frontends.errors import RequestError
from kvloom.frontends.frontend_core import FrontendCore
from kvloom.frontends.openai_requests import split_prompts, truncate_prompt
from kvloom.frontends.validation import PreparedRequest, check_task, validate_pooling

if TYPE_CHECKING:
    from kvloom.frontends.api_server import OpenAIServer


class _PoolingRequest(Struct, kw_only=True):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last N tokens of each input (-1: max_model_len)
    truncation_side: str | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    timeout: float | None = None  # seconds; may shorten the server's request_timeout (docs/admission.md)


class EmbeddingRequest(_PoolingRequest):
    input: Any  # a string, a list of strings, a list of token ids or a list of such lists
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's: None normalizes as the model's sentence-transformers config says


class ScoreRequest(_PoolingRequest):
    """vLLM's /v1/score: each of ``text_2`` scored against ``text_1`` (one, or one per ``text_2``);
    ``queries``/``documents`` are the newer names of the same."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    instruction: str | None = None  # the reranker prompt's task line (the model's default when left out)


class RerankRequest(_PoolingRequest):
    """Jina's and Cohere's /rerank (vLLM serves it at /rerank, /v1/rerank and /v2/rerank)."""

    query: str
    documents: list[str | dict[str, Any]]  # strings, or Cohere's/Jina's {"text": ...} objects
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None


# Fields of vLLM's pooling requests kvloom does not serve: a 400 naming them, never silently ignored.
POOLING_RULES = {
    "messages": ("chat-style embedding input is not served: give the text as input", lambda v, b: v is None),
    "mm_processor_kwargs": ("multimodal inputs are not served", lambda v, b: not v),
    "embed_dtype": ("embeddings are float32", lambda v, b: v in (None, "float32")),
}

# Qwen3-Reranker's prompt, as its model card gives it: the model answers "yes" or "no" after it.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                 "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                 "<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt(query: str, document: str, instruction: str | None) -> str:
    return (f"{RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{RERANK_SUFFIX}")


def score_token_ids(tokenizer) -> list[int]:
    """The ids of ``no`` and ``yes``, whose logits a yes/no reranker's score is the softmax of."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("no", "yes")]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise RequestError(400, "this model's vocabulary has no single 'yes' and 'no' tokens to score with", "model")
    return ids


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # float32, little-endian: what the openai client decodes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def routes(server: "OpenAIServer") -> list:
    async def resolve(request: Request, req: _PoolingRequest) -> FrontendCore:
        await server.note_request(request, req.model, req.timeout)
        if request.state.lora:
            raise RequestError(400, f"model={req.model!r} names a LoRA adapter; pooling runs on served models only",
                               "model")
        return request.state.core

    async def tokenize(core: FrontendCore, req: _PoolingRequest, text: str | list[int], param: str) -> list[int]:
        truncating = req.truncate_prompt_tokens is not None
        ids = core.check_token_ids(text, param) if isinstance(text, list) else await core.tokenize_text(
            text, param, add_special_tokens=req.add_special_tokens, truncated=truncating)
        return truncate_prompt(ids, req, core.max_model_len)

    async def run(request: Request, core: FrontendCore, prepared: list[PreparedRequest]) -> list:
        """Admission (slots, keys, timeout), the engine, metrics: the path generation takes, without text."""
        key, given = request.state.api_key, request.state.timeout
        timeout = check_timeout(given, server.config.request_timeout)
        prepared = [replace_prepared(p, key, timeout, given is not None) for p in prepared]
        admission = core.admit(len(prepared))
        lengths = [len(p.prompt_token_ids) for p in prepared]
        model = request.state.model
        server.metrics.count_prompt_tokens(sum(lengths), model)
        started = time.monotonic()
        try:
            deltas = await cancel_on_disconnect(request.receive, core.pool_many(prepared))
        finally:
            admission.release()
        server.metrics.count_pooled(lengths, time.monotonic() - started, key.name if key else None, model)
        note_prompt_tokens(request.scope, sum(lengths))
        return deltas

    async def embeddings(request: Request):
        req: EmbeddingRequest = await server._parse(request, EmbeddingRequest, POOLING_RULES)
        core = await resolve(request, req)
        try:
            texts = split_prompts(req.input) if isinstance(req.input, (str, list)) and req.input else None
        except RequestError:
            texts = None
        if texts is None:
            raise RequestError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids, and not empty", "input")
        prompts = [await tokenize(core, req, t, "input") for t in texts]
        prepared = validate_pooling(prompts, core.limits, PoolingParams(dimensions=req.dimensions,
                                                                        normalize=req.normalize),
                                    encoding_format=req.encoding_format, priority=req.priority)
        deltas = await run(request, core, prepared)
        tokens = sum(len(p) for p in prompts)
        return json_response({
            "id": server._request_id(request, "embd", req.request_id), "object": "list",
            "created": int(time.time()), "model": request.state.model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_embedding(d.embedding, req.encoding_format)} for i, d in enumerate(deltas)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }, headers={"x-request-id": server._request_id(request, "embd", req.request_id)})

    async def score_pairs(request: Request, req: _PoolingRequest, queries: list[str], documents: list[str],
                          instruction: str | None) -> tuple[list[float], int]:
        core = await resolve(request, req)
        check_task(core.limits, "score")
        ids = score_token_ids(core.tokenizer)
        prompts = [await tokenize(core, req, rerank_prompt(q, d, instruction), "documents")
                   for q, d in zip(queries, documents)]
        prepared = validate_pooling(prompts, core.limits, PoolingParams(task="score", score_token_ids=ids),
                                    priority=req.priority, input_param="documents")
        deltas = await run(request, core, prepared)
        return [d.embedding[-1] for d in deltas], sum(len(p) for p in prompts)

    async def score(request: Request):
        req: ScoreRequest = await server._parse(request, ScoreRequest, POOLING_RULES)
        first = req.text_1 if req.text_1 is not None else req.queries
        second = req.text_2 if req.text_2 is not None else req.documents
        if first is None or second is None:
            raise RequestError(400, "give text_1 and text_2 (or queries and documents)",
                               "text_1" if first is None else "text_2")
        first = [first] if isinstance(first, str) else first
        second = [second] if isinstance(second, str) else second
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise RequestError(400, f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or "
                               "one per text_2", "text_1")
        scores, tokens = await score_pairs(request, req, first, second, req.instruction)
        return json_response({
            "id": server._request_id(request, "score", req.request_id), "object": "list",
            "created": int(time.time()), "model": request.state.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    async def rerank(request: Request):
        req: RerankRequest = await server._parse(request, RerankRequest, POOLING_RULES)
        if req.top_n is not None and req.top_n < 0:
            raise RequestError(400, f"top_n={req.top_n} must be >= 0", "top_n")
        texts = [d if isinstance(d, str) else d.get("text") for d in req.documents]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise RequestError(400, f"documents[{bad}] must be a string or an object with a \"text\" string",
                               "documents")
        scores, tokens = await score_pairs(request, req, [req.query] * len(texts), texts, req.instruction)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in order]
        return json_response({"id": server._request_id(request, "rerank", req.request_id),
                              "model": request.state.model, "usage": {"total_tokens": tokens}, "results": results})

    return [server.route("/v1/embeddings", embeddings, ["POST"]),
            server.route("/v1/score", score, ["POST"]), server.route("/score", score, ["POST"]),
            *(server.route(path, rerank, ["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank"))]

