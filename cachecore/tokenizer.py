"""Tokenization shared by the gateway, the simulated replicas and the benchmarks.

Prefix keys only mean something when the gateway's token ids equal the engine's, so every
component tokenizes through this one module. The built-in tokenizer is a real HuggingFace
``tokenizers`` byte-level BPE shipped as ``cachecore/data/tokenizer.json`` (no download), with a
ChatML chat template; ``kvgate tokenizer --export DIR`` writes both in the layout HF loaders
(and the peer routers) expect. A real model's tokenizer.json plus its chat template plugs in
through :meth:`HFTokenizer.from_dir`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import random
import re
import shutil
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from functools import cached_property
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from cachecore.chatformat import (
    ContentFormat,
    ContentFormatOption,
    detect_content_format,
    resolve_content_format,
)
from cachecore.laxbool import lax_bool

BUILTIN_NAME = "kvgate-builtin-bpe"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"


_log = logging.getLogger(__name__)

# from this length on, HFTokenizer.encode runs without the GIL (worth a thread hand-off)
UNLOCKED_ENCODE_CHARS = 4096


# texts the segment cache checks itself on (and the gateway's start-up alignment check)
PROBE_PROMPT = "kvgate alignment probe: the quick brown fox jumps over 13 lazy dogs."
PROBE_PAIR = "a second text, as a cross-encoder's document."
PROBE_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "kvgate alignment probe: say hello."},
]


def with_special_tokens(tok: Tokenizer, ids: list[int]) -> list[int]:
    """``ids`` (a text's :meth:`Tokenizer.encode`) as the engine tokenizes that text with
    ``add_special_tokens``: the tokenizer's :attr:`~Tokenizer.special_affixes` around it."""
    prefix, suffix = tok.special_affixes
    return [*prefix, *ids, *suffix] if prefix or suffix else ids


def with_pair_special_tokens(tok: Tokenizer, first: list[int], second: list[int]) -> list[int]:
    """Two texts' ids (each its :meth:`Tokenizer.encode`) as the engine tokenizes the pair
    with ``add_special_tokens`` (``tokenizer(text_1, text_pair=text_2)``, vLLM 0.33's
    cross-encoder prompt): the pair template's :attr:`~Tokenizer.pair_affixes` before,
    between and after them."""
    before, between, after = tok.pair_affixes
    return [*before, *first, *between, *second, *after]


def truncated_pair(tok: Tokenizer, first: list[int], second: list[int], keep: int) -> list[int]:
    """A text pair (each text's :meth:`Tokenizer.encode`) as vLLM 0.33 tokenizes it under
    ``truncate_prompt_tokens`` ``keep`` (``get_score_prompt``: ``tokenizer(text_1,
    text_pair=text_2, truncation=True, max_length=keep)``): HF tokenizers'
    ``longest_first`` strategy fits the two texts into ``keep`` less the pair template's
    special tokens, shortening the longer text down to the shorter's length, then both to
    half each (the second text the odd token when they tie, the longer one else); each
    text loses its last tokens (vLLM loads a pooling model's tokenizer with
    ``truncation_side="right"``), the special tokens kept. With ``keep`` below them the
    tokenizer cuts nothing, and vLLM's token truncation keeps the pair's first ``keep``
    ids. Its length is the gateway's ``min(size, keep)`` either way."""
    budget = keep - tok.pair_special_tokens
    n1, n2 = len(first), len(second)
    if budget < 0:
        return with_pair_special_tokens(tok, first, second)[:keep]
    if n1 + n2 > budget:
        short, long_ = min(n1, n2), max(n1, n2)
        long_ = short if short > budget else max(short, budget - short)
        if short + long_ > budget:
            short, long_ = budget // 2, budget // 2 + budget % 2
        n1, n2 = (long_, short) if n1 > n2 else (short, long_)
    return with_pair_special_tokens(tok, first[:n1], second[:n2])


def doc_limited_pair(
    tok: Tokenizer, first: list[int], second: list[int], keep: int, per_doc: int
) -> list[int] | None:
    """A text pair under ``truncate_prompt_tokens`` ``keep`` and ``max_tokens_per_doc``
    ``per_doc`` (> 0) as vLLM 0.33's cross-encoder tokenizes it (``get_score_prompt``):
    it asks the tokenizer for ``truncation="only_second"`` at ``min(len(first) +
    per_doc + the pair's special tokens, keep)`` when the first text and the special
    tokens fit below that, so the document alone loses its last tokens; None when they do
    not (the ``longest_first`` of :func:`truncated_pair` then). Same length either way."""
    special = tok.pair_special_tokens
    limit = min(len(first) + per_doc + special, keep)
    if len(first) + special >= limit:
        return None
    return with_pair_special_tokens(tok, first, second[: limit - len(first) - special])


def truncate_text_to_tokens(tok: Tokenizer, text: str, max_tokens: int) -> str:
    """vLLM 0.33's ``truncate_text_to_tokens`` (``pooling/scoring/utils.py``), what its
    ``max_tokens_per_query`` / ``max_tokens_per_doc`` do to each query and document before
    pairing or templating: the text cut at the character where its ``max_tokens``-th token
    ends (or the next one starts, if sooner), by the tokens' offsets, again until it
    tokenizes to at most ``max_tokens`` (no special tokens)."""
    if max_tokens <= 0:
        return ""
    while text:
        ids, offsets = tok.encode_offsets(text)
        if len(ids) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: len(text) - 1 if end >= len(text) else end]
    return text


SCORE_TOKEN_LIMITS = ("max_tokens_per_query", "max_tokens_per_doc")
"""vLLM 0.33's ``ScoringRequestMixin`` fields (``int``, default 0: no limit) that cut each
query, and each document, to that many tokens before it is paired or templated."""


def check_score_token_limit(name: str, value: int, max_model_len: int | None) -> None:
    """vLLM 0.33's ``ScoringIOProcessor._validate_token_limit`` for a non-zero limit: its
    ValueError (a 400 with no ``param``) as a :class:`TokenizerError`; the context bound
    only where it is known."""
    if value < 0:
        raise UnnamedFieldError(f"{name} must be a non-negative integer")
    if max_model_len is not None and value >= max_model_len:
        raise UnnamedFieldError(
            f"{name} ({value}) must be less than max_model_len ({max_model_len})."
        )


def truncate_score_pairs(
    tok: Tokenizer, pairs: Sequence[tuple[str, str]], per_query: int, per_doc: int
) -> list[tuple[str, str]]:
    """The (query, document) pairs of a /score or /rerank request with each query cut to
    ``per_query`` tokens and each document to ``per_doc`` (0: left whole) by
    :func:`truncate_text_to_tokens`, as vLLM 0.33 cuts them before any pairing, template
    or per-text embedding; each distinct text cut once. One reading for the gateway's
    charge and the simulated replica's prompts."""
    cut: dict[tuple[str, int], str] = {}

    def one(text: str, limit: int) -> str:
        if limit <= 0:
            return text
        got = cut.get((text, limit))
        if got is None:
            got = cut[(text, limit)] = truncate_text_to_tokens(tok, text, limit)
        return got

    return [(one(a, per_query), one(b, per_doc)) for a, b in pairs]


