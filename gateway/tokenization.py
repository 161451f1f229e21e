"""Prompt tokenization per model pool, and the start-up alignment check.

Prefix keys only mean something if the gateway's token ids equal the engine's. A pool
tokenizes locally (the built-in tokenizer, or an HF tokenizer.json + chat template that
match the engine's) or asks the engine itself (``/v1/chat/completions/render`` or
``/tokenize``: exact, at the cost of one round trip per request).
"""

from __future__ import annotations

import array
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from cachecore.tokenizer import HFTokenizer, Tokenizer, TokenizerError, builtin_tokenizer
from gateway.errors import GatewayError, bad_request
from policies.schema import ModelPool

log = logging.getLogger(__name__)

PROBE_PROMPT = "kvgate alignment probe: the quick brown fox jumps over 13 lazy dogs."
PROBE_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "kvgate alignment probe: say hello."},
]


def _token_ids(value: Any) -> list[int] | None:
    """``value`` as token ids if it is a list of non-negative 32-bit ints (checked in C)."""
    if not isinstance(value, list) or not value or isinstance(value[0], bool):
        return None
    try:
        array.array("I", value)
    except (TypeError, OverflowError):
        return None
    return value


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The prompt that decides routing. A batch of prompts routes by its first one."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    ids = _token_ids(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        ids = _token_ids(first)
        if ids is not None:
            return ids
    raise bad_request("'prompt' must be a string, a token array, or a non-empty batch", "prompt")


class PromptTokenizer(Protocol):
    name: str

    async def chat(self, body: Mapping[str, Any]) -> list[int]: ...

    async def completion(self, body: Mapping[str, Any]) -> list[int]: ...


class SegmentCache:
    """Exact, cached tokenization of text that contains special tokens.

    HF tokenizers split the input at added special tokens (``normalized=False``, no
    lstrip/rstrip) *before* pre-tokenization, so the ids of a rendered chat are the ids of
    each segment between special tokens, concatenated with the special ids. Segments repeat
    across requests (a shared system prompt is one segment), so caching them turns a 2,000-
    token system prompt from milliseconds of BPE into one dict probe. Enabled only when the
    tokenizer's added tokens qualify and a self-check on probes agrees with the plain path.

    Invariant: ``encode(text, scope) == tokenizer.encode(text)`` for every text and scope
    (checked in tests).

    Isolation: entries are keyed by the request's isolation scope. A hit is ~10x faster than
    a miss (a 2,000-token system prompt: ~3 ms saved), so one cache for every tenant would
    tell tenant B, through its TTFT, that another tenant recently sent the same text (the
    timing side channel the engine's salt closes, reopened in the gateway). ``scope=None``
    (a per-request scope, which can never reuse) is never cached.
    """

    def __init__(self, tokenizer: Tokenizer, max_entries: int = 4096, min_chars: int = 256):
        self.tok = tokenizer
        self.max_entries = max_entries
        self.min_chars = min_chars  # shorter segments are not worth a cache slot
        self._cache: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        # admission on second sight: one-off segments (a unique user question) must not
        # evict the shared ones (a system prompt) that make the cache worth having
        self._seen_once: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.misses = 0
        hf = getattr(tokenizer, "_tok", None)
        self._fast = getattr(hf, "encode_batch_fast", None)
        specials: dict[str, int] = {}
        ok = hf is not None
        if hf is not None:
            for tid, added in hf.get_added_tokens_decoder().items():
                if added.lstrip or added.rstrip or added.normalized or added.single_word:
                    ok = False
                specials[str(added.content)] = int(tid)
        self._specials = specials
        self._split = (
            re.compile(
                "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
            )
            if specials
            else None
        )
        self.enabled = ok and self._split is not None and self._self_check()

    def _plain(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast([text], add_special_tokens=False)[0].ids)
        return self.tok.encode(text)

    def _self_check(self) -> bool:
        probes = [PROBE_PROMPT, self.tok.apply_chat_template(PROBE_CHAT)]
        return all(self._segmented(p) == self.tok.encode(p) for p in probes)

    def _segment(self, piece: str, scope: str | None) -> list[int]:
        if len(piece) < self.min_chars or scope is None:
            return self._plain(piece)
        key = (scope, piece)
        got = self._cache.get(key)
        if got is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return got
        self.misses += 1
        ids = self._plain(piece)
        h = hash(key)
        if h not in self._seen_once:
            self._seen_once[h] = None
            if len(self._seen_once) > 4 * self.max_entries:
                self._seen_once.popitem(last=False)
            return ids
        del self._seen_once[h]
        self._cache[key] = ids
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return ids

    def _segmented(self, text: str, scope: str | None = "") -> list[int]:
        assert self._split is not None
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._specials[piece])
            elif piece:
                out.extend(self._segment(piece, scope))
        return out

    def encode(self, text: str, scope: str | None = "") -> list[int]:
        """Token ids of ``text``; ``scope`` namespaces the cache (see the class doc)."""
        if not self.enabled:
            return self._plain(text)
        return self._segmented(text, scope)


class LocalPromptTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.name = tokenizer.name
        self.segments = SegmentCache(tokenizer)

    def chat_sync(self, body: Mapping[str, Any], scope: str | None = "") -> list[int]:
        add_gen = body.get("add_generation_prompt", True)
        try:
            text = self.tok.apply_chat_template(body.get("messages"), bool(add_gen))  # type: ignore[arg-type]
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from None
        return self.segments.encode(text, scope)

    def completion_sync(self, body: Mapping[str, Any], scope: str | None = "") -> list[int]:
        prompt = completion_prompt(body)
        return prompt if isinstance(prompt, list) else self.segments.encode(prompt, scope)

    async def chat(self, body: Mapping[str, Any]) -> list[int]:
        return self.chat_sync(body)

    async def completion(self, body: Mapping[str, Any]) -> list[int]:
        return self.completion_sync(body)


