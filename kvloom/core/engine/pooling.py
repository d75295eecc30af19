"""Pooling requests in the engine: what the model serves (``task``), the check of a request's pooling
fields, and the per-request sums of hidden states that chunked prefills build into one vector."""

from __future__ import annotations

from kvloom.core.config import ConfigError
from kvloom.core.engine.step import PooledChunk, SeqPooling
from kvloom.core.messages import PoolingInfo, PoolingParams
from kvloom.core.model.pooling_config import PoolingConfig, matryoshka_of, read_pooling_config


def resolve_task(task: str, model_path, hf_config) -> tuple[str, PoolingConfig | None]:
    """The task an engine serves and its pooling: ``auto`` is ``embed`` for a sentence-transformers folder;
    ``embed`` without those files pools the last token and normalizes (what decoder embedding models do)."""
    try:
        found = read_pooling_config(model_path, hf_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if task == "auto":
        task = "embed" if found is not None else "generate"
    if task == "embed":
        return task, found or PoolingConfig("last", True, *matryoshka_of(hf_config))
    if task == "score":
        return task, PoolingConfig("last", False)
    return task, None


def pooling_info(config: PoolingConfig, hidden_size: int) -> PoolingInfo:
    return PoolingInfo(pooling=config.pooling, normalize=config.normalize, hidden_size=hidden_size,
                       matryoshka=config.matryoshka, matryoshka_dimensions=list(config.matryoshka_dimensions))


def check_pooling(task: str, config: PoolingConfig | None, params: PoolingParams | None, hidden_size: int,
                  vocab_size: int) -> SeqPooling | None:
    """What the runner keeps for a request, after checking it fits this engine's task; ValueError names
    the field and the limit (the frontends check the same first: frontends/validation.py)."""
    if params is None:
        if task != "generate":
            raise ValueError(f"this model serves task={task!r}: it pools prompts and generates no text")
        return None
    if params.task != task:
        raise ValueError(f"pooling task={params.task!r} was asked of a model that serves task={task!r}")
    if task == "score":
        if len(params.score_token_ids) < 2:
            raise ValueError("a score request needs score_token_ids: at least two token ids (no, yes)")
        bad = next((t for t in params.score_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"score token id {bad} is out of range [0, {vocab_size})")
        return SeqPooling("last", tuple(params.score_token_ids))
    if params.score_token_ids:
        raise ValueError("score_token_ids are for task='score'")
    check_dimensions(params.dimensions, config, hidden_size)
    return SeqPooling(config.pooling)


def check_dimensions(dimensions: int | None, config: PoolingConfig | PoolingInfo, hidden_size: int) -> None:
    """``dimensions`` a model can truncate its embeddings to; ValueError naming the sizes allowed."""
    if dimensions is None:
        return
    if not config.matryoshka:
        raise ValueError(f"dimensions={dimensions}: this model does not support truncated embeddings "
                         "(no matryoshka_dimensions or is_matryoshka in its config); leave dimensions out")
    allowed = list(config.matryoshka_dimensions)
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions={dimensions} is not one of this model's matryoshka_dimensions {allowed}")
    if not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions={dimensions} must be in [1, {hidden_size}] (the model's hidden size)")


class PooledSums:
    """Each pooling request's hidden states summed over the chunks computed so far; a request recomputed
    from its start (preempted) starts its sum again."""

    def __init__(self) -> None:
        self._sums: dict[str, list] = {}  # request id -> [summed vector, rows summed]

    def gather(self, pooled: dict[str, PooledChunk], live) -> None:
        for rid, chunk in pooled.items():
            if rid not in live:
                continue  # finished or aborted meanwhile
            got = self._sums.get(rid)
            if got is None or chunk.start == 0:
                self._sums[rid] = [chunk.vector, chunk.count]
            else:
                got[0] = got[0] + chunk.vector
                got[1] += chunk.count

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._sums.pop(rid, None)

    def finish(self, request_id: str, pooling: SeqPooling, params: PoolingParams, config: PoolingConfig
               ) -> list[float] | None:
        """The request's vector: mean (or last/first position), truncated to ``dimensions``, normalized;
        a score request's softmax over its tokens' logits. None if no step pooled it (the frontend then
        answers 503 instead of the loop failing)."""
        import torch  # the engine process has it loaded; this module is also read by light importers

        got = self._sums.pop(request_id, None)
        if got is None:
            return None
        vector, count = got
        if pooling.score_token_ids:
            return torch.softmax(vector.float(), -1).tolist()
        if pooling.type == "mean":
            vector = vector / count
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.tolist()