@dataclass(frozen=True, slots=True)
class Truncation:
    """What of a prompt the engine keeps: its last ``keep`` tokens (``left``, vLLM's
    default), or its first (vLLM's ``truncate_prompt_tokens`` / ``truncation_side``): the
    gateway keys what the engine runs, and the simulated replica runs it, by this one
    rule."""

    keep: int
    left: bool = True

    def kept(self, n: int) -> slice:
        """The part of ``n`` ids (token ids as given: no special tokens added) kept."""
        if n <= self.keep:
            return slice(0, n)
        return slice(n - self.keep, n) if self.left else slice(0, self.keep)

    def text(self, ids: list[int], affixes: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """A text's ids, with the special tokens added around them (add_special_tokens;
        ``((), ())`` when none), as the engine's tokenizer truncates them: it keeps the
        special tokens and shortens the text between them."""
        if len(ids) <= self.keep:
            return ids
        prefix, suffix = affixes
        inner = self.keep - len(prefix) - len(suffix)
        if not (prefix or suffix) or inner <= 0:
            return ids[self.kept(len(ids))]
        text = ids[len(prefix) : len(ids) - len(suffix)]
        return [*prefix, *text[Truncation(inner, self.left).kept(len(text))], *suffix]


class TokenizerError(ValueError):
    """A prompt or message list that cannot be tokenized (bad shape, bad template)."""


class UnnamedFieldError(TokenizerError):
    """A refusal vLLM answers as a 400 naming no field (a ValueError or TypeError of its
    scorer or of transformers): its text is vLLM's, its ``param`` null."""


class NamedFieldError(TokenizerError):
    """A refusal whose 400 names a field its text does not quote first (vLLM's
    ``parameter``, such as ``tool_choice.function.name``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def option_param(exc: TokenizerError) -> str | None:
    """The field vLLM's 400 names for a refused chat or score option: the one its text
    quotes first (``'tools' must be an array``, vLLM's `` `tools` must not be...``),
    none for an :class:`UnnamedFieldError`, its own for a :class:`NamedFieldError`. One
    rule for the gateway and the replica."""
    if isinstance(exc, NamedFieldError):
        return exc.param
    text = str(exc)
    if isinstance(exc, UnnamedFieldError) or text[:1] not in ("'", "`"):
        return None
    return text.split(text[0])[1]


EMPTY_TOOLS = (
    "`tools` must not be an empty array. "
    "Either provide at least one tool or omit the field entirely."
)  # vLLM 0.33's text (ChatCompletionRequest.check_tool_usage)


def check_chat_tools(body: Mapping[str, Any]) -> None:
    """vLLM 0.33's first refusal of a chat completion (and ``/v1/chat/completions/render``),
    ``ChatCompletionRequest.check_tool_usage``: ``tools: []`` is a 400 naming ``tools``
    whatever ``tool_choice`` says (checked before it). ``/tokenize`` renders an empty one
    (``create_tokenize`` hands ``[]`` to ``preprocess_chat``, which lays it over the
    server's default kwargs: their ``tools`` not rendered), as does a Responses request
    whose tools are all of vLLM's built-in types; a Responses ``tools: []`` renders
    none (``construct_tool_dicts``). Then the ``tool_choice`` it refuses
    (:func:`_check_chat_tool_choice`)."""
    if body.get("tools") == []:
        raise TokenizerError(EMPTY_TOOLS)
    _check_chat_tool_choice(body)


_NAMED_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _check_chat_tool_choice(body: Mapping[str, Any]) -> None:
    """The rest of vLLM 0.33's ``ChatCompletionRequest.check_tool_usage`` (a
    before-validator: ahead of the fields' types), its texts and ``parameter``s: a
    ``tool_choice`` other than null or ``"none"`` without ``tools``; one not ``"auto"``,
    ``"required"`` or an object; an object whose ``function`` is no object, has no
    ``name``, or a name that is no non-empty string or names no tool. Tools vLLM's check
    cannot read (no list of ``{function: {name}}``: a TypeError or KeyError there, not its
    400) are left to the later refusals."""
    if "tool_choice" not in body:
        return  # "auto" with tools, nothing to check
    choice = body["tool_choice"]
    if choice is None or choice == "none":
        return
    tools = body.get("tools")
    if tools is None:
        raise NamedFieldError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not isinstance(choice, dict):
        if choice in ("auto", "required"):
            return
        raise NamedFieldError(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise NamedFieldError(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_CHOICE_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise NamedFieldError(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_CHOICE_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise NamedFieldError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_CHOICE_USAGE}",
            "tool_choice.function.name",
        )
    if not isinstance(tools, list):
        return
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            return  # vLLM's check fails on it, not as this 400
        if fn["name"] == name:
            return
    raise NamedFieldError(
        "The tool specified in `tool_choice` does not match any of the specified `tools`",
        "tool_choice",
    )


class Tokenizer(Protocol):
    """What the gateway and the replica need from a tokenizer."""

    name: str
    special_tokens: dict[str, str]  # the template variables transformers adds (bos_token...)

    def encode(self, text: str) -> list[int]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> str: ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> list[int]: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def special_affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    @property
    def pair_affixes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]: ...

    @property
    def pair_special_tokens(self) -> int: ...


# content part types whose text vLLM renders, and the field that holds it
TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


# content part types that carry media, which vLLM feeds to a multimodal encoder
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
     "audio_embeds", "video_url"}
)  # fmt: skip

# the keys by which vLLM's parser finds a media item in a part it does not read by its type
# (chat_utils._parse_chat_message_content_mm_part: a part without a type, or with a uuid)
MEDIA_PART_KEYS = frozenset(
    {"image_url", "image_pil", "image_embeds", "audio_embeds", "prompt_embeds", "audio_url",
     "input_audio", "video_url"}
)  # fmt: skip

# what a client's uuid goes upstream as: this prefix and an HMAC of it (scope_media_uuids)
SCOPED_UUID_PREFIX = "kvg1:"


def _is_media(part: Any) -> bool:
    """Whether vLLM reads ``part`` as a media item: by a media ``type``; or, when its
    request model does not validate the part as text (no type, an unknown one, or a
    text-like type without a string text: pydantic's union then picks a type-less param
    such as CustomChatCompletionContentSimpleImageParam, dropping ``type``), by a media
    key, which vLLM's parser then reads as the item (``{"type": "text", "image_url":
    null, "uuid": U}`` is an image there). A text part with its text is text: the model
    drops its other keys."""
    if not isinstance(part, Mapping):
        return False
    kind = part.get("type")
    if not isinstance(kind, str):
        kind = None
    if kind in MEDIA_PART_TYPES:
        return True
    field = TEXT_PART_FIELDS.get(kind) if kind is not None else None
    if field is not None and isinstance(part.get(field), str):
        return False
    return not MEDIA_PART_KEYS.isdisjoint(part.keys())


def strip_media(messages: Any) -> tuple[Any, int]:
    """``messages`` without their media parts, and how many there were (then copies; else
    the very list). What the gateway tokenizes to size a multimodal request it routes by
    load: it cannot key the media as the engine does."""
    if not isinstance(messages, list):
        return messages, 0
    found = 0
    out: list[Any] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            media = sum(map(_is_media, content))
            if media:
                found += media
                msg = {**msg, "content": [p for p in content if not _is_media(p)]}
        out.append(msg)
    return (out, found) if found else (messages, 0)


def media_uuids(messages: Any) -> bool:
    """Whether any content part of ``messages`` carries a ``uuid`` (vLLM's field: the
    item's hash in its multimodal caches, which no cache_salt scopes): its type aside, as
    :func:`scope_media_uuids` rewrites it whatever the type. A batch of conversations
    (:func:`is_conversation_batch`): any conversation's."""
    if not isinstance(messages, list):
        return False
    if is_conversation_batch(messages):
        return any(map(media_uuids, messages))
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("uuid") is not None:
                    return True
    return False


def scope_media_uuids(messages: Any, salt: str) -> Any:
    """``messages`` with the string ``uuid`` of every object content part, whatever its
    type, replaced by ``kvg1:`` + HMAC-SHA256(``salt``, uuid) (copies of the messages and
    parts changed, the rest shared; the very object when there is none). vLLM takes a
    client's uuid as the item's hash in its processor and encoder caches, unsalted, and
    serves a part with no data but a uuid from them: one scope's uuid must never name
    another scope's item. Every part, not only the media types: vLLM reads a uuid from a
    part with no type, and from a "text" part without its text, as an item's; a uuid
    that vLLM drops (on a text part with its text) loses nothing scoped. A uuid that is
    not a string is left as it is: vLLM's model takes ``str | None`` and drops or refuses
    any other, so it never names an item.

    ``salt``: the scope's salt under the primary secret (``SaltMinter.salt(scope)``,
    ``Dispatch.salts[0]``), whatever salt the request is served under. During a secret
    rotation a scope's requests carry the salt of either secret (the one the replica
    holds its prefix under), and a uuid keyed by that would get two names, so a
    reference without data could miss the item its own scope sent; the primary's salt
    names a scope the same on the render call and the generation, for the whole rotation
    (a new primary renames every uuid once, as it renews every salt). It is the scope's
    name only to a holder of the secret, and no new key material: the salt is what
    scopes the engine's prefix cache already.

    A batch of conversations (:func:`is_conversation_batch`, an embeddings request's): each
    conversation so (a copy of the batch when any changed)."""
    if not isinstance(messages, list):
        return messages
    if is_conversation_batch(messages):
        scoped = [scope_media_uuids(c, salt) for c in messages]
        changed = any(a is not b for a, b in zip(scoped, messages, strict=True))
        return scoped if changed else messages
    key = salt.encode()
    out: list[Any] = []
    changed = False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and isinstance(p.get("uuid"), str) for p in content
        ):
            parts = [
                {**p, "uuid": _scoped_uuid(key, p["uuid"])}
                if isinstance(p, Mapping) and isinstance(p.get("uuid"), str)
                else p
                for p in content
            ]
            msg = {**msg, "content": parts}
            changed = True
        out.append(msg)
    return out if changed else messages


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is one chat conversation: a non-empty list of objects each with a
    string ``role`` (vLLM 0.33's ``_is_chat_messages``, ``pooling/embed/protocol.py``)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in value)
    )


def is_conversation_batch(value: Any) -> bool:
    """Whether ``value`` is a batch of chat conversations: a non-empty list of
    conversations (:func:`is_conversation`; vLLM 0.33's ``_is_batched_chat_messages``,
    ``pooling/embed/protocol.py``). A token-id batch (``[[1, 2]]``) or one with an empty
    list (``[[]]``) is none."""
    return isinstance(value, list) and bool(value) and all(map(is_conversation, value))


def embedding_chat_input(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """An embeddings request as vLLM 0.33 runs a conversation, or a batch of them, in its
    ``input``: its union members ``EmbeddingChatInputRequest`` and
    ``EmbeddingBatchChatInputRequest`` copy such an ``input`` into ``messages`` when there
    are none, and the completion form refuses it, so the chat form runs (rendered as
    ``messages`` are: the chat template, no generation prompt, no special tokens by
    default; a batch one engine request per conversation); with ``messages`` given too,
    those run (the input is then not copied: see the gateway's pooling sizing). The body
    with ``input`` read so (dropped, and ``messages`` set from it when absent); else the
    very body. Embeddings only: vLLM's /pooling and /classify unions have no such members
    (a 400)."""
    conversation = body.get("input")
    if not (is_conversation(conversation) or is_conversation_batch(conversation)):
        return body
    out = {k: v for k, v in body.items() if k != "input"}
    out.setdefault("messages", conversation)
    return out


def _scoped_uuid(key: bytes, uuid: str) -> str:
    # surrogatepass: a lone surrogate (which some JSON parsers let through) is hashed, not
    # an encoding error on the request path
    mac = hmac.new(key, uuid.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return SCOPED_UUID_PREFIX + mac.hexdigest()[:32]


def message_text(content: Any) -> str:
    """Flatten an OpenAI message ``content`` (string or list of parts) to text, as vLLM does
    for a string-content chat template: the text of every text-like part (text,
    input_text, output_text, refusal, thinking; a bare string too), empty ones dropped,
    joined by newlines.

    Media parts (images, audio, video) carry no tokens in this gateway; they are rejected
    rather than silently dropped, because dropping them would make the gateway's tokens
    disagree with a multimodal engine's. So is a text-like part that vLLM reads as media
    (no string text, a media key: see ``_is_media``); the gateway strips both kinds
    first (:func:`strip_media`) and routes such a request by load.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(text for text in _content_texts(content) if text)


def message_parts(content: Any) -> list[dict[str, Any]]:
    """An OpenAI message ``content`` as vLLM 0.33 hands it to an openai-format chat
    template (``parse_chat_message_content`` with ``wrap_dicts``): a list of
    ``{"type": "text", "text": ...}`` parts, one for each text-like part (its type, be it
    ``input_text``, ``refusal`` or ``thinking``, rendered as ``text``) and for a bare
    string, empty texts kept (a string template drops them); a string content is one
    part, an absent one none. Media parts are refused as :func:`message_text` refuses
    them. A part whose text is null is dropped (vLLM skips a ``text`` or ``refusal``
    one; it reads the other types only as its request model validates them). The
    request model drops a text part's other keys, so vLLM's extra fields are none."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": t} for t in _content_texts(content) if t is not None]


def _content_texts(content: Any) -> list[str | None]:
    """The text of each part of a list ``content``, in order (None: a text part without
    one), its parts checked as :func:`message_text` says."""
    if not isinstance(content, list):
        raise TokenizerError("message content must be a string or a list of parts")
    out: list[str | None] = []
    for part in content:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping):
            kind = part.get("type")
            field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
            if field is None and isinstance(kind, str) and kind in MEDIA_PART_TYPES:
                raise TokenizerError(
                    f"unsupported content part type: {kind!r} (kvgate routes text; "
                    "media parts are not supported)"
                )
            if field is None:
                # no text part, nor one of the media types the gateway strips first
                # (strip_media): the gateway's own 400 for a typo such as "image",
                # which must not tell the client that media is refused
                raise TokenizerError(
                    f"unsupported content part type: {kind!r} (text parts: "
                    f"{', '.join(TEXT_PART_FIELDS)}; media parts: "
                    f"{', '.join(sorted(MEDIA_PART_TYPES))})"
                )
            if _is_media(part):  # typed as text, read by the engine as media
                raise TokenizerError(
                    f"content part {kind!r} without a string {field!r} carries media "
                    "fields, which the engine reads as a media part (kvgate routes "
                    "text; media parts are not supported)"
                )
            text = part.get(field)
            if text is not None and not isinstance(text, str):
                raise TokenizerError(f"content part {kind!r}: {field!r} must be a string")
        else:
            raise TokenizerError("message content parts must be objects or strings")
        out.append(text)
    return out


