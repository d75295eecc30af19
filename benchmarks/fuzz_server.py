"""Fuzz a kvloom server (started here, with the gateway): seeded random bodies for /v1/completions,
/v1/chat/completions, /v1/responses and /v1/messages and random msgpack messages for the ZMQ gateway,
mostly malformed, some valid, 1% holding a huge array (stop strings, stop token ids, logit_bias, prompt
tokens or messages by the 10,000s); beside them, gateway clients that disconnect mid-stream and clients
that stop reading.
Every answer must be 2xx/4xx within a bound (no 5xx, no hang); every gateway stream must end, its
last chunk's usage counting exactly the tokens received, or end with RequestFailed (none lost or
truncated); the server must not lose a process; afterwards its greedy output must be unchanged and
every KV block free. tests/test_fuzz.py runs 2,000 messages of it; by hand, 20,000:

    python benchmarks/fuzz_server.py --tiny-model /tmp/kvloom-tiny --bodies 16000 --gateway-messages 4000

(``--tiny-model DIR`` builds the test suite's tiny random Llama there once; ``--model PATH`` serves any
other model.) It prints the totals per status as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import string
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

VOCAB = 384  # the tiny test model's; ids beyond the real vocabulary are just more invalid input
GATEWAY_MAX_UNREAD = 256  # the server's gateway_max_unread: a client that stops reading fills it soon
HUGE_INTS = [2**31, 2**31 - 1, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64,
             2**64 + 1, 10**30, -(10**30)]
WEIRD_TEXT = ["", " ", "\x00", "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "é" * 50,
              "🚀" * 20, "\u202e\u200b", "<s></s>", "{{ raise_exception('x') }}", "{% for %}", "\n" * 40,
              "a" * 3000, "%s%n%x", "\\u0000"]


def _any_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type: where a field expects one type, every other type is a test."""
    kind = rng.randrange(11 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(HUGE_INTS)
    if kind == 3:
        return rng.randint(-5, 40)
    if kind == 4:
        return rng.choice([0.0, -1.5, 0.5, 1e308, -1e308, 2.5, 1e-300, 3.0])
    if kind == 5:
        return rng.choice(WEIRD_TEXT)
    if kind == 6:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(12)))
    if kind == 7:
        return []
    if kind == 8:
        return [_any_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 9:
        return {rng.choice(["a", "type", "text", "role", ""]): _any_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return {}


def _token_ids(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind < 3:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    if kind == 3:
        return [rng.choice([-1, VOCAB, 2**63, True, 1.0, "1", None]) for _ in range(rng.randint(1, 3))]
    if kind == 4:
        return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 3))]
    return [[rng.choice([True, -3, 2**70, []])]]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(WEIRD_TEXT)
    words = ["The", "quick", "brown", "fox", "Paris", "café", "東京", "🚀", "0", "1000", "\n"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))


# Sampling fields with values a valid request may have, then everything else.
_VALID = {
    "temperature": lambda r: r.choice([0.0, 0.0, 0.7, 1.0, 2.0]),
    "top_p": lambda r: r.choice([1.0, 0.9, 0.1]),
    "top_k": lambda r: r.choice([0, -1, 1, 5, 1000]),
    "min_p": lambda r: r.choice([0.0, 0.1, 1.0]),
    "seed": lambda r: r.choice([None, 0, 1234, 2**63 - 1, -(2**63)]),
    "presence_penalty": lambda r: r.choice([0.0, -2.0, 2.0, 0.5]),
    "frequency_penalty": lambda r: r.choice([0.0, -2.0, 2.0, 0.5]),
    "repetition_penalty": lambda r: r.choice([1.0, 0.5, 1.3, 10.0]),
    "min_tokens": lambda r: r.choice([0, 1, 2]),
    "stop": lambda r: r.choice([None, "\n", ["a", "the"], [], ["x"] * 16]),
    "stop_token_ids": lambda r: r.choice([[], [2], [5, 6]]),
    "ignore_eos": lambda r: r.choice([True, False]),
    "skip_special_tokens": lambda r: r.choice([True, False]),
    "include_stop_str_in_output": lambda r: r.choice([True, False]),
    "priority": lambda r: r.choice([0, -5, 100, 2**31 - 1]),
    "n": lambda r: r.choice([1, 1, 2, 3]),
    "stream": lambda r: r.choice([True, False]),
    "stream_options": lambda r: r.choice([None, {"include_usage": True}]),
    "user": lambda r: "u",
    "model": lambda r: r.choice([None, "no-such-model"]),
}


