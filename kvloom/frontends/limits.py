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
        if reduced == brackets:
            # Brackets that never close are not JSON, and the decoder would still recurse into every
            # one of them before it finds out: refuse them here.
            raise RequestError(400, "the request body is not valid JSON: its brackets do not balance")
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

    The rule: in a BPE tokenizer that is byte-level (without an unknown token) or has byte fallback,
    whose normalizer can only lengthen the text and whose added tokens swallow no spaces, every byte of
    the text lands in exactly one token or is dropped (a byte the vocabulary lacks), and no token covers
    more than ``max_token_bytes`` bytes (its longest vocabulary entry or added token). So a text of B
    bytes, D of them droppable, needs at least ceil((B - D) / max_token_bytes) tokens, before any
    special tokens are added. For any other tokenizer (``max_token_bytes`` is None) nothing is refused
    unseen: an unknown-word token can stand for any number of characters.
    """

    def __init__(self, tokenizer) -> None:
        self.max_token_bytes: int | None = None
        self.dropped_bytes: list[bytes] = []  # byte values no token holds (byte-level BPE drops them)
        found = _max_token_bytes(tokenizer)
        if found is not None:
            self.max_token_bytes, self.dropped_bytes = found

    def min_tokens(self, text: str) -> int:
        if self.max_token_bytes is None:
            return 0
        data = text.encode("utf-8", "surrogatepass")
        counted = len(data) - sum(data.count(b) for b in self.dropped_bytes)
        return -(-counted // self.max_token_bytes)

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
    added_tokens = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added_tokens):  # these swallow any run of spaces
        return None
    dropped: list[bytes] = []
    if _uses_byte_level(spec.get("pre_tokenizer")):
        if model.get("unk_token") is not None:  # an unknown byte would become one token of any length
            return None
        # A byte with no token of its own is dropped without an unknown token: it is not counted.
        dropped = [bytes([b]) for b, c in _byte_level_chars().items() if c not in vocab]
        longest = max((len(t) for t in vocab), default=1)  # one character per byte in byte-level vocabularies
    elif model.get("byte_fallback"):
        if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        longest = max((len(t.encode()) for t in vocab), default=1)
    else:
        return None
    added = [len(t.get("content", "").encode()) for t in added_tokens]
    return max([longest, *added, 1]), dropped


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table



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