def _message_content(role: str, content: Any, content_format: ContentFormat) -> Any:
    """A message's ``content`` as vLLM 0.33 hands it to a template in ``content_format``:
    a string (:func:`message_text`), or parts (:func:`message_parts`), except a tool
    message's, whose text parts vLLM joins back into one string by newlines, empty ones
    kept (``parse_chat_message_content``: most templates render a tool result as a
    string)."""
    if role == "system":
        content = _without_billing_header(content)
    if content_format == "string":
        return message_text(content)
    parts = message_parts(content)
    if role == "tool":
        return "\n".join(p["text"] for p in parts)
    return parts


BILLING_HEADER = "x-anthropic-billing-header"
"""The first line of the system prompt Claude Code sends: its ``cch`` value changes on
every request, so vLLM 0.33 drops it (``_strip_claude_code_billing_header``)."""


def _without_billing_header(content: Any) -> Any:
    """A system message's ``content`` as vLLM 0.33 parses it: each string or ``text``
    part whose text starts with :data:`BILLING_HEADER` loses its first line (the part
    dropped when nothing follows it); any other content is the very one. Otherwise the
    header's ever-changing line would start every prompt, and no block of one request
    would key as another's, where the engine caches them alike."""
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return content
    out: list[Any] = []
    changed = False
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        changed = True
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out if changed else content