# The chat body's fields each other chat-shaped API takes, and the fields a broken body of it breaks.
_DOORS = {
    "/v1/messages": ({"temperature", "top_p", "top_k", "stream", "model", "priority"},
                     ["messages", "max_tokens", "system", "tools", "tool_choice", "thinking", "stop_sequences",
                      "output_config", "temperature", "metadata", "unknown_field"]),
    "/v1/responses": ({"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "stop", "priority", "stream", "user", "model"},
                      ["input", "max_output_tokens", "instructions", "tools", "tool_choice", "text",
                       "previous_response_id", "store", "reasoning", "unknown_field"]),
}
# The last event of each route's named-event stream (OpenAI's chat and completions end with [DONE]).
LAST_EVENTS = {"/v1/responses": {"response.completed", "response.incomplete", "error"},
               "/v1/messages": {"message_stop", "error"}}


def stream_ended(path: str, body: bytes) -> bool:
    if path not in LAST_EVENTS:
        return b"data: [DONE]" in body
    names = [line[len(b"event: "):].decode() for line in body.splitlines() if line.startswith(b"event: ")]
    return bool(names) and names[-1] in LAST_EVENTS[path]
_BLOCKS = ["text", "tool_use", "tool_result", "thinking", "image", "input_text", "function_call",
           "function_call_output", "reasoning", "message", None]


def _block(rng: random.Random) -> dict[str, Any]:
    block = {"type": rng.choice(_BLOCKS)}
    for name in rng.sample(["text", "id", "name", "input", "tool_use_id", "content", "call_id", "arguments", "output",
                            "role", "thinking"], rng.randint(0, 4)):
        block[name] = _text(rng) if rng.random() < 0.5 else _any_value(rng)
    return block


def _other_door(rng: random.Random, path: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The chat body as a /v1/messages or /v1/responses body, perhaps with odd content blocks or items."""
    fields, breakable = _DOORS[path]
    body = {k: v for k, v in chat.items() if k in fields}
    turns = [m for m in chat["messages"] if m.get("role") != "system"] or [{"role": "user", "content": "hi"}]
    if path == "/v1/messages":
        body["messages"], body["max_tokens"] = turns, chat["max_tokens"]
        if isinstance(body.get("temperature"), float) and body["temperature"] > 1:
            body["temperature"] = 1.0
        if rng.random() < 0.3:
            body["system"] = _text(rng)
        if rng.random() < 0.2:
            body["messages"] = [{"role": rng.choice(["user", "assistant"]),
                                 "content": [_block(rng) for _ in range(rng.randint(1, 3))]}]
    else:
        body["input"] = turns if rng.random() < 0.5 else _text(rng)
        body["max_output_tokens"] = chat["max_tokens"]
        if rng.random() < 0.3:
            body["instructions"] = _text(rng)
        if rng.random() < 0.2:
            body["input"] = [_block(rng) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.65:
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(breakable)
            value = _any_value(rng)
            if name in ("max_tokens", "max_output_tokens") and (value is None or isinstance(value, bool)):
                value = rng.choice(HUGE_INTS)  # null would mean "the whole context": slow, not invalid
            body[name] = value
    return body


def http_body(rng: random.Random, model: str) -> tuple[str, bytes]:
    """One request: (path, raw body). About a third are valid requests; the rest break one or more rules."""
    chat = rng.random() < 0.5
    body: dict[str, Any] = {}
    if chat:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant"]), "content": _text(rng)}
                            for _ in range(rng.randint(1, 3))]
        body["max_tokens"] = rng.randint(1, 4)  # never left out: a chat's default is the whole context
    else:
        body["prompt"] = _text(rng) if rng.random() < 0.6 else _token_ids(rng)
        body["max_tokens"] = rng.randint(1, 4)
    for name in rng.sample(sorted(_VALID), rng.randint(0, 6)):
        body[name] = _VALID[name](rng)
    if body.get("model") is None:
        body["model"] = model
    if body.get("stop_token_ids") is None:
        body.pop("stop_token_ids", None)
    if rng.random() < 0.65:  # break it: a field of the wrong type or out of range, or an unknown one
        for _ in range(rng.randint(1, 3)):
            name = rng.choice([*_VALID, "max_tokens", "logprobs", "top_logprobs", "max_completion_tokens",
                               "echo", "suffix", "best_of", "logit_bias", "tools", "response_format",
                               "messages" if chat else "prompt", "unknown_field"])
            value = _any_value(rng)
            if name in ("max_tokens", "max_completion_tokens") and (value is None or isinstance(value, bool)):
                value = rng.choice(HUGE_INTS)  # null would mean "the whole context": slow, not invalid
            body[name] = value
    elif chat and rng.random() < 0.3:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    elif not chat and rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat and isinstance(body.get("messages"), list) and all(isinstance(m, dict) for m in body["messages"]) \
            and isinstance(body.get("max_tokens"), int) and rng.random() < 0.4:
        path = rng.choice(sorted(_DOORS))
        body = _other_door(rng, path, body)
    elif rng.random() < 0.01:  # one huge array: refused by its limit (400) or the body's (413), quickly
        body.update(_huge_array(rng, chat))
    raw = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.04:
        raw = raw[: rng.randrange(len(raw))]  # truncated JSON
    elif roll < 0.06:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    elif roll < 0.08:
        raw = b'{"prompt":' + b"[" * rng.randint(65, 3000) + b"]" * rng.randint(0, 3000) + b"}"
    elif roll < 0.09:
        raw = raw.replace(b"1", b"NaN", 1)
    return path, raw


def _huge_array(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A field holding a huge array (the probe's 1,000,000 stop strings held up every client)."""
    n = rng.choice([20_000, 200_000])
    which = rng.choice(["stop", "stop_token_ids", "logit_bias", "prompt"])
    if which == "stop":
        return {"stop": ["ab"] * n}
    if which == "stop_token_ids":
        return {"stop_token_ids": [rng.randrange(VOCAB) for _ in range(n)]}
    if which == "logit_bias":
        return {"logit_bias": {str(i): 1.0 for i in range(n)}}
    if chat:
        return {"messages": [{"role": "user", "content": "hi"}] * (n // 20)}
    return {"prompt": [5] * n}


def gateway_message(rng: random.Random, request_id: str) -> tuple[list[bytes], bool]:
    """One message for the gateway as frames, and whether it is a Generate-shaped message (which gets
    one terminal reply with its request_id or, when malformed, with request_id "")."""
    roll = rng.random()
    if roll < 0.05:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(40)))], False
    if roll < 0.08:
        return [msgspec.msgpack.encode({"type": "Ping"}), b"extra"], False
    if roll < 0.12:
        return [msgspec.msgpack.encode(_msgpack_ints({"type": rng.choice(["Ping", "Cancel", "Nope", 5, None]),
                                                      "request_id": _any_value(rng)}))], False
    msg: dict[str, Any] = {"type": "Generate", "request_id": request_id}
    which = rng.choice(["prompt", "messages", "prompt_token_ids"])
    if which == "prompt":
        msg["prompt"] = _text(rng)
    elif which == "messages":
        msg["messages"] = [{"role": "user", "content": _text(rng)}]
    else:
        msg["prompt_token_ids"] = _token_ids(rng)
    sampling = {"max_tokens": rng.randint(1, 4)}
    for name in rng.sample([k for k in _VALID if k not in ("stream", "stream_options", "user", "model")],
                           rng.randint(0, 5)):
        sampling[name] = _VALID[name](rng)
    if sampling.get("seed") is None:
        sampling.pop("seed", None)
    if sampling.get("stop") is None:
        sampling.pop("stop", None)
    msg["sampling"] = sampling
    if rng.random() < 0.01:
        huge = _huge_array(rng, which == "messages")
        if "prompt" in huge or "messages" in huge:
            for name in ("prompt", "messages", "prompt_token_ids"):
                msg.pop(name, None)
            msg["prompt_token_ids" if "prompt" in huge else "messages"] = huge.get("prompt", huge.get("messages"))
        else:
            sampling.update({k: ({int(t): v for t, v in value.items()} if k == "logit_bias" else value)
                             for k, value in huge.items()})
        return [msgspec.msgpack.encode(msg)], True
    if rng.random() < 0.6:
        for _ in range(rng.randint(1, 3)):
            target = sampling if rng.random() < 0.6 else msg
            name = rng.choice([*sampling, "logprobs", "n", "max_tokens", "priority", "prompt", "messages",
                               "prompt_token_ids", "sampling", "unknown"])
            value = _any_value(rng)
            if name == "max_tokens" and value is None:
                value = 2**64
            target[name] = value
    return [msgspec.msgpack.encode(_msgpack_ints(msg))], True


def _msgpack_ints(value: Any) -> Any:
    """msgpack holds integers in [-2**63, 2**64): clamp bigger ones to its edges (the largest a client can send)."""
    if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
        return value
    if isinstance(value, int):
        return min(max(value, -(2**63)), 2**64 - 1)
    if isinstance(value, list):
        return [_msgpack_ints(v) for v in value]
    return {k: _msgpack_ints(v) for k, v in value.items()}


@dataclass
class FuzzResult:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    gateway: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)  # 5xx, hangs, broken answers

    def as_dict(self) -> dict[str, Any]:
        return {"http": dict(sorted(self.statuses.items())), "gateway": dict(sorted(self.gateway.items())),
                "failures": self.failures[:20], "num_failures": len(self.failures)}


