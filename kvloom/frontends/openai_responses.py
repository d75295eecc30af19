"""OpenAI response bodies built from the engine's text deltas: whole responses, server-sent event
streams (with usage chunks and a final error event), and logprobs in the completion and chat shapes."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from kvloom.core.messages import TokenLogprobs
from kvloom.frontends import openai_protocol as api
from kvloom.frontends.asgi import ERROR_TYPES, SSE_DONE, sse
from kvloom.frontends.chat_output import ChatReading, ChoiceStream
from kvloom.frontends.errors import RequestError
from kvloom.frontends.output import TextDelta
from kvloom.frontends.text import token_bytes


@dataclass
class CompletionEcho:
    """What a completion choice shows of its prompt: the prompt itself before the output (``echo``), with
    its logprobs in the legacy shape when ``logprobs`` is given, and vLLM's ``prompt_logprobs`` field.
    ``generate`` False is ``max_tokens=0``: the engine's one token is not shown or counted."""

    prompts: list[tuple[str, list[int]]]  # per choice: the prompt's text and token ids
    echo: bool
    logprobs: int | None
    prompt_logprobs: int | None
    generate: bool = True

    def output(self, delta: TextDelta) -> TextDelta:
        """``delta`` as the client sees it: under max_tokens=0, no text, tokens or logprobs of its own."""
        if self.generate:
            return delta
        return TextDelta("", [], None, "length" if delta.finish_reason is not None else None, None,
                         delta.num_prompt_tokens, delta.num_cached_tokens, 0, delta.prompt_logprobs)


@dataclass
class ChatPrompt:
    """What a chat response shows of its request beyond the reply: vLLM's ``echo`` text (the reply
    starts with it), the prompt's token ids (``return_token_ids``), the rendered chat
    (``return_prompt_text``) and how many alternatives ``prompt_logprobs`` lists."""

    echo: str = ""
    token_ids: list[int] | None = None
    text: str | None = None
    prompt_logprobs: int | None = None