def normalize_messages(
    messages: Any, content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """Validate an OpenAI ``messages`` array and return it as vLLM hands it to a chat
    template of ``content_format`` (:mod:`cachecore.chatformat`): ``role`` and
    ``content`` (text, or a list of text parts: :func:`_message_content`), plus an
    assistant's ``tool_calls`` (arguments as an object, an empty list dropped) and
    ``reasoning``, a tool's ``tool_call_id``, a developer's ``tools``, and any string
    ``name``."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TokenizerError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizerError(f"messages[{i}].role must be a non-empty string")
        content = _message_content(role, msg.get("content"), content_format)
        conv: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if calls is not None:
                calls = _tool_calls(calls, i)
                if calls:
                    conv["tool_calls"] = calls
            reasoning = msg.get("reasoning")
            if reasoning is not None:
                conv["reasoning"] = conv["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            conv["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            conv["name"] = msg["name"]
        if role == "developer":
            conv["tools"] = msg.get("tools")
        out.append(conv)
    return out


def chat_completion_messages(messages: list[Any]) -> list[Any]:
    """A chat completion's ``messages`` as vLLM 0.33's ``ChatCompletionRequest`` reads them
    (``_normalize_messages_before``): a message's deprecated ``reasoning_content`` is its
    ``reasoning`` when that is absent or null (clients send a thinking model's answers
    back so), which the template then renders. A copy where one is renamed; else the
    very list. vLLM's other chat forms (/tokenize, pooling, Responses) do not read it."""
    out = list(messages)
    changed = False
    for i, msg in enumerate(out):
        if not isinstance(msg, Mapping) or msg.get("reasoning_content") is None:
            continue
        renamed = {k: v for k, v in msg.items() if k != "reasoning_content"}
        if renamed.get("reasoning") is None:
            renamed["reasoning"] = msg["reasoning_content"]
        out[i] = renamed
        changed = True
    return out if changed else messages


def _tool_calls(calls: Any, i: int) -> list[Any]:
    """An assistant's tool calls with their arguments as the object chat templates (and
    vLLM, before it renders) expect (:func:`_tool_call_arguments`)."""
    if not isinstance(calls, list):
        raise TokenizerError(f"messages[{i}].tool_calls must be an array")
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise TokenizerError(f"messages[{i}].tool_calls entries need a 'function' object")
        fn = dict(call["function"])
        fn["arguments"] = _tool_call_arguments(fn.get("arguments"), i)
        out.append({**call, "function": fn})
    return out


def _tool_call_arguments(args: Any, i: int) -> dict[str, Any]:
    """A tool call's ``arguments`` string as vLLM 0.33 hands it to the template: the JSON
    object it holds, else ``{}`` (empty, not JSON, or JSON that is no object, ``null``
    included: vLLM coerces these, with a warning, so a malformed call in a conversation's
    history does not fail its every later turn). Not a string (absent, null, an object) is
    refused, as vLLM's request model refuses it (``function.arguments`` is a string)."""
    if not isinstance(args, str):
        raise TokenizerError(f"messages[{i}].tool_calls: function.arguments must be a string")
    if not args:
        return {}
    try:
        parsed = json.loads(args)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


ChatForm = Literal["chat", "tokenize", "responses", "pooling"]
"""Which vLLM 0.33 request renders a chat, each passing the template its own parameters
(:meth:`ChatOptions.from_body`): a chat completion (and ``/v1/chat/completions/render``),
``/tokenize`` with ``messages``, a Responses request, a pooling request's chat form."""


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The request fields besides the messages that change a rendered chat, as vLLM
    passes them to the template: tool and document definitions, a final assistant message
    to continue instead of a new turn, and extra template variables."""

    tools: list[Any] | None = None
    documents: list[Any] | None = None
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return _views_reduced(self)  # a server's bare options hold a read-only view

    @classmethod
    def from_body(
        cls,
        body: Mapping[str, Any],
        form: ChatForm = "chat",
        server: ServerChatDefaults | None = None,
    ) -> ChatOptions | None:
        """The options of a chat request body of ``form`` as vLLM 0.33 renders it on a
        server started with ``server``'s flags (none given: :data:`VLLM_SERVER`). One rule
        for the gateway's sizing and keys and the simulated replica's prompt. vLLM hands
        ``apply_chat_template`` one dict of keywords (``renderers/params.py``):
        ``build_chat_params`` lays the request's own fields over ``chat_template_kwargs``
        (``merge_kwargs``: a None or ``"auto"`` value no override), then ``with_defaults``
        lays that over the top-level ``tools`` (``preprocess_chat``'s defaults, with
        ``tokenize``) over the server's default kwargs. So a kwargs ``tools`` wins over the
        request's, which wins over the server's, while a chat completion's ``documents``
        and ``reasoning_effort`` (with ``enable_thinking``, mapped by the server's effort
        map, :func:`effort_template_kwargs`) win over the kwargs' ones; ``/tokenize`` has
        neither field (an extra, ignored: the kwargs' render), nor has a pooling chat form
        ``tools`` or the server's defaults (:meth:`for_pooling`). The second merge drops
        the kwargs' None and ``"auto"`` values, a Responses request's too: the server's
        default kwargs are never empty (:class:`ServerChatDefaults`), so its first
        ``with_defaults`` drops them as well. ``continue_final_message`` and
        ``add_generation_prompt`` are always the request's own. A chat completion's tools
        under ``tool_choice`` "none" are not rendered on a server that excludes them
        (:meth:`ServerChatDefaults.excludes_tools`)."""
        if form == "chat":
            check_chat_tools(body)
        # a /tokenize (or Responses) [] is rendered, over the server's default tools:
        # preprocess_chat's merge_kwargs drops only None and "auto" (check_chat_tools)
        tools = body.get("tools") if form != "pooling" else None
        docs = body.get("documents") if form == "chat" else None
        effort = body.get("reasoning_effort") if form in ("chat", "responses") else None
        cont, kwargs = body.get("continue_final_message"), body.get("chat_template_kwargs")
        # vLLM's pooling IO processors pass no server defaults (template_kwargs None)
        srv = None if form == "pooling" else server or VLLM_SERVER
        if tools is None and docs is None and not cont and not kwargs and effort is None:
            return None if srv is None else srv.bare  # None: the common case
        if tools is not None and not isinstance(tools, list):
            raise TokenizerError("'tools' must be an array")
        if tools is not None and form != "responses":  # a Responses reader dumps its own
            tools = chat_completion_tools(tools)
            if form == "chat" and srv is not None and srv.excludes_tools(body.get("tool_choice")):
                tools = None  # validated, not rendered (a Responses reader drops its own)
        if docs is not None and not isinstance(docs, list):
            raise TokenizerError("'documents' must be an array")
        effort_map = None if srv is None else srv.effort_map
        kw = dict(effort_template_kwargs(kwargs, effort, effort_map) or {})
        kw = {k: v for k, v in kw.items() if not _unset_kwarg(v)}
        if srv is not None and srv.under:
            kw = {**srv.under, **kw}
        kw.pop("continue_final_message", None)  # apply_chat_template's own, no variable
        _tokenize_kwargs(kw, body)
        kw_tools, kw_docs = kw.pop("tools", None), kw.pop("documents", None)
        if not _unset_kwarg(kw_tools) or tools is None:
            tools = kw_tools
            if tools is not None and not isinstance(tools, list):
                # transformers' apply_chat_template takes a list of schemas (a 400 in vLLM)
                raise TokenizerError("'chat_template_kwargs' tools must be an array")
        if tools is None and srv is not None:
            tools = srv.tools  # under the request's (merge_kwargs drops its None)
        if docs is None:
            docs = kw_docs
        if tools is None and docs is None and not cont and not kw:
            return None
        return cls(tools, docs, bool(cont), kw or None)

    @classmethod
    def for_pooling(cls, body: Mapping[str, Any]) -> ChatOptions | None:
        """The options of a pooling request's chat form (embeddings, ``/pooling``,
        ``/classify``) as vLLM 0.33 renders it: its request models
        (``ChatRequestOptionsMixin``) declare no ``tools``, ``documents`` or
        ``reasoning_effort`` and allow extra fields, so those are ignored, not refused,
        and its IO processors default ``tools`` to None; the kwargs as ``/tokenize``'s
        (:meth:`from_body`)."""
        return cls.from_body(body, "pooling")


def chat_completion_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """A chat completion's (or chat ``/tokenize``'s) ``tools`` as vLLM 0.33 hands them to
    the template: each validated as its ``ChatCompletionToolsParam`` and passed as its
    ``model_dump()`` (``render_chat``, ``create_tokenize``): ``{type: "function",
    function: {name, description, parameters[, strict][, defer_loading]}[,
    defer_loading]}``, a missing description or parameters null, a tool's top-level
    ``defer_loading`` also its function's unless that sets one, other keys dropped. The
    function is dumped by the Responses reader's rule (``FunctionDefinition``, one
    place); what the model refuses is a :class:`TokenizerError`."""
    from cachecore.responses import ResponsesInputError, _function_definition, _lax_bool

    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise TokenizerError(f"'{where}' must be a function tool")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TokenizerError(f"'{where}.function.name' must be a string")
        try:
            dumped = _function_definition(dict(fn), f"{where}.function", fn["name"])
            defer = _lax_bool(tool.get("defer_loading"), f"{where}.defer_loading")
        except ResponsesInputError as exc:
            raise TokenizerError(str(exc)) from None
        item: dict[str, Any] = {"type": "function", "function": dumped}
        if defer is not None:
            dumped.setdefault("defer_loading", defer)
            item["defer_loading"] = defer
        out.append(item)
    return out


_TOKENIZE_PARAMS = (
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "tokenizer_kwargs", "sanitize_control_tokens", "return_assistant_tokens_mask",
)  # fmt: skip
"""transformers 5's ``apply_chat_template`` parameters that shape its tokenization: vLLM
0.33 passes a chat's kwargs to it as keywords, so these are never template variables."""


def _tokenize_kwargs(kw: dict[str, Any], body: Mapping[str, Any]) -> None:
    """Take out of a chat's template variables ``kw`` what vLLM 0.33 hands transformers
    as ``apply_chat_template``'s own tokenization parameters, and refuse what the gateway
    cannot charge as the engine runs it. ``render_messages`` (``renderers/hf.py``) splats
    the kwargs into ``safe_apply_chat_template``, so a kwargs ``tokenize`` (over the
    ``tokenize=False`` default of every chat form) becomes its ``tokenize`` parameter;
    ``padding``, ``truncation``, ``max_length``, ``tokenizer_kwargs``, ``return_tensors``
    and ``sanitize_control_tokens`` pass ``resolve_chat_template_kwargs`` (transformers'
    base parameters) and ``return_dict`` is forced False (``get_apply_chat_template_kwargs``).
    A truthy ``tokenize`` makes transformers return the rendered text's ids, encoded with
    ``add_special_tokens=False`` and those options (the request's ``add_special_tokens``
    then unused: the prompt is tokens). Alone that is the chat's ordinary charge; with
    padding, truncation, tokenizer kwargs, tensors, control-token sanitizing or the
    request's special tokens it is not, and those turn on the tokenizer's
    ``tokenizer_config.json`` (pad token, padding and truncation sides,
    ``model_max_length``) and its Python ``__call__``, which kvgate does not load: a 400
    naming ``chat_template_kwargs`` before any charge (vLLM would prefill, say, a
    ``max_length`` of pad tokens the gateway never counted). A key that collides with an
    argument vLLM or transformers passes (``conversation``, ``messages``...) is their
    TypeError, which vLLM answers as a 400 with its text and no param."""
    _refuse_render_arguments(kw)
    _refuse_self_kwarg(kw)  # a base parameter resolve_chat_template_kwargs lets through
    given = {k: kw.pop(k) for k in _TOKENIZE_PARAMS if k in kw}
    _refuse_assistant_mask(given)  # vLLM forces return_dict=False
    _refuse_messages_kwarg(kw)  # every chat template reads it
    tokenize = bool(given.get("tokenize"))
    if given.get("sanitize_control_tokens") and not tokenize:
        raise UnnamedFieldError(
            "`sanitize_control_tokens=True` requires `tokenize=True` and is not compatible "
            "with `return_assistant_tokens_mask=True`."
        )
    if not tokenize:
        return  # transformers ignores the rest when it returns text
    try:
        # vLLM's request model reads the flag (a lax bool) before anything is rendered:
        # one it refuses (" no", 2) is that 400, not this one
        special_on = bool(lax_bool(body.get("add_special_tokens")))
    except ValueError:
        raise TokenizerError("'add_special_tokens' must be a boolean") from None
    shaping = [
        k
        for k in ("padding", "truncation", "tokenizer_kwargs", "sanitize_control_tokens")
        if given.get(k) not in (None, False, "do_not_pad", {})
    ]
    if given.get("return_tensors") is not None:
        shaping.append("return_tensors")
    if (
        "truncation" in given
        and given["truncation"] is None
        and given.get("max_length") is not None
        and given.get("padding", False) is False
    ):
        # a server's default kwarg keeps a None value (from_body), and transformers'
        # _get_padding_truncation_strategies turns truncation None with a max_length and
        # padding False into longest_first: the engine runs the prompt cut at max_length
        shaping.append("truncation")
    if shaping or special_on:
        what = ", ".join(shaping) if shaping else "add_special_tokens"
        raise TokenizerError(
            f"'chat_template_kwargs' tokenize with {what} is not supported by the gateway: "
            "it cannot count the tokens the engine would run"
        )