def _response_ids(payload: Any) -> list[int] | None:
    """Token ids from a /tokenize or render response (vLLM shapes: ``{"tokens": [...]}``,
    ``{"prompt_token_ids": [...]}``, or a list of such objects)."""
    if isinstance(payload, list):
        if payload and all(isinstance(t, int) for t in payload):
            return list(payload)
        return _response_ids(payload[0]) if payload else None
    if isinstance(payload, Mapping):
        for key in ("tokens", "prompt_token_ids", "token_ids"):
            v = payload.get(key)
            if isinstance(v, list) and all(isinstance(t, int) for t in v):
                return list(v)
        for key in ("engine_prompt", "prompt", "data"):
            if key in payload:
                got = _response_ids(payload[key])
                if got is not None:
                    return got
    return None


class EnginePromptTokenizer:
    """Asks a replica of the pool to tokenize (``mode`` = "render" or "tokenize")."""

    def __init__(
        self,
        mode: str,
        client: httpx.AsyncClient,
        replica_url: Callable[[], str | None],
        timeout_s: float = 2.0,
    ) -> None:
        self.mode = mode
        self.name = f"engine_{mode}"
        self._client = client
        self._url = replica_url
        self._timeout = timeout_s

    async def _post(self, path: str, payload: Mapping[str, Any]) -> list[int]:
        base = self._url()
        if base is None:
            raise GatewayError(503, "no replica available to tokenize", code="no_replica")
        try:
            r = await self._client.post(base + path, json=payload, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise GatewayError(502, f"engine tokenization failed: {exc}") from None
        if r.status_code == 400:
            raise bad_request(f"the engine rejected the prompt: {r.text[:500]}")
        if r.status_code != 200:
            raise GatewayError(502, f"engine tokenization returned {r.status_code}")
        ids = _response_ids(r.json())
        if ids is None:
            raise GatewayError(502, "engine tokenization returned no token ids")
        return ids

    async def chat(self, body: Mapping[str, Any]) -> list[int]:
        payload = {
            k: body[k]
            for k in ("model", "messages", "add_generation_prompt", "chat_template_kwargs")
            if k in body
        }
        if self.mode == "render":
            return await self._post("/v1/chat/completions/render", payload)
        return await self._post("/tokenize", payload)

    async def completion(self, body: Mapping[str, Any]) -> list[int]:
        prompt = completion_prompt(body)
        if isinstance(prompt, list):
            return prompt
        return await self._post("/tokenize", {"model": body.get("model"), "prompt": prompt})


class TokenizerPools:
    """One tokenizer per model pool; local tokenizers are loaded once and shared."""

    def __init__(self, client: httpx.AsyncClient, replica_url: Callable[[str], str | None]):
        self._client = client
        self._replica_url = replica_url
        self._local: dict[tuple[str, str | None], LocalPromptTokenizer] = {}

    def for_pool(self, model: str, pool: ModelPool) -> PromptTokenizer:
        if pool.tokenizer in ("engine_render", "engine_tokenize"):
            mode = "render" if pool.tokenizer == "engine_render" else "tokenize"
            return EnginePromptTokenizer(mode, self._client, lambda: self._replica_url(model))
        return self.local(pool)

    def local(self, pool: ModelPool) -> LocalPromptTokenizer:
        key = (pool.tokenizer, pool.tokenizer_dir)
        tok = self._local.get(key)
        if tok is None:
            if pool.tokenizer == "hf" and pool.tokenizer_dir:
                tok = LocalPromptTokenizer(HFTokenizer.from_dir(Path(pool.tokenizer_dir)))
            else:
                tok = LocalPromptTokenizer(builtin_tokenizer())
            self._local[key] = tok
        return tok


async def check_alignment(
    client: httpx.AsyncClient,
    replica_url: str,
    model: str,
    tokenizer: LocalPromptTokenizer,
    timeout_s: float = 2.0,
) -> list[str]:
    """Compare the gateway's tokens with the engine's ``/tokenize`` for a probe prompt and
    a probe chat. Returns the disagreements (empty when aligned or when the engine has no
    /tokenize endpoint, which is logged)."""
    problems: list[str] = []
    probes: Sequence[tuple[str, dict[str, Any], list[int]]] = [
        (
            "prompt",
            {"model": model, "prompt": PROBE_PROMPT, "add_special_tokens": False},
            tokenizer.tok.encode(PROBE_PROMPT),
        ),
        (
            "chat",
            {"model": model, "messages": PROBE_CHAT, "add_generation_prompt": True},
            tokenizer.tok.encode_chat(PROBE_CHAT),
        ),
    ]
    for name, payload, ours in probes:
        try:
            r = await client.post(replica_url + "/tokenize", json=payload, timeout=timeout_s)
        except httpx.HTTPError as exc:
            log.info("alignment check skipped", extra={"replica": replica_url, "error": str(exc)})
            return []
        if r.status_code == 404:
            log.info(
                "replica has no /tokenize: alignment unchecked", extra={"replica": replica_url}
            )
            return []
        theirs = _response_ids(r.json()) if r.status_code == 200 else None
        if theirs is None:
            problems.append(f"{name}: /tokenize returned {r.status_code}")
        elif theirs != ours:
            problems.append(
                f"{name}: gateway has {len(ours)} tokens, engine {len(theirs)}; "
                f"first difference at {_first_diff(ours, theirs)}"
            )
    return problems


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