async def fuzz_http(url: str, model: str, bodies: int, seed: int, result: FuzzResult, concurrency: int = 16,
                    timeout: float = 60.0, headers: dict[str, str] | None = None) -> None:
    rng = random.Random(seed)
    requests = [http_body(rng, model) for _ in range(bodies)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    # Idle connections expire here before the server's keep-alive timeout closes them, so no request is
    # sent on a connection the server is closing at that moment (a race of HTTP keep-alive, not a fault).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        async def worker():
            while not queue.empty():
                path, raw = queue.get_nowait()
                try:
                    r = await http.post(url + path, content=raw,
                                        headers={"content-type": "application/json", **(headers or {})})
                    body = await r.aread()
                except httpx.TimeoutException:
                    result.failures.append(f"hang: POST {path} {raw[:200]!r}")
                    continue
                except httpx.HTTPError as e:
                    result.failures.append(f"transport error {e!r}: POST {path} {raw[:200]!r}")
                    continue
                result.statuses[r.status_code] += 1
                if r.status_code >= 500 or r.status_code < 200 or 300 <= r.status_code < 400:
                    result.failures.append(f"{r.status_code}: POST {path} {raw[:300]!r} -> {body[:300]!r}")
                elif r.status_code == 200 and b'"stream": true' not in raw and not body.startswith(b"{"):
                    result.failures.append(f"200 without a JSON body: {raw[:200]!r} -> {body[:200]!r}")
                elif r.status_code == 200 and b"text/event-stream" in r.headers.get("content-type", "").encode() \
                        and not stream_ended(path, body):
                    result.failures.append(f"stream without its last event: POST {path} {raw[:200]!r}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def fuzz_gateway(address: str, messages: int, seed: int, result: FuzzResult, clients: int = 8,
                 timeout_ms: int = 30_000) -> None:
    """``clients`` gateway clients at once, each sequential (a message's answers are all read before its
    next message is sent, so none can be confused)."""
    from concurrent.futures import ThreadPoolExecutor

    shares = [messages // clients + (k < messages % clients) for k in range(clients)]
    parts = [FuzzResult() for _ in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda k: _fuzz_gateway_client(address, shares[k], seed * 1000 + k, parts[k], timeout_ms),
                      range(clients)))
    for part in parts:
        result.gateway.update(part.gateway)
        result.failures += part.failures


def _fuzz_gateway_client(address: str, messages: int, seed: int, result: FuzzResult, timeout_ms: int) -> None:
    rng = random.Random(seed)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(address)
    try:
        for i in range(messages):
            rid = f"f{i}"
            frames, generate = gateway_message(rng, rid)
            sock.send_multipart(frames)
            if not generate:  # a sync request after it: everything the message caused is answered by then
                rid = f"sync{i}"
                sock.send(msgspec.msgpack.encode({"type": "Generate", "request_id": rid, "prompt_token_ids": [5],
                                                  "sampling": {"max_tokens": 1}}))
            if not _read_until_done(sock, rid, generate, result, frames):
                return
    finally:
        sock.close()


def _read_until_done(sock, rid: str, generate: bool, result: FuzzResult, frames) -> bool:
    received = 0  # completion tokens of ``rid`` so far: a last chunk's usage must count exactly these
    while True:
        try:
            reply = msgspec.msgpack.decode(sock.recv())
        except zmq.Again:
            result.failures.append(f"gateway hang after {frames[0][:200]!r}")
            return False
        kind = reply.get("type")
        if kind == "RequestFailed":
            status = reply.get("status", 400)
            result.gateway[f"RequestFailed {status}"] += 1
            if not 400 <= status < 500:
                result.failures.append(f"gateway {status}: {frames[0][:200]!r} -> {reply}")
            if reply.get("request_id") == rid or (generate and reply.get("request_id") == ""):
                return True
        elif kind == "TextChunk":
            if reply.get("request_id") == rid:
                received += len(reply.get("token_ids", []))
            if reply.get("finish_reason") is not None:
                result.gateway[f"TextChunk {reply['finish_reason']}"] += 1
                if reply.get("request_id") == rid:
                    usage = reply.get("usage") or {}
                    if usage.get("completion_tokens") != received:
                        result.failures.append(f"truncated: {rid} sent {received} tokens, usage says {usage}")
                    return True
        elif kind == "Pong":
            result.gateway["Pong"] += 1
        else:
            result.failures.append(f"gateway sent an unknown reply {reply}")
            return True


def abusive_gateway_clients(address: str, rounds: int, seed: int, result: FuzzResult, pause_s: float = 2.0,
                            timeout_ms: int = 60_000) -> None:
    """The probe's clients, ``rounds`` of each: one that disconnects while its 4 long requests stream, and
    one that sends 8 long requests and reads nothing for ``pause_s`` (the server runs with a small
    ``gateway_max_unread``, so its queue fills). Reading again, that one must get every request whole
    (its last chunk's usage counts the tokens it received) or ended by a RequestFailed: none lost."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()

    def long_request(rid: str, max_tokens: int) -> bytes:
        return msgspec.msgpack.encode({"type": "Generate", "request_id": rid,
                                       "prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))],
                                       "sampling": {"max_tokens": max_tokens, "ignore_eos": True}})

    for r in range(rounds):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.connect(address)
        for i in range(4):
            sock.send(long_request(f"d{r}-{i}", 300))
        try:
            for _ in range(rng.randint(1, 6)):
                sock.recv()
            result.gateway["client disconnected mid-stream"] += 1
        except zmq.Again:
            result.failures.append("hang: a client's first replies never came")
        sock.close()

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.RCVHWM, 8)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(address)
        rids = [f"u{r}-{i}" for i in range(8)]
        for rid in rids:
            sock.send(long_request(rid, 400))
        time.sleep(pause_s)  # not reading
        received = dict.fromkeys(rids, 0)
        ended: dict[str, str] = {}
        while len(ended) < len(rids):
            try:
                reply = msgspec.msgpack.decode(sock.recv())
            except zmq.Again:
                result.failures.append(f"lost: no last reply for {sorted(set(rids) - set(ended))} of a client that "
                                       "stopped reading")
                break
            rid = reply.get("request_id")
            if rid in ended:
                result.failures.append(f"a reply after the last one of {rid}: {reply}")
            elif reply.get("type") == "RequestFailed":
                ended[rid] = f"RequestFailed {reply.get('status')}"
                if reply.get("status") != 429:
                    result.failures.append(f"a non-reading client's request ended with {reply}")
            elif reply.get("type") == "TextChunk":
                received[rid] += len(reply.get("token_ids", []))
                if reply.get("finish_reason") is not None:
                    ended[rid] = "whole"
                    if (reply.get("usage") or {}).get("completion_tokens") != received[rid]:
                        result.failures.append(f"truncated: {rid} sent {received[rid]} tokens, usage {reply['usage']}")
        for outcome in ended.values():
            result.gateway[f"client that stopped reading: {outcome}"] += 1
        sock.close()


def greedy_probe(url: str, model: str, headers: dict[str, str] | None = None) -> list[str]:
    """Greedy text of a few fixed prompts: must be the same before and after the fuzz."""
    out = []
    for prompt in ("The quick brown fox", "Paris is", "0 1 2 3"):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0.0, "ignore_eos": True},
                       headers=headers or {}, timeout=60)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def wait_all_blocks_free(url: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    from tests.server_utils import kv_blocks

    while time.monotonic() < deadline:
        free, total = kv_blocks(url)
        if free == total:
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Model to serve.")
    parser.add_argument("--tiny-model", metavar="DIR", help="Build (once) and serve the tests' tiny random Llama.")
    parser.add_argument("--bodies", type=int, default=16_000)
    parser.add_argument("--gateway-messages", type=int, default=4_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--abusive-rounds", type=int, default=50,
                        help="Rounds of a client disconnecting mid-stream and one that stops reading.")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.server_utils import EngineServer

    model = args.model
    if args.tiny_model:
        from tests.conftest import make_tiny_model

        path = Path(args.tiny_model)
        if not (path / "config.json").exists():
            make_tiny_model(path, "llama")
        model = str(path)
    if model is None:
        parser.error("give --model or --tiny-model")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        gateway = f"ipc://{tmp}/gw.sock"
        server = EngineServer(["--model", model, "--num-kv-blocks", "512", "--gateway", gateway,
                               "--gateway-max-unread", str(GATEWAY_MAX_UNREAD)], Path(tmp))
        try:
            server.wait_ready()
            before = greedy_probe(server.url, model)
            pids = server.descendants()
            result = FuzzResult()
            t0 = time.monotonic()
            import threading

            rude = FuzzResult()
            abusive = threading.Thread(target=abusive_gateway_clients,
                                       args=(gateway, args.abusive_rounds, args.seed, rude))
            abusive.start()  # beside the rest of the fuzz, which must not notice it
            asyncio.run(fuzz_http(server.url, model, args.bodies, args.seed, result, args.concurrency))
            fuzz_gateway(gateway, args.gateway_messages, args.seed, result)
            abusive.join()
            result.gateway.update(rude.gateway)
            result.failures += rude.failures
            elapsed = time.monotonic() - t0
            report = result.as_dict()
            report.update(seconds=round(elapsed, 1), bodies=args.bodies, gateway_messages=args.gateway_messages,
                          abusive_rounds=args.abusive_rounds, abusive_messages=12 * args.abusive_rounds,
                          seed=args.seed, all_processes_alive=server.descendants() == pids and server.proc.poll() is None,
                          greedy_unchanged=greedy_probe(server.url, model) == before,
                          all_kv_blocks_free=wait_all_blocks_free(server.url))
        finally:
            server.stop()
    print(json.dumps(report, indent=2))
    ok = not report["failures"] and report["all_processes_alive"] and report["greedy_unchanged"] \
        and report["all_kv_blocks_free"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