def _unset_kwarg(value: Any) -> bool:
    """vLLM's ``merge_kwargs`` ``unset_values`` (None, "auto"): such an override is not set."""
    return value is None or (isinstance(value, str) and value == "auto")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""vLLM's ``ReasoningEffort`` (a chat completion's ``reasoning_effort``; a Responses
request's ``reasoning.effort`` takes the same values)."""


def effort_template_kwargs(
    kwargs: Mapping[str, Any] | None, effort: Any, effort_map: Mapping[str, str] | None = None
) -> Mapping[str, Any] | None:
    """The template variables of a request with a reasoning effort, as vLLM's
    ``build_chat_params`` (chat completions and Responses alike) merges them: the
    request's ``chat_template_kwargs``, then ``reasoning_effort`` (the request's wins),
    and ``enable_thinking: effort != "none"`` unless the request's kwargs set it (so a
    template that gates thinking on it thinks when asked to). A template that reads
    neither renders as without them. The effort is the request's as the server's
    ``--reasoning-effort-map`` (``effort_map``) rewrites it (``map_reasoning_effort``),
    after the request model checked the request's; mapped to ``"auto"`` it is no
    override (``merge_kwargs``). Kwargs that are no object are refused, effort or not (a
    caller merges more into them)."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TokenizerError("'chat_template_kwargs' must be an object")
    if effort is None:
        return kwargs
    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
        raise TokenizerError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
    if effort_map:
        effort = effort_map.get(effort, effort)
    merged = dict(kwargs or {})
    if not _unset_kwarg(effort):
        merged["reasoning_effort"] = effort
    if kwargs is None or "enable_thinking" not in kwargs:
        merged["enable_thinking"] = effort != "none"
    return merged


VLLM_COHERE_FORMAT = "cmd4"
"""vLLM 0.33's ``--cohere-format`` default, which ``resolve_default_chat_template_kwargs``
sets as a default kwarg of every server (under ``--default-chat-template-kwargs``'s)."""


@dataclass(frozen=True, slots=True)
class ServerChatDefaults:
    """What a vLLM 0.33 server lays under every chat's template kwargs
    (:meth:`ChatOptions.from_body`), but a pooling request's: its
    ``--default-chat-template-kwargs`` as ``resolve_default_chat_template_kwargs``
    (``entrypoints/common/cli_args.py``) resolves them (``kwargs``), with ``cohere_format``
    :data:`VLLM_COHERE_FORMAT` unless they set it, so never empty: a Responses request's
    None / "auto" kwargs are dropped as a chat's; and its ``--reasoning-effort-map`` (a chat
    completion's and a Responses request's effort). That derived ``cohere_format`` is not
    rendered (``under``): vLLM's HF renderer passes a template only the variables it reads
    (``resolve_chat_template_kwargs``), and it is the Cohere renderer's selector, read by no
    HF template known; ``--cohere-format`` is not modelled (its value set in the defaults is
    rendered). And its ``--exclude-tools-when-tool-choice-none`` (:meth:`excludes_tools`).
    Built by :meth:`of`, which refuses what vLLM refuses at start-up or on every chat."""

    kwargs: Mapping[str, Any]
    effort_map: Mapping[str, str]
    tools: list[Any] | None  # the defaults' tools: under a request's top-level ones
    under: Mapping[str, Any]  # the rest, under a request's kwargs (tokenize: vLLM's False)
    bare: ChatOptions | None  # the options of a request that sets none
    exclude_tools_when_tool_choice_none: bool = False

    def excludes_tools(self, tool_choice: Any) -> bool:
        """Whether a chat completion's or Responses request's own tools go unrendered:
        vLLM 0.33's ``--exclude-tools-when-tool-choice-none`` with ``tool_choice`` "none"
        (``OnlineRenderer.render_chat``'s and ``construct_tool_dicts``' None, so the
        defaults' tools are rendered, or the kwargs' tools). ``/tokenize`` never applies
        it (``create_tokenize``: no ``tool_choice``), nor a pooling chat form."""
        return self.exclude_tools_when_tool_choice_none and tool_choice == "none"

    def __deepcopy__(self, memo: dict[int, Any]) -> ServerChatDefaults:
        # immutable (read-only views, which deepcopy cannot copy): pydantic deep-copies a
        # policy's default ModelsPolicy, whose shared default ModelPool caches this
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled policy carries its pools' cached chat_defaults (pickle cannot take a
        # read-only view: rebuilt as one)
        return _views_reduced(self)

    @classmethod
    def check_field(cls, field: str, value: Any) -> None:
        """A settings field's check (``default_chat_template_kwargs`` or
        ``reasoning_effort_map``, a policy pool's or the replica's): a ``ValueError`` with
        what :meth:`of` refuses, as pydantic's validators report it."""
        try:
            if field == "reasoning_effort_map":
                cls.of(effort_map=value)
            else:
                cls.of(value)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def of(
        cls,
        kwargs: Mapping[str, Any] | None = None,
        effort_map: Mapping[str, str] | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> ServerChatDefaults:
        """A :class:`TokenizerError` saying why vLLM would not serve with these flags, or
        would refuse every chat with them."""
        check_reasoning_effort_map(effort_map)
        if kwargs is not None and (
            not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)
        ):
            raise TokenizerError("must be a JSON object of template variables")
        try:
            json.dumps(kwargs, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"must hold JSON values only: {exc}") from None
        given = dict(kwargs or {})
        if "chat_template" in given:
            # get_apply_chat_template_kwargs lays the --chat-template (None: dropped) over
            # it, and safe_apply_chat_template renders the chat with it as the template
            raise TokenizerError(
                "'chat_template' is no template variable: vLLM renders every chat with it "
                "as the template (unless --chat-template is set); make it the tokenizer "
                "directory's chat_template.jinja instead"
            )
        under = {k: v for k, v in given.items() if k not in ("tools", "tokenize")}
        tools = given.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TokenizerError("'tools' must be an array (transformers iterates it)")
        bare_kw = dict(under)
        bare_kw.pop("continue_final_message", None)
        if bare_kw:  # what fails every chat in vLLM (VLLM_SERVER, made at import, has none)
            try:
                _tokenize_kwargs(bare_kw, {})
            except TokenizerError as exc:  # vLLM's 400 text, read at start-up: say so
                raise TokenizerError(
                    f"vLLM refuses every chat with these defaults: {exc}"
                ) from None
        docs = bare_kw.pop("documents", None)
        bare = None
        if tools is not None or docs is not None or bare_kw:
            bare = ChatOptions(tools, docs, False, MappingProxyType(bare_kw) if bare_kw else None)
        full = {"cohere_format": VLLM_COHERE_FORMAT, **given}
        # read-only: one server's defaults are shared by all its requests
        return cls(
            MappingProxyType(full),
            MappingProxyType(dict(effort_map or {})),
            tools,
            MappingProxyType(under),
            bare,
            exclude_tools_when_tool_choice_none,
        )


def _views_reduced(obj: Any) -> tuple[Any, ...]:
    """``obj`` (a dataclass) for pickle, its read-only views (``MappingProxyType``, which
    pickle refuses) as dicts that :func:`_with_views` wraps again."""
    values = [getattr(obj, f.name) for f in fields(obj)]
    views = tuple(i for i, v in enumerate(values) if isinstance(v, MappingProxyType))
    plain = tuple(dict(v) if i in views else v for i, v in enumerate(values))
    return _with_views, (type(obj), plain, views)


def _with_views(cls: type[Any], values: tuple[Any, ...], views: tuple[int, ...]) -> Any:
    return cls(*(MappingProxyType(v) if i in views else v for i, v in enumerate(values)))


def check_reasoning_effort_map(effort_map: Any) -> None:
    """vLLM 0.33's ``validate_reasoning_effort_map``: an object of strings keyed by
    reasoning efforts (its start-up refusal, as a :class:`TokenizerError`)."""
    if effort_map is None:
        return
    if not isinstance(effort_map, Mapping) or not all(
        isinstance(value, str) for value in effort_map.values()
    ):
        raise TokenizerError("must be a JSON object mapping reasoning efforts to strings")
    if unknown := sorted(set(effort_map) - set(REASONING_EFFORTS)):
        raise TokenizerError(
            f"has unknown efforts {unknown}; keys must be one of {list(REASONING_EFFORTS)}"
        )


VLLM_SERVER = ServerChatDefaults.of()
"""A vLLM 0.33 server started with neither flag."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter (Jinja's own escapes HTML, which templates do not
    expect and engines do not render)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates may use
    to mark assistant text: rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's extension API

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> Any:
        return caller()


def chat_template_env() -> jinja2.Environment:
    """The Jinja environment a chat template renders in as transformers renders it (what
    vLLM runs): its options, filters and globals; a template written for it renders the
    engine's text only so."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(
    env: jinja2.Environment, source: str, what: str
) -> tuple[jinja2.nodes.Template, jinja2.Template]:
    """``source`` parsed and compiled in ``env``; a :class:`TokenizerError` saying ``what``
    does not compile, and why, when it does not: jinja2's TemplateSyntaxError, or the
    SyntaxError Python's compile() raises on the code jinja2 generated (``{% break %}``
    outside a loop, a macro naming one argument twice), which jinja2 lets through as it
    is. vLLM 0.33 starts with either and answers each chat (or score) it renders with a
    400 (renderers/hf.py safe_apply_chat_template): refused here at load, both alike."""
    try:
        parsed = env.parse(source)
        return parsed, env.from_string(parsed)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"{what} does not compile: {exc}") from exc
    except SyntaxError as exc:  # its line is the generated code's, not the template's
        raise TokenizerError(f"{what} does not compile: {exc.msg}") from exc


