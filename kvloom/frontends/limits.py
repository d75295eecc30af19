"""Limits a frontend applies at its boundary, before any work is spent on a request: body size and read
time, JSON nesting depth, and a prompt length that provably cannot fit the context (no tokenizing)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import AsyncIterator

from kvloom.frontends.errors import RequestError

# OpenAI bodies nest about 5 deep (messages -> content parts); the JSON decoder recurses per level and
# raises RecursionError near 1000, so refuse deep bodies before decoding them.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise RequestError(400) when ``body`` nests arrays/objects more than ``limit`` levels deep."""
    if body.count(b"[") + body.count(b"{") <= limit:  # cannot be deeper than its number of brackets
        return
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    # Each pass removes the innermost level; what is left after ``limit`` passes is deeper than that.
    for _ in range(limit):
        reduced = _INNERMOST.sub(b"", brackets)
        if not reduced:
            return
        if reduced == brackets:  # unbalanced: not JSON; the decoder says so without recursing further
            return
        brackets = reduced
    raise RequestError(400, f"the request body nests arrays/objects more than {limit} levels deep")


async def read_body(chunks: AsyncIterator[bytes], declared_length: str | None, max_bytes: int,
                    timeout: float | None) -> bytes:
    """The whole request body, refused with 413 beyond ``max_bytes`` (as declared, or as it arrives) and
    with 408 when it has not fully arrived within ``timeout`` seconds."""
    limit_mb = max_bytes / 2**20
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > max_bytes:
        raise RequestError(413, f"the request body has {int(declared_length)} bytes, over the limit of "
                           f"max_request_body_mb={limit_mb:g}")

    async def receive() -> bytes:
        parts, size = [], 0
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(413, f"the request body is over the limit of max_request_body_mb={limit_mb:g}")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within http_body_timeout={timeout:g}s") from None


class PromptLengthBound:
    """The fewest tokens a text can encode to, from its UTF-8 length alone, where that is provable.

    The rule: if a tokenizer is lossless (every byte of the text ends up in some token: byte-level BPE
    with the full byte alphabet, or BPE with byte fallback) and its normalizer can only grow the text,
    then each token covers at most ``max_token_bytes`` bytes of the text (its longest vocabulary entry or
    added token), so a text of B bytes needs at least ceil(B / max_token_bytes) tokens, special tokens
    not counted. For any other tokenizer (``max_token_bytes`` is None) no length is refused unseen: an
    unknown-word token can stand for any number of characters.
    """

    def __init__(self, tokenizer) -> None:
        self.max_token_bytes = _max_token_bytes(tokenizer)

    def min_tokens(self, text: str) -> int:
        if self.max_token_bytes is None:
            return 0
        n = len(text)
        if n * 4 < self.max_token_bytes:  # a UTF-8 character is at most 4 bytes: nothing to refuse
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def check(self, text: str, max_model_len: int, param: str) -> None:
        """Raise RequestError(400) when ``text`` cannot leave room for one completion token."""
        need = self.min_tokens(text)
        if need >= max_model_len:
            raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens, and the "
                               f"prompt needs at least {need} tokens ({len(text)} characters; no token of this "
                               f"tokenizer covers more than {self.max_token_bytes} bytes), which leaves no "
                               "room for a completion.", param)


_GROWING_NORMALIZERS = {"Prepend"}


def _max_token_bytes(tokenizer) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _normalizer_only_grows(spec.get("normalizer")):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    if _uses_byte_level(spec.get("pre_tokenizer")):
        from tokenizers.pre_tokenizers import ByteLevel

        if not set(ByteLevel.alphabet()) <= set(vocab):  # a missing byte would be dropped, not counted
            return None
        longest = max((len(t) for t in vocab), default=1)  # one character per byte in byte-level vocabularies
    elif model.get("byte_fallback"):
        if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        longest = max((len(t.encode()) for t in vocab), default=1)
    else:
        return None
    added = [len(t.get("content", "").encode()) for t in spec.get("added_tokens") or []]
    return max([longest, *added, 1])


def _normalizer_only_grows(normalizer) -> bool:
    """True if the normalizer can only lengthen the text's bytes (None, Prepend, a Replace of a string
    by one at least as long, or a sequence of those)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_only_grows(n) for n in normalizer.get("normalizers", []))
    if kind in _GROWING_NORMALIZERS:
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        literal = pattern.get("String")
        return literal is not None and len(normalizer.get("content", "").encode()) >= len(literal.encode())
    return False


def _uses_byte_level(pre_tokenizer) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