class UsageCounter:
    """Token counts of one HTTP request across its choices."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.prompt_lens = prompt_lens
        self.prompt_tokens = sum(prompt_lens)
        self.n = n
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def add(self, index: int, delta: TextDelta) -> None:
        self.completion[index] = delta.num_output_tokens
        if index % self.n == 0:
            self.cached[index] = delta.num_cached_tokens

    def choice_info(self, index: int, delta: TextDelta | None) -> api.UsageInfo:
        """vLLM's continuous usage stats: one choice's prompt and its tokens so far."""
        prompt = self.prompt_lens[index // self.n]
        done = delta.num_output_tokens if delta is not None else 0
        return api.UsageInfo(prompt, done, prompt + done)

    def info(self) -> api.UsageInfo:
        completion = sum(self.completion.values())
        cached = sum(self.cached.values())
        return api.UsageInfo(self.prompt_tokens, completion, self.prompt_tokens + completion,
                             api.PromptTokensDetails(cached) if cached else None)


class ResponseBuilder:
    """Builds one served model's responses; caches each token's text and bytes for logprobs."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self.tokens_as_ids = False

    def view(self, tokens_as_ids: bool | None) -> "ResponseBuilder":
        """This builder for one request: with ``tokens_as_ids`` (vLLM's return_tokens_as_token_ids),
        logprobs name each token ``token_id:N``. The caches stay shared."""
        if not tokens_as_ids:
            return self
        view = copy.copy(self)
        view.tokens_as_ids = True
        return view

    def named(self, model_name: str) -> "ResponseBuilder":
        """This builder answering as ``model_name`` (a LoRA adapter of the model), sharing its token caches."""
        builder = copy.copy(self)
        builder.model_name = model_name
        return builder

    def token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = token_bytes(self.tokenizer, token_id)
        return raw

    async def stream_end(self, events: AsyncIterator[str], usage_chunk: Callable[[], Any] | None):
        """Wrap an event stream: an engine failure mid-stream becomes an error event; ends with [DONE]."""
        try:
            async for event in events:
                yield event
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except RequestError as e:
            info = api.ErrorInfo(message=e.message, type=ERROR_TYPES.get(e.status, "server_error"), code=e.status)
            yield sse(api.ErrorResponse(info))
        yield SSE_DONE

    async def collect_completion(self, rid: str, merged, usage: UsageCounter, count: int,
                                 echo: CompletionEcho | None = None,
                                 prompt_ids: list[list[int]] | None = None) -> api.CompletionResponse:
        """``prompt_ids`` (each choice's prompt): vLLM's return_token_ids, the prompt's and the output's."""
        texts = [""] * count
        ids: list[list[int]] = [[] for _ in range(count)]
        lps: list[list[TokenLogprobs] | None] = [None] * count
        prompt_lps: list[list[TokenLogprobs] | None] = [None] * count
        finals: list[TextDelta | None] = [None] * count
        async for index, delta in merged:
            if echo is not None:
                delta = echo.output(delta)
                prompt_lps[index] = prompt_lps[index] or delta.prompt_logprobs
            texts[index] += delta.text
            ids[index] += delta.token_ids
            if delta.logprobs:
                lps[index] = (lps[index] or []) + delta.logprobs
            if delta.finish_reason is not None:
                finals[index] = delta
                usage.add(index, delta)
        choices = []
        for i in range(count):
            choice = api.CompletionChoice(index=i, text=texts[i], logprobs=self.completion_logprobs(lps[i], 0),
                                          finish_reason=finals[i].finish_reason, stop_reason=finals[i].stop_reason)
            if prompt_ids is not None:
                choice.token_ids, choice.prompt_token_ids = ids[i], list(prompt_ids[i])
            choices.append(self._with_prompt(choice, echo, i, prompt_lps[i], lps[i]) if echo is not None else choice)
        return api.CompletionResponse(id=rid, choices=choices, model=self.model_name, usage=usage.info())

    def completion_events(self, req: api.CompletionRequest, rid: str, merged, usage: UsageCounter,
                          echo: CompletionEcho | None = None, prompt_ids: list[list[int]] | None = None):
        async def events():
            offsets: dict[int, int] = {}
            async for index, delta in merged:
                first = index not in offsets
                if echo is not None:
                    delta = echo.output(delta)
                lp = self.completion_logprobs(delta.logprobs, offsets.get(index, 0))
                # Offsets advance by the tokens' own texts, as in the whole response's logprobs.
                offsets[index] = offsets.get(index, 0) + (sum(map(len, lp.tokens)) if lp else len(delta.text))
                if delta.finish_reason is not None:
                    usage.add(index, delta)
                choice = api.CompletionChoice(index=index, text=delta.text, logprobs=lp,
                                              finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                if prompt_ids is not None:
                    choice.token_ids = list(delta.token_ids)
                    choice.prompt_token_ids = list(prompt_ids[index]) if first else None
                if echo is not None and first:  # the prompt comes with the choice's first chunk
                    choice = self._with_prompt(choice, echo, index, delta.prompt_logprobs, delta.logprobs)
                    if echo.echo and choice.logprobs is not None:
                        offsets[index] = sum(len(t) for t in choice.logprobs.tokens)
                yield sse(api.CompletionResponse(id=rid, choices=[choice], model=self.model_name,
                                                 usage=usage.choice_info(index, delta) if every_chunk else None))

        every_chunk = req.stream_options is not None and req.stream_options.usage_every_chunk
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage_chunk = (lambda: api.CompletionResponse(id=rid, choices=[], model=self.model_name,
                                                      usage=usage.info())) if include_usage else None
        return self.stream_end(events(), usage_chunk)

    def _with_prompt(self, choice: api.CompletionChoice, echo: CompletionEcho, index: int,
                     prompt_lps: list[TokenLogprobs] | None, lps: list[TokenLogprobs] | None) -> api.CompletionChoice:
        """``choice`` (its output so far) with its prompt: echoed before the text and the logprobs, and as
        vLLM's prompt_logprobs."""
        text, ids = echo.prompts[index]
        if echo.prompt_logprobs is not None:
            choice.prompt_logprobs = [None] + [self._vllm_prompt_logprob(lp, echo.prompt_logprobs)
                                               for lp in prompt_lps or ()]
        if not echo.echo:
            return choice
        choice.text = text + choice.text
        if echo.logprobs is not None:
            # As OpenAI's legacy completions and vLLM: the prompt's tokens first (the very first one has
            # no context, so no logprob), each prompt position's top-n together with the prompt token.
            prompt = [TokenLogprobs(ids[0], None, [])] + list(prompt_lps or ())
            entries = self.completion_logprobs(prompt + list(lps or ()), 0, top=echo.logprobs,
                                               with_chosen=len(prompt))
            entries.top_logprobs[0] = None
            choice.logprobs = entries
        return choice

    def _vllm_prompt_logprob(self, lp: TokenLogprobs, k: int) -> dict[str, api.PromptLogprob]:
        out = {str(lp.token_id): api.PromptLogprob(lp.logprob, lp.rank, self.token_text(lp.token_id))}
        for rank, t in enumerate(lp.top[:k], 1):
            out.setdefault(str(t.token_id), api.PromptLogprob(t.logprob, rank, self.token_text(t.token_id)))
        return out

    def completion_logprobs(self, lps: list[TokenLogprobs] | None, offset: int, top: int | None = None,
                            with_chosen: int = 0) -> api.CompletionLogprobs | None:
        """The legacy shape of ``lps`` (at most ``top`` alternatives each); the first ``with_chosen``
        positions (echoed prompt tokens) list their own token among the alternatives too."""
        if lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        text_offset = []
        for t in tokens:
            text_offset.append(offset)
            offset += len(t)
        tops = []
        for i, lp in enumerate(lps):
            entry = {self.token_text(t.token_id): t.logprob for t in lp.top[:top]}
            if i < with_chosen and lp.logprob is not None:
                entry.setdefault(self.token_text(lp.token_id), lp.logprob)
            tops.append(entry)
        return api.CompletionLogprobs(tokens, [lp.logprob for lp in lps], tops, text_offset)

    async def collect_chat(self, rid: str, merged, usage: UsageCounter, n: int, reading: ChatReading,
                           prompt: ChatPrompt | None = None) -> api.ChatCompletionResponse:
        prompt = prompt or ChatPrompt()
        texts = [""] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[api.TokenLogprobOut] | None] = [None] * n
        finals: list[TextDelta | None] = [None] * n
        prompt_lps: list[TokenLogprobs] | None = None
        async for index, delta in merged:
            texts[index] += delta.text
            ids[index] += delta.token_ids
            prompt_lps = prompt_lps or delta.prompt_logprobs
            if delta.logprobs:
                lps[index] = (lps[index] or []) + self.chat_logprobs(delta.logprobs).content
            if delta.finish_reason is not None:
                finals[index] = delta
                usage.add(index, delta)
        choices = []
        for i in range(n):
            reasoning, content, calls = reading.whole(texts[i])
            if prompt.echo and not calls:  # vLLM's echo: the reply's text starts with the last message
                content = prompt.echo + (content or "")
            message = api.ChatMessageOut(content, tool_calls=[
                api.ToolCallOut(c.id, api.FunctionCallOut(c.name, c.arguments)) for c in calls] or None)
            if reasoning is not None:
                message.reasoning_content = reasoning
            choices.append(api.ChatChoice(index=i, message=message,
                                          finish_reason=reading.finish_reason(finals[i].finish_reason, calls),
                                          logprobs=api.ChatLogprobs(lps[i]) if lps[i] is not None else None,
                                          stop_reason=finals[i].stop_reason,
                                          token_ids=ids[i] if prompt.token_ids is not None else None))
        response = api.ChatCompletionResponse(id=rid, choices=choices, model=self.model_name, usage=usage.info(),
                                              prompt_token_ids=prompt.token_ids, prompt_text=prompt.text)
        if prompt.prompt_logprobs is not None:
            response.prompt_logprobs = [None] + [self._vllm_prompt_logprob(lp, prompt.prompt_logprobs)
                                                 for lp in prompt_lps or ()]
        return response

    def chat_events(self, req: api.ChatCompletionRequest, rid: str, merged, usage: UsageCounter,
                    reading: ChatReading, prompt: ChatPrompt | None = None):
        model = self.model_name
        prompt = prompt or ChatPrompt()
        outs = {i: reading.stream() for i in range(req.n)}
        called: set[int] = set()  # choices whose named call has shown its id and name
        every_chunk = req.stream_options is not None and req.stream_options.usage_every_chunk
        latest: dict[int, TextDelta] = {}
        # return_token_ids: each chunk carries the tokens that arrived since its choice's last chunk
        pending: dict[int, list[int]] | None = {i: [] for i in range(req.n)} if prompt.token_ids is not None else None

        def chunk(index: int, delta: api.DeltaMessage, **kw) -> str:
            ids = None
            if pending is not None:
                ids, pending[index] = pending[index], []
            return sse(api.ChatCompletionChunk(id=rid, model=model, choices=[
                api.ChatChunkChoice(index=index, delta=delta, token_ids=ids, **kw)],
                usage=usage.choice_info(index, latest.get(index)) if every_chunk else None))

        def text_delta(reasoning: str, content: str) -> api.DeltaMessage:
            return api.DeltaMessage(content=content if content or not reasoning else None,
                                    reasoning_content=reasoning or None)

        async def events():
            first = dict(prompt_token_ids=prompt.token_ids, prompt_text=prompt.text)
            if every_chunk:  # vLLM's continuous usage: every chunk has its choice's, the first too
                for i in range(req.n):
                    yield sse(api.ChatCompletionChunk(id=rid, model=model, choices=[api.ChatChunkChoice(
                        index=i, delta=api.DeltaMessage(role="assistant", content=""))],
                        usage=usage.choice_info(i, None), **(first if i == 0 else {})))
            else:
                yield sse(api.ChatCompletionChunk(id=rid, model=model, choices=[
                    api.ChatChunkChoice(index=i, delta=api.DeltaMessage(role="assistant", content=""))
                    for i in range(req.n)], **first))
            if prompt.echo:
                for i in range(req.n):
                    yield chunk(i, api.DeltaMessage(content=prompt.echo))
            async for index, delta in merged:
                latest[index] = delta
                if pending is not None:
                    pending[index] += delta.token_ids
                if delta.finish_reason is not None:
                    usage.add(index, delta)
                lp = self.chat_logprobs(delta.logprobs) if delta.logprobs else None
                out = outs[index]
                reasoning, content = out.feed(delta.text)
                if out.named is not None:  # the output is the call's arguments: stream them as they come
                    for piece in self._named_call_chunks(chunk, out, index, delta, reasoning, lp, called):
                        yield piece
                    continue
                if delta.finish_reason is None:
                    if reasoning or content or lp is not None:
                        yield chunk(index, text_delta(reasoning, content), logprobs=lp)
                    continue
                more, rest, calls = out.finish()
                reasoning, content = reasoning + more, content + rest
                if out.tools is None and out.splitter is None:
                    # Plain text: the last piece and the finish share one chunk, as before tools existed.
                    yield chunk(index, api.DeltaMessage(content=content), logprobs=lp,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                    continue
                if reasoning or content or lp is not None:
                    yield chunk(index, text_delta(reasoning, content), logprobs=lp)
                for k, call in enumerate(calls):  # as OpenAI streams a call: id and name, then arguments
                    yield chunk(index, api.DeltaMessage(tool_calls=[api.DeltaToolCall(
                        k, call.id, "function", api.DeltaFunctionCall(name=call.name, arguments=""))]))
                    yield chunk(index, api.DeltaMessage(tool_calls=[api.DeltaToolCall(
                        k, function=api.DeltaFunctionCall(arguments=call.arguments))]))
                yield chunk(index, api.DeltaMessage(), finish_reason=out.finish_reason(delta.finish_reason, calls),
                            stop_reason=delta.stop_reason)

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage_chunk = (lambda: api.ChatCompletionChunk(id=rid, choices=[], model=model,
                                                       usage=usage.info())) if include_usage else None
        return self.stream_end(events(), usage_chunk)

    @staticmethod
    def _named_call_chunks(chunk: Callable[..., str], out: ChoiceStream, index: int, delta: TextDelta,
                           reasoning: str, lp: api.ChatLogprobs | None, called: set[int]) -> list[str]:
        """One delta of a choice whose output is a named call: its argument text as tool-call deltas (the
        first with the call's id, type and name, as OpenAI streams a call), and the finish."""
        calls = []
        if delta.finish_reason is not None:
            more, _, calls = out.finish()
            reasoning += more
        arguments = out.new_arguments()
        call = None
        if arguments or (index not in called and (lp is not None or delta.finish_reason is not None)):
            call = api.DeltaToolCall(0, function=api.DeltaFunctionCall(arguments=arguments))
            if index not in called:
                called.add(index)
                call = api.DeltaToolCall(0, out.named.id, "function",
                                         api.DeltaFunctionCall(name=out.named.name, arguments=arguments))
        pieces = []
        if reasoning or call is not None or lp is not None:
            pieces.append(chunk(index, api.DeltaMessage(reasoning_content=reasoning or None,
                                                        tool_calls=[call] if call is not None else None), logprobs=lp))
        if delta.finish_reason is not None:
            pieces.append(chunk(index, api.DeltaMessage(), finish_reason=out.finish_reason(delta.finish_reason, calls),
                                stop_reason=delta.stop_reason))
        return pieces

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> api.ChatLogprobs:
        def entry(token_id: int, logprob: float) -> tuple[str, float, list[int]]:
            return self.token_text(token_id), logprob, list(self.token_bytes(token_id))

        return api.ChatLogprobs([
            api.TokenLogprobOut(*entry(lp.token_id, lp.logprob),
                                [api.TopLogprobOut(*entry(t.token_id, t.logprob)) for t in lp.top])
            for lp in lps])