_SCORER_RESERVED = ("chat_template", "tools", "tokenize")
"""``chat_template_kwargs`` keys vLLM 0.33's scorer refuses (``get_score_prompt``)."""


def score_template_kwargs(body: Mapping[str, Any], rendered: bool = True) -> dict[str, Any]:
    """A /score or /rerank request's template variables as vLLM 0.33 reads them
    (``ScoringRequestMixin``): ``chat_template_kwargs``, with ``instruction`` folded in
    unless it names one; a field of another type (its model's, every request), or a key
    the scorer reserves (when a template is ``rendered``), is a :class:`TokenizerError`
    naming the field first."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TokenizerError("'chat_template_kwargs' must be an object")
    out = dict(kwargs or {})
    instruction = body.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str):
            raise TokenizerError("'instruction' must be a string")
        out.setdefault("instruction", instruction)
    reserved = sorted(set(_SCORER_RESERVED) & out.keys()) if rendered else []
    if reserved:  # vLLM's ValueError quotes the set: a 400 with no param
        raise UnnamedFieldError(
            "chat_template_kwargs contains reserved keys that conflict with fixed scorer "
            "arguments: {" + ", ".join(map(repr, reserved)) + "}"
        )
    return out


_APPLY_CHAT_TEMPLATE_PARAMS = frozenset(
    {"self", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
"""transformers 5's ``apply_chat_template`` parameters (vLLM 0.33's
``_get_hf_base_chat_template_params``): kwargs it passes on whatever the template reads."""


def _refuse_render_arguments(kwargs: Mapping[str, Any]) -> None:
    """A kwarg named as one of ``safe_apply_chat_template``'s positional arguments, which
    vLLM 0.33 splats the kwargs into (a chat's ``render_messages``, a score template's
    ``get_score_prompt``, before any filtering): Python's TypeError for the first such
    key, answered by vLLM as a 400 with no param."""
    for key in kwargs:
        if key in ("model_config", "tokenizer", "conversation"):
            raise UnnamedFieldError(
                f"safe_apply_chat_template() got multiple values for argument '{key}'"
            )


def _refuse_self_kwarg(kwargs: Mapping[str, Any]) -> None:
    """A ``self`` kwarg, which vLLM 0.33 passes (a chat's or a score template's) to its
    tokenizer's bound ``apply_chat_template``: Python's TypeError, whose text names the
    method by its qualified name, answered by vLLM as a 400 with no param. That method is
    vLLM's, not transformers': ``HfRenderer`` swaps a fast tokenizer's class for the
    ``TokenizerPool`` that ``maybe_make_thread_pool`` (``tokenizers/hf.py``) defines, whose
    ``apply_chat_template(self, *args, **kwargs)`` receives the call first."""
    if "self" in kwargs:
        raise UnnamedFieldError(
            "maybe_make_thread_pool.<locals>.TokenizerPool.apply_chat_template() got multiple "
            "values for argument 'self'"
        )


def _refuse_assistant_mask(kwargs: Mapping[str, Any]) -> None:
    """A truthy ``return_assistant_tokens_mask`` (a chat's or a score template's kwargs):
    transformers 5 refuses it for a rendering vLLM 0.33 asks as text, ``return_dict``
    False (its ValueError, answered by vLLM as a 400 with no param)."""
    if kwargs.get("return_assistant_tokens_mask"):
        raise UnnamedFieldError(
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`"
        )


def _refuse_messages_kwarg(kwargs: Mapping[str, Any]) -> None:
    """A ``messages`` kwarg (a chat's or a score template's): every template is rendered
    with the conversation as ``messages``, so ``render_jinja_template``'s call of the
    template's ``render`` gets it twice (Python's TypeError, vLLM's 400 with no param)."""
    if "messages" in kwargs:
        raise UnnamedFieldError(
            "jinja2.environment.Template.render() got multiple values for keyword argument "
            "'messages'"
        )


def _refused_score_kwargs(kwargs: Mapping[str, Any]) -> None:
    """What transformers 5 refuses of a score template's kwargs (those that vLLM 0.33's
    ``resolve_chat_template_kwargs`` lets through), in its order: a keyword that collides
    with an argument ``apply_chat_template``, ``render_jinja_template`` or the template's
    ``render`` is given (Python's TypeError), an assistant mask asked of a text rendering,
    documents that are no list of objects. vLLM answers each a 400 with the exception's
    text and no param (``safe_apply_chat_template``: ``VLLMValidationError``)."""
    _refuse_self_kwarg(kwargs)
    if "conversations" in kwargs:
        raise UnnamedFieldError(
            "transformers.utils.chat_template_utils.render_jinja_template() got multiple "
            "values for keyword argument 'conversations'"
        )
    _refuse_assistant_mask(kwargs)
    if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt"):
        raise UnnamedFieldError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final "
            "message, and add_generation_prompt when you want to add a header that "
            "will prompt it to start a new assistant message instead."
        )
    docs = kwargs.get("documents")
    if docs is not None:
        if not isinstance(docs, (list, str, Mapping)):
            raise UnnamedFieldError(f"'{type(docs).__name__}' object is not iterable")
        if not all(isinstance(d, Mapping) for d in docs):
            raise UnnamedFieldError(
                "Documents should be a list of dicts with 'title' and 'text' keys!"
            )
    _refuse_messages_kwarg(kwargs)


class ScoreTemplate:
    """A template a cross-encoder's scoring renders each (query, document) pair with:
    vLLM 0.33's ``CrossEncoderIOProcessor.get_score_prompt`` with a chat template (the
    server's ``--chat-template``, or the one a Sentence Transformers config names: Qwen3
    rerankers) renders ``[{role: query, content}, {role: document, content}]`` with it
    (transformers' ``apply_chat_template``, ``tokenize=False``, no generation prompt,
    the request's ``chat_template_kwargs`` and ``instruction`` as variables) and
    tokenizes the text with the special tokens added (``add_special_tokens=True``:
    :func:`with_special_tokens`), truncated as one text. One rendering for the gateway's
    charge and the simulated replica's prompt."""

    def __init__(self, source: str) -> None:
        self.source = source
        env = chat_template_env()
        # parsed once: compiled and read for its variables
        parsed, self._template = compile_template(env, source, "score template")
        # what vLLM's resolve_chat_template_kwargs lets through besides
        # apply_chat_template's own parameters: the variables the template reads
        self._reads = frozenset(jinja2.meta.find_undeclared_variables(parsed))

    def render(self, tok: Tokenizer, query: str, document: str, kwargs: Mapping[str, Any]) -> str:
        """One pair's text (:meth:`render_pairs`)."""
        return self.render_pairs(tok, [(query, document)], kwargs)[0]

    def render_pairs(
        self, tok: Tokenizer, pairs: Sequence[tuple[str, str]], kwargs: Mapping[str, Any]
    ) -> list[str]:
        """Each (query, document) pair's text. The request's kwargs are the same for every
        pair: checked (vLLM refuses them at its first pair) and laid out as variables once;
        with no pair, nothing is checked, as nothing is rendered."""
        if not pairs:
            return []
        # vLLM passes the kwargs to apply_chat_template as keywords: the ones it takes as
        # its own parameters (add_generation_prompt, documents, continue_final_message)
        # are set by them, not left at the scorer's defaults; a key neither a parameter
        # nor read by the template is dropped (resolve_chat_template_kwargs), after
        # safe_apply_chat_template's own arguments were bound
        _refuse_render_arguments(kwargs)
        kwargs = {
            k: v for k, v in kwargs.items() if k in _APPLY_CHAT_TEMPLATE_PARAMS or k in self._reads
        }
        _refused_score_kwargs(kwargs)
        variables: dict[str, Any] = {**tok.special_tokens, "documents": None}
        variables["add_generation_prompt"] = False
        variables.update(kwargs)
        for name in _APPLY_CHAT_TEMPLATE_PARAMS - {"documents", "add_generation_prompt"}:
            variables.pop(name, None)  # apply_chat_template's own, not template variables
        cont = kwargs.get("continue_final_message", False)
        variables["tools"] = None
        texts: list[str] = []
        for query, document in pairs:
            variables["messages"] = [
                {"role": "query", "content": query},
                {"role": "document", "content": document},
            ]
            try:
                text = str(self._template.render(**variables))
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"score template failed: {exc}") from exc
            texts.append(_cut_after_final_message(text, document) if cont else text)
        return texts


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer plus a Jinja chat template, rendered in the
    content format vLLM would render it in: ``content_format`` as vLLM's
    ``--chat-template-content-format`` takes it (``auto``: detected from the template,
    :mod:`cachecore.chatformat`)."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        chat_template: str,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.chat_template_source = chat_template
        # vLLM 0.33's _detect_developer_role_support: a template that never names the
        # role has developer messages rendered as system ones
        self._developer_role = '"developer"' in chat_template or "'developer'" in chat_template
        # the template variables transformers adds (bos_token, eos_token, ...)
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        env = chat_template_env()
        self._template = compile_template(env, chat_template, "chat template")[1]
        self.detected_content_format: ContentFormat = detect_content_format(env, chat_template)
        self.content_format_option: ContentFormatOption = content_format
        self.content_format = resolve_content_format(content_format, self.detected_content_format)
        if self.content_format != self.detected_content_format:  # vLLM warns so too
            _log.warning(
                "chat template content format set to %s, detected as %s",
                self.content_format,
                self.detected_content_format,
                extra={"tokenizer": name},
            )
        eos = self._tok.token_to_id(EOS_TOKEN)
        if eos is None:
            eos = self._tok.token_to_id("<|endoftext|>")
        self._eos = int(eos) if eos is not None else 0

    @classmethod
    def from_files(
        cls,
        tokenizer_json: Path,
        chat_template: str,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> HFTokenizer:
        tok = _HFTokenizer.from_file(str(tokenizer_json))
        return cls(tok, chat_template, name, special_tokens, content_format)

    def with_content_format(self, content_format: ContentFormatOption) -> HFTokenizer:
        """This tokenizer and template rendered in ``content_format`` (the very one when
        it already renders under that option)."""
        if content_format == self.content_format_option:
            return self
        return HFTokenizer(
            self._tok, self.chat_template_source, self.name, self.special_tokens, content_format
        )

    @classmethod
    def from_dir(
        cls, directory: Path, name: str | None = None, content_format: ContentFormatOption = "auto"
    ) -> HFTokenizer:
        """Load ``tokenizer.json`` and the chat template from ``tokenizer_config.json``
        (or ``chat_template.jinja``) in an HF model directory."""
        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found")
        template: str | None = None
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        cfg_file = directory / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        if template is None:
            raw = cfg.get("chat_template")
            if isinstance(raw, str):
                template = raw
        if template is None:
            raise FileNotFoundError(f"no chat template in {directory}")
        special: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:  # a string, or an AddedToken dict with its content
            value = cfg.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls.from_files(tok_file, template, name or directory.name, special, content_format)

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @cached_property
    def special_affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the tokenizer's post-processor puts before and after one sequence when
        asked to add special tokens (a Llama-family BOS: ``((bos,), ())``; none for the
        built-in tokenizer). vLLM tokenizes a completion's text prompt so by default
        (``add_special_tokens`` true), a chat's rendered prompt not (its template writes
        the BOS): :func:`with_special_tokens` adds them to :meth:`encode`'s ids."""
        plain = list(self._tok.encode(PROBE_PROMPT, add_special_tokens=False).ids)
        full = list(self._tok.encode(PROBE_PROMPT, add_special_tokens=True).ids)
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return tuple(full[:i]), tuple(full[i + len(plain) :])
        # a post-processor that changes the text's own tokens: not an affix; the keys
        # of such a model's completions then start where the engine's do not (logged)
        _log.warning(
            "tokenizer adds special tokens inside the text: completions keys may miss",
            extra={"tokenizer": self.name},
        )
        return (), ()

    @cached_property
    def pair_affixes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor's pair template puts before, between and after a
        text pair (``tokenizer(text, text_pair=...)``, as vLLM 0.33's cross-encoder scoring
        tokenizes one: BERT's ``[CLS] a [SEP] b [SEP]``, RoBERTa's and XLM-R's ``<s> a
        </s></s> b </s>``; none for the built-in tokenizer), read off a probe pair's
        encoding by its sequence ids. :func:`with_pair_special_tokens` lays a pair out
        with them, and :attr:`pair_special_tokens` counts them: one reading for the
        replica's prompt and the gateway's charge."""
        enc = self._tok.encode(PROBE_PROMPT, PROBE_PAIR, add_special_tokens=True)
        parts: tuple[list[int], list[int], list[int]] = ([], [], [])
        slot = 0  # 0 before the first text, 1 after it, 2 after the second
        for tid, seq in zip(enc.ids, enc.sequence_ids, strict=True):
            if seq is None:
                parts[slot].append(tid)
            else:
                slot = max(slot, seq + 1)
        return tuple(parts[0]), tuple(parts[1]), tuple(parts[2])

    @cached_property
    def pair_special_tokens(self) -> int:
        """How many special tokens the post-processor's pair template adds to a text pair
        (:attr:`pair_affixes`: BERT's 3, RoBERTa's 4), what transformers'
        ``num_special_tokens_to_add(pair=True)`` answers (vLLM's
        ``get_num_special_tokens_for_pair``)."""
        return sum(map(len, self.pair_affixes))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        if len(text) >= UNLOCKED_ENCODE_CHARS:
            # ``encode`` holds the GIL for all its Rust work, ``encode_batch`` releases it:
            # a long prompt encoded on a worker thread then leaves the event loop free
            # (measured: a 37k-token prompt stalled the loop 32-62 ms with ``encode``)
            enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode`'s ids and each token's (start, end) character offsets in
        ``text`` (transformers' ``return_offsets_mapping``)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> str:
        """The chat as text, rendered as transformers' ``apply_chat_template`` renders it
        for vLLM: the special tokens and ``chat_template_kwargs`` as variables, ``tools``
        and ``documents``, and ``continue_final_message`` cutting the text right after the
        final message's content."""
        msgs = normalize_messages(list(messages), self.content_format)
        if not self._developer_role and any(m["role"] == "developer" for m in msgs):
            msgs = _consolidate_system_messages(_developer_as_system(msgs))
        opts = options or ChatOptions()
        if opts.continue_final_message and add_generation_prompt:
            raise TokenizerError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        variables: dict[str, Any] = {**self.special_tokens, **(opts.template_kwargs or {})}
        variables.update(
            messages=msgs,
            tools=opts.tools,
            documents=opts.documents,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            text = str(self._template.render(**variables))
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc
        if opts.continue_final_message:
            text = _cut_after_final_message(text, _final_text(msgs[-1]["content"]))
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, options))

    def id_to_token(self, token_id: int) -> str | None:
        tok = self._tok.id_to_token(token_id)
        return None if tok is None else str(tok)

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    @cached_property
    def word_vocabulary(self) -> WordVocabulary:
        return WordVocabulary.from_tokenizer(self)


SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.33's ``_convert_developer_to_system``: each developer message a system one,
    without its ``tools``."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        out.append(msg)
    return out


def _consolidate_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.33's ``_consolidate_system_messages`` (after a developer message became a
    system one): with a system message past the first place or two of them, one system
    message first, their non-empty contents joined by blank lines (a list content's
    texts by newlines), the others after it in order; else the very list."""
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    needed = False
    for i, msg in enumerate(messages):
        if msg["role"] != "system":
            rest.append(msg)
            continue
        if i > 0 or contents:
            needed = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p if isinstance(p, str) else p["text"]
                for p in content
                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p)
            )
        if content:
            contents.append(content)
    if not needed:
        return messages
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def _final_text(content: str | list[dict[str, Any]]) -> str:
    """The text ``continue_final_message`` continues: a string content, or transformers'
    pick in a list of parts, the last part with a ``text``."""
    if isinstance(content, str):
        return content
    for part in reversed(content):
        if "text" in part:
            return str(part["text"])
    raise TokenizerError(
        "continue_final_message is set but we could not find any text to continue in the "
        "final message!"
    )


def _cut_after_final_message(text: str, final: str) -> str:
    """transformers' ``continue_final_message``, rule for rule: the rendered chat up to
    the end of the final message's content, its trailing whitespace kept only when the
    content is rendered exactly as given (leading whitespace included); an empty content
    (a reasoning-only assistant turn) cuts nothing, the whole chat rendered."""
    stripped = final.strip()
    if stripped not in text:
        raise TokenizerError("continue_final_message: the final message is not in the chat")
    at = text.rindex(stripped)
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(stripped)]


def _data_path(name: str) -> Path:
    return Path(str(resources.files("cachecore").joinpath("data", name)))


def builtin_tokenizer(content_format: ContentFormatOption = "auto") -> HFTokenizer:
    """The shipped deterministic tokenizer (its ChatML template: the string format under
    ``auto``). Callers that need it often should keep the instance (loading parses a
    0.5 MB JSON file)."""
    template = _data_path("chat_template.jinja").read_text()
    return HFTokenizer.from_files(
        _data_path("tokenizer.json"), template, BUILTIN_NAME, content_format=content_format
    )


def export_builtin(directory: Path) -> list[Path]:
    """Write the built-in tokenizer as an HF model directory the peer routers can load."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    template = _data_path("chat_template.jinja").read_text()
    written = [directory / "tokenizer.json", directory / "chat_template.jinja"]
    shutil.copyfile(_data_path("tokenizer.json"), written[0])
    written[1].write_text(template)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": template,
    }
    cfg_path = directory / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    special = {"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"}
    special_path = directory / "special_tokens_map.json"
    special_path.write_text(json.dumps(special, indent=2))
    written += [cfg_path, special_path]
    return written


_WORD = re.compile(r"Ġ[a-z]{3,}")


@dataclass(frozen=True)
class WordVocabulary:
    """Words that are exactly one token each when preceded by a space.

    Concatenating ``" " + word`` pieces gives text whose token count is known exactly, which
    the workload generators need (a Mooncake hash id is 512 tokens, not 512 words).
    """

    words: tuple[str, ...]
    ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tok: HFTokenizer) -> WordVocabulary:
        pairs: list[tuple[str, int]] = []
        vocab = tok._tok.get_vocab()
        for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
            if _WORD.fullmatch(piece) and tok.encode(" " + piece[1:]) == [tid]:
                pairs.append((piece[1:], tid))
        if len(pairs) < 256:
            raise TokenizerError(f"tokenizer {tok.name} has too few single-token words")
        return cls(tuple(w for w, _ in pairs), tuple(i for _, i in pairs))

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """``n_tokens`` random single-token words, each with a leading space.

        Word ``i`` is ``words[rng.randrange(len(words))]``, drawn the way ``randrange`` draws
        it (rejection sampling on ``getrandbits``: the same words from the same seed) but
        without its two Python calls per word: workload builds draw tens of millions.
        """
        words = self.words
        n = len(words)
        k = n.bit_length()
        bits = rng.getrandbits
        out: list[str] = []
        append = out.append
        for _ in range(n_tokens):
            r = bits(k)
            while r >= n:
                r = bits(k)
            append(words[r])
        return " " + " ".join(out) if out else ""

    def text_from_ids(self, indices: Iterable[int]) -> str:
        words = self.words
        return "".join(" " + words[i % len(words)] for i in indices)


SEGMENT_CACHE_TOKENS = 1_000_000
"""Default bound of a :class:`SegmentCache` in cached token ids (~40 MB with their text)."""

OFFLOAD_CHARS = 16_384
"""Uncached text longer than this is tokenized off the event loop (~4k tokens, ~5-10 ms of
BPE on a 2-core VM; a thread hop costs ~0.1 ms)."""


class SegmentCache:
    """Exact, cached tokenization of text that contains special tokens.

    HF tokenizers split the input at added special tokens (``normalized=False``, no
    lstrip/rstrip) *before* pre-tokenization, so the ids of a rendered chat are the ids of
    each segment between special tokens, concatenated with the special ids. Segments repeat
    across requests (a shared system prompt is one segment), so caching them turns a 2,000-
    token system prompt from milliseconds of BPE into one dict probe. Enabled only when the
    tokenizer's added tokens qualify and a self-check on probes agrees with the plain path.

    Invariants (checked in tests): ``encode(text, scope) == tokenizer.encode(text)`` for
    every text and scope; the cache holds at most ``max_entries`` segments and at most
    ``max_tokens`` token ids, and ``cached_tokens`` is the number it holds (least recently
    used segments go first).

    Used by the gateway (scope: the request's isolation scope) and by the simulated replica
    (scope: the request's ``cache_salt``, as its prefix cache), whose render and tokenize
    endpoints a peer router calls for every request.

    Not thread-safe: one thread at a time (the replica holds a lock around it).

    Isolation: entries are keyed by the request's isolation scope. A hit is ~10x faster than
    a miss (a 2,000-token system prompt: ~3 ms saved), so one cache for every tenant would
    tell tenant B, through its TTFT, that another tenant recently sent the same text (the
    timing side channel the engine's salt closes, reopened in the gateway). ``scope=None``
    (a per-request scope, which can never reuse) is never cached.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_entries: int = 4096,
        min_chars: int = 256,
        max_tokens: int = SEGMENT_CACHE_TOKENS,
    ):
        self.tok = tokenizer
        self.max_entries = max_entries
        self.min_chars = min_chars  # shorter segments are not worth a cache slot
        # the memory bound: entries vary from a 64-token turn to a 30k-token document, so
        # a count alone does not bound the bytes (~40 B per cached token with its text)
        self.max_tokens = max_tokens
        self.cached_tokens = 0  # invariant: == sum of len(ids) over the entries
        self._cache: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        # admission on second sight: one-off segments (a unique user question) must not
        # evict the shared ones (a system prompt) that make the cache worth having. The
        # first sightings are a direct-mapped table of hashes, allocated whole (8 bytes a
        # slot, 128 KB at the default size): an ordered dict of them grew for half an hour
        # at soak rates before reaching its bound, ~2 MB, which read as a leak in RSS
        self._seen_once = array("q", bytes(8 * 4 * max_entries))
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
        self.special_ids: Mapping[str, int] = specials
        # how encode() cuts a text: special tokens and the pieces between them
        self.split_pattern: re.Pattern[str] | None = (
            re.compile(
                "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
            )
            if specials
            else None
        )
        self.enabled = ok and self.split_pattern is not None and self._self_check()

    def _plain(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast([text], add_special_tokens=False)[0].ids)
        return self.tok.encode(text)

    def _self_check(self) -> bool:
        probes = [PROBE_PROMPT, self.tok.apply_chat_template(PROBE_CHAT)]
        return all(self._segmented(p) == self.tok.encode(p) for p in probes)

    def _segment(self, piece: str, scope: str | None) -> list[int]:
        got = self._lookup(piece, scope)
        if got is not None:
            return got
        ids = self._plain(piece)
        self._admit(piece, scope, ids)
        return ids

    def _cacheable(self, piece: str, scope: str | None) -> bool:
        return scope is not None and len(piece) >= self.min_chars

    def _lookup(self, piece: str, scope: str | None) -> list[int] | None:
        if not self._cacheable(piece, scope):
            return None
        assert scope is not None
        key = (scope, piece)
        got = self._cache.get(key)
        if got is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return got
        self.misses += 1
        return None

    def _admit(self, piece: str, scope: str | None, ids: list[int]) -> None:
        """Cache a missed piece's ids, on its second sighting (see ``_seen_once``)."""
        if not self._cacheable(piece, scope):
            return
        assert scope is not None
        key = (scope, piece)
        h = hash(key) or 1  # 0 marks an empty slot
        seen = self._seen_once
        slot = h % len(seen)
        if seen[slot] != h:  # first sight (or its slot was taken since): remember it
            seen[slot] = h
            return
        seen[slot] = 0
        if len(ids) > self.max_tokens:
            return  # would evict everything else and still not fit
        self._cache[key] = ids
        self.cached_tokens += len(ids)
        while len(self._cache) > self.max_entries or self.cached_tokens > self.max_tokens:
            _, old = self._cache.popitem(last=False)
            self.cached_tokens -= len(old)

    def _segmented(self, text: str, scope: str | None = "") -> list[int]:
        assert self.split_pattern is not None
        out: list[int] = []
        for i, piece in enumerate(self.split_pattern.split(text)):
            if i % 2:
                out.append(self.special_ids[piece])
            elif piece:
                out.extend(self._segment(piece, scope))
        return out

    def encode(self, text: str, scope: str | None = "") -> list[int]:
        """Token ids of ``text``; ``scope`` namespaces the cache (see the class doc)."""
        if not self.enabled:
            return self._plain(text)
        return self._segmented(text, scope)

    async def encode_async(
        self, text: str, scope: str | None = "", offload_chars: int = OFFLOAD_CHARS
    ) -> list[int]:
        """:meth:`encode` for an event loop: when the text the cache does not hold is longer
        than ``offload_chars``, its BPE runs in a worker thread, so one long prompt does
        not stall every other request on the loop (a 2 MB prompt is ~1 s of BPE). The
        cache is read and written on the calling thread only (it is not thread-safe); the
        worker runs the stateless tokenizer alone. Same ids as :meth:`encode`."""
        if len(text) <= offload_chars:
            return self.encode(text, scope)
        if not self.enabled:
            return await asyncio.to_thread(self._plain, text)
        assert self.split_pattern is not None
        parts: list[list[int] | str] = []  # ids, or a missed piece to encode
        missed: list[str] = []
        for i, piece in enumerate(self.split_pattern.split(text)):
            if i % 2:
                parts.append([self.special_ids[piece]])
            elif piece:
                got = self._lookup(piece, scope)
                if got is None:
                    missed.append(piece)
                    parts.append(piece)
                else:
                    parts.append(got)
        distinct = list(dict.fromkeys(missed))  # a piece repeated in the text: BPE once
        if sum(map(len, distinct)) > offload_chars:
            encoded = await asyncio.to_thread(lambda: [self._plain(p) for p in distinct])
        else:
            encoded = [self._plain(p) for p in distinct]
        fresh = dict(zip(distinct, encoded, strict=True))
        out: list[int] = []
        for part in parts:
            if isinstance(part, str):
                ids = fresh[part]
                self._admit(part, scope, ids)
                out.extend(ids)
            else:
                out.extend(part)
        return out
