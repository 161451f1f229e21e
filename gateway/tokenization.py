"""Prompt tokenization per model pool, and the start-up alignment check.

Prefix keys only mean something if the gateway's token ids equal the engine's. A pool
tokenizes locally (the built-in tokenizer, or an HF tokenizer.json + chat template that
match the engine's) or asks the engine itself (``/v1/chat/completions/render`` or
``/tokenize``: exact, at the cost of one round trip per request).
"""

from __future__ import annotations

import array
import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, cast

import httpx
import orjson
from pydantic import Field, TypeAdapter, ValidationError

# AnswerTooLarge re-exported: the start-up checks' callers (gateway.core) catch it
from cachecore.httpread import AnswerTooLarge as AnswerTooLarge
from cachecore.httpread import read_answer
from cachecore.laxbool import lax_bool
from cachecore.tokenizer import (
    OFFLOAD_CHARS,
    PROBE_CHAT,
    PROBE_PROMPT,
    SCORE_TOKEN_LIMITS,
    SEGMENT_CACHE_TOKENS,
    VLLM_SERVER,
    ChatForm,
    ChatOptions,
    HFTokenizer,
    ScoreTemplate,
    SegmentCache,
    ServerChatDefaults,
    Tokenizer,
    TokenizerError,
    Truncation,
    builtin_tokenizer,
    chat_completion_tools,
    check_chat_tools,
    check_score_token_limit,
    effort_template_kwargs,
    option_param,
    scope_media_uuids,
    score_template_kwargs,
    truncate_score_pairs,
    with_special_tokens,
)
from gateway.errors import GatewayError, bad_request, engine_error_body, no_replica
from gateway.filewatch import FileVersion, file_version
from policies.schema import ModelPool, ModelsPolicy

log = logging.getLogger(__name__)


def _token_ids(value: Any) -> array.array[int] | None:
    """``value`` packed as uint32 if it is a list of non-negative 32-bit ints: the packing
    (in C) is the check, and the block keys hash the packed ids (no second conversion of
    the list: each costs ~100 instructions per id)."""
    if not isinstance(value, list) or not value or isinstance(value[0], bool):
        return None
    packed = array.array("I")
    try:
        # fromlist: the constructor's checks per id (the same errors), without its
        # generic sequence protocol: ~30% less for 2,048 ids
        packed.fromlist(value)
    except (TypeError, OverflowError):
        return None
    return packed


def completion_prompts(
    body: Mapping[str, Any], field: str = "prompt"
) -> list[tuple[str | list[int], array.array[int] | None]]:
    """Every prompt of a completion request, each with (for token ids only) the same ids
    packed as uint32: one for a string or a token array, each element of a batch (a list
    of strings or a list of token arrays, as vLLM's request model takes them; vLLM runs
    one engine request per element). Anything else is a 400, as the engine would answer.
    ``field``: where the prompts are (an embeddings request's ``input``, of the same
    shapes), named in the 400."""
    prompt = body.get(field)
    if isinstance(prompt, str):
        return [(prompt, None)]
    packed = _token_ids(prompt)
    if packed is not None:
        return [(cast(list[int], prompt), packed)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [(p, None) for p in prompt]
        out: list[tuple[str | list[int], array.array[int] | None]] = []
        for p in prompt:
            packed = _token_ids(p)
            if packed is None:  # a mixed batch or a bad element: vLLM's model refuses it
                break
            out.append((p, packed))
        else:
            return out
    raise bad_request(f"'{field}' must be a string, a token array, or a non-empty batch", field)


def completion_batch_size(body: Mapping[str, Any], field: str = "prompt") -> int:
    """How many prompts a completion request carries (a batch: a list of strings or of
    token arrays), read without checking them (:func:`completion_prompts` does)."""
    prompt = body.get(field)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def completion_prompt_packed(
    body: Mapping[str, Any],
) -> tuple[str | list[int], array.array[int] | None]:
    """The first prompt, and for token ids (only) the same ids packed as uint32: the one
    prompt of a request that has one (a batch is routed by load: :func:`completion_prompts`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):  # nearly every request: no list built
        return prompt, None
    return completion_prompts(body)[0]


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The first prompt (the only one but for a batch)."""
    return completion_prompt_packed(body)[0]


_INT64_MAX = 2**63 - 1
# vLLM's field: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None, read laxly (pydantic)
_TRUNCATE = TypeAdapter(Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None)
_SIDE = TypeAdapter(Literal["left", "right"] | None)
_LAX_INT = TypeAdapter(int | None)


def truncate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """``truncate_prompt_tokens`` read as vLLM's request models read it (completions and
    chats): an int >= -1 (lax: "5" and 5.0 too), null when absent. 0 keeps no token, an
    empty prompt the engine refuses: refused here. Anything else is a 400, as the engine
    would answer."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    try:
        got = (
            value
            if type(value) is int and -1 <= value <= _INT64_MAX
            else _TRUNCATE.validate_python(value)
        )
    except ValidationError:
        got = 0
    if got == 0:
        raise bad_request(
            "'truncate_prompt_tokens' must be an integer >= 1, or -1 (the model's context)",
            "truncate_prompt_tokens",
        )
    return cast(int, got)


def truncation_side(body: Mapping[str, Any]) -> bool:
    """``truncation_side`` as vLLM reads it: "left" (the default: keeps the last tokens)
    or "right" (keeps the first); True for left. Anything else is a 400."""
    value = body.get("truncation_side")
    if value is None or value == "left":
        return True
    try:
        return _SIDE.validate_python(value) != "right"
    except ValidationError:
        raise bad_request(
            "'truncation_side' must be 'left' or 'right'", "truncation_side"
        ) from None


def max_output_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """The output tokens vLLM reserves from the context when it resolves
    ``truncate_prompt_tokens: -1`` (its ``max_input_tokens`` = max_model_len - this): a
    chat's ``max_completion_tokens``, else its ``max_tokens``, else 0; a completion's
    ``max_tokens`` (16 when absent, 0 when null). A value the engine refuses counts 0:
    the request is refused before any prefill."""
    if chat:
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    else:
        value = body.get("max_tokens", 16)
    try:
        got = _LAX_INT.validate_python(value)
    except ValidationError:
        return 0
    return got or 0


def card_max_model_len(cards: Sequence[Mapping[str, Any] | None]) -> int | None:
    """The ``max_model_len`` every card (one per replica: its /v1/models entry for the
    model) gives, or None when one gives none or two differ: then the gateway cannot say
    what ``truncate_prompt_tokens: -1`` keeps."""
    seen: set[int] = set()
    for card in cards:
        value = None if card is None else card.get("max_model_len")
        if type(value) is not int or value < 1:
            return None
        seen.add(value)
    return seen.pop() if len(seen) == 1 else None


def request_truncation(
    body: Mapping[str, Any], chat: bool, max_model_len: Callable[[], int | None]
) -> tuple[Truncation | None, bool]:
    """The request's ``truncate_prompt_tokens`` and ``truncation_side`` (a 400 for what
    vLLM refuses), as the part of the prompt the engine runs, and whether the gateway
    knows that part. ``-1`` keeps vLLM's ``max_input_tokens``: ``max_model_len()`` (the
    replicas' cards) less :func:`max_output_tokens`; unknown when no card says it. What
    keeps nothing (an output reserve of the whole context) the engine refuses: unknown
    too, nothing is judged by a refusal."""
    limit = truncate_prompt_tokens(body)
    left = truncation_side(body)
    if limit is None:
        return None, True
    if limit == -1:
        context = max_model_len()
        if context is None:
            return None, False
        limit = context - max_output_tokens(body, chat)
        if limit < 1:
            return None, False
    return Truncation(limit, left), True


def add_generation_prompt(body: Mapping[str, Any]) -> bool:
    """``add_generation_prompt`` read as vLLM reads it (its request model is pydantic: a
    lax bool takes true/false, 0/1 and their usual strings), so the gateway renders the
    prompt the engine renders; anything else is a 400, as the engine would answer."""
    try:
        return _required_bool(body.get("add_generation_prompt", True))
    except ValueError:
        raise bad_request(
            "'add_generation_prompt' must be a boolean", "add_generation_prompt"
        ) from None


def continue_final_message(body: Mapping[str, Any]) -> bool:
    """``continue_final_message`` read as vLLM reads it (a lax bool, false when absent, as
    :func:`add_generation_prompt`): ``"false"`` was truthy to the chat options, so the
    gateway rendered a continued last turn the engine did not, and its tokens (and block
    keys) were not the engine's. Anything else is a 400, as the engine would answer."""
    try:
        return _required_bool(body.get("continue_final_message", False))
    except ValueError:
        raise bad_request(
            "'continue_final_message' must be a boolean", "continue_final_message"
        ) from None


def add_special_tokens(body: Mapping[str, Any], default: bool) -> bool:
    """``add_special_tokens`` read as vLLM reads it: a lax bool, true when absent for a
    completion and false for a chat (its template writes the BOS); anything else is a 400,
    as the engine would answer. True puts the tokenizer's special tokens (a Llama BOS)
    around the text's ids, as the engine does before it hashes its blocks."""
    value = body.get("add_special_tokens", default)
    try:
        return _required_bool(value)
    except ValueError:
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens") from None


def stream_requested(body: Mapping[str, Any]) -> bool:
    """``stream`` read as vLLM reads it: null or absent is not streamed, a lax bool
    otherwise (``"true"``, ``1``, ``"no"``...); anything else is a 400, as the engine
    would answer. A client's ``"stream": "true"`` streams on the engine, so the gateway
    must relay it as a stream."""
    return _lax_flag(body.get("stream"), "stream")


def usage_requested(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage`` read as vLLM reads it (a lax bool, as ``stream``):
    ``"false"`` is false there, so the usage chunk the gateway asks for is then dropped
    again; absent from an options object it is true (vLLM's ``StreamOptions`` default:
    ``{}`` or ``{"continuous_usage_stats": true}`` ask for usage), null is false; anything
    else that is no bool, or options that are no object, is a 400, as the engine would
    answer."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        # vLLM's model refuses it; the gateway would put its own object in its place
        raise bad_request("'stream_options' must be an object", "stream_options")
    if "include_usage" not in opts:
        return True
    return _lax_flag(opts["include_usage"], "stream_options.include_usage")


def pooling_truncation(
    body: Mapping[str, Any], max_model_len: Callable[[], int | None]
) -> Truncation | None:
    """An embeddings request's ``truncate_prompt_tokens`` (vLLM's pooling requests: each
    input's last k tokens; ``-1``: the model's context, no output reserved), a 400 for what
    vLLM refuses. None: the whole input (also for ``-1`` when no replica's card gives the
    context: then sized whole, an overestimate)."""
    limit = truncate_prompt_tokens(body)
    if limit is None:
        return None
    if limit == -1:
        context = max_model_len()
        return None if context is None else Truncation(context)
    return Truncation(limit)


_TOP_N = TypeAdapter(Annotated[int, Field(ge=0)])


def pooling_padding(body: Mapping[str, Any]) -> bool:
    """Whether a pooling request pads its prompts to the model's context: vLLM's
    ``padding`` (``Literal["max_length", "do_not_pad"] | None``; "max_length" pads each
    engine request, after truncation, to the context, all of which the engine computes).
    Anything else is a 400 naming it, as the engine would answer."""
    value = body.get("padding")
    if value is None or value == "do_not_pad":
        return False
    if value == "max_length":
        return True
    raise bad_request("'padding' must be 'max_length' or 'do_not_pad'", "padding")


def pair_texts(
    body: Mapping[str, Any], rerank: bool, pairs: Sequence[tuple[str, str]]
) -> list[str]:
    """The texts of a /score or /rerank request as an embedding model's score runs them
    (vLLM's ``BiEncoderIOProcessor``: the ``text_1`` side, or the query, then each pair's
    second text, each one engine request), where a cross-encoder runs one per pair. A
    1:N request's one first text runs once, N:N's each. Read after :func:`pooling_pairs`."""
    first = None if rerank else body.get("text_1")
    if isinstance(first, list) and len(first) > 1:  # N:N
        return [a for a, _ in pairs] + [b for _, b in pairs]
    return [pairs[0][0], *(b for _, b in pairs)]


_LIMIT = TypeAdapter(int)  # ScoringRequestMixin's max_tokens_per_*: int, default 0


def score_token_limits(body: Mapping[str, Any]) -> tuple[int, int]:
    """A /score or /rerank request's ``max_tokens_per_query`` and ``max_tokens_per_doc``
    as vLLM 0.33 reads them (a lax ``int``, 0 when absent; null or another type a 400
    naming the field); a negative one is its scorer's 400 (:func:`check_score_token_limit`;
    its bound by the context: :func:`check_score_limits_context`)."""
    got: list[int] = []
    for name in SCORE_TOKEN_LIMITS:
        value = body.get(name, 0)
        try:
            n = value if type(value) is int else _LIMIT.validate_python(value)
        except ValidationError:
            raise bad_request(f"'{name}' must be an integer", name) from None
        if n:
            check_score_limits_context(name, n, None)
        got.append(n)
    return got[0], got[1]


def score_fields(body: Mapping[str, Any]) -> None:
    """A /score or /rerank request's ``chat_template_kwargs`` and ``instruction`` typed as
    vLLM's request model types them (a 400 naming the field) where no score template
    renders them (:meth:`LocalPromptTokenizer.score_lengths` reads them where one does)."""
    try:
        score_template_kwargs(body, rendered=False)
    except TokenizerError as exc:
        raise _option_error(exc) from None


def check_score_limits_context(name: str, value: int, max_model_len: int | None) -> None:
    """:func:`~cachecore.tokenizer.check_score_token_limit` as the gateway's 400."""
    try:
        check_score_token_limit(name, value, max_model_len)
    except TokenizerError as exc:
        raise _option_error(exc) from None


_OTHER_SCORE_FORMS = ("queries", "documents", "items", "data_1", "data_2")
"""Fields of vLLM's other /score request forms (``queries``/``documents``,
``queries``/``items``, ``data_1``/``data_2``): its request union tries them before
``text_1``/``text_2``."""


def pooling_pairs(body: Mapping[str, Any], rerank: bool) -> list[tuple[str, str]]:
    """The text pairs of a /score request (``text_1`` against ``text_2``: 1:1, 1:N or N:N,
    as vLLM pairs them) or a /rerank request (``query`` with each of ``documents``): each
    pair one engine request of both texts. Anything else is a 400 naming the field, as the
    engine would answer (their multimodal forms too: the gateway cannot size them), and so
    is a field of vLLM's other /score forms (:data:`_OTHER_SCORE_FORMS`)."""
    if rerank:
        if "top_n" in body:
            try:  # vLLM's RerankRequest.top_n: Field(default=0, ge=0), read laxly
                _TOP_N.validate_python(body["top_n"])
            except ValidationError:
                raise bad_request(
                    "'top_n' must be an integer >= 0 (0: every document)", "top_n"
                ) from None
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str):
            raise bad_request("'query' must be a string", "query")
        if isinstance(docs, str):  # vLLM's `ScoreInput | list[ScoreInput]`: one document
            docs = [docs]
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise bad_request(
                "'documents' must be a string or a non-empty array of strings", "documents"
            )
        return [(query, d) for d in docs]
    for name in _OTHER_SCORE_FORMS:
        # vLLM's union runs such a form before the text pairs (the first member with as
        # many fields set): sizing the text pairs would charge the wrong work
        if name in body:
            raise bad_request(
                f"'{name}' belongs to a /score request form this gateway does not read: "
                "send 'text_1' and 'text_2' only",
                name,
            )
    sides: list[list[str]] = []
    for name in ("text_1", "text_2"):
        value = body.get(name)
        if isinstance(value, str):
            sides.append([value])
        elif isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            sides.append(value)
        else:
            raise bad_request(f"'{name}' must be a string or a non-empty array of strings", name)
    first, second = sides
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N", "text_2")
    return list(zip(first, second, strict=True))


def _lax_flag(value: Any, param: str) -> bool:
    """A request flag as vLLM's pydantic model reads it: null or absent is false, a lax
    bool otherwise; anything else is a 400 naming ``param``."""
    try:
        return bool(lax_bool(value))
    except ValueError:
        raise bad_request(f"'{param}' must be a boolean", param) from None


def _required_bool(value: Any) -> bool:
    """A lax bool vLLM's model declares ``bool`` (not optional): null is refused too."""
    flag = lax_bool(value)
    if flag is None:
        raise ValueError("null is not a boolean")
    return flag


class PromptTokenizer(Protocol):
    name: str

    async def chat(self, body: Mapping[str, Any], salt: str) -> list[int]: ...

    async def completion(self, body: Mapping[str, Any], salt: str) -> list[int]: ...

    async def prompt_lengths(
        self, body: Mapping[str, Any], salt: str, offload_chars: int = ..., *, field: str = ...
    ) -> list[int]: ...


def _option_error(exc: TokenizerError) -> GatewayError:
    """A refused chat option (``ChatOptions``, ``effort_template_kwargs``) as a 400 naming
    its field, which their messages quote first ("'tools' must be an array")."""
    return bad_request(str(exc), option_param(exc))


class LocalPromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, cache_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self.tok = tokenizer
        self.name = tokenizer.name
        self.segments = SegmentCache(tokenizer, max_tokens=cache_tokens)
        # the score templates of the pools this tokenizer serves, compiled once (by text)
        self._score_templates: dict[str, ScoreTemplate] = {}

    def _render(
        self,
        body: Mapping[str, Any],
        form: ChatForm = "chat",
        server: ServerChatDefaults | None = None,
    ) -> str:
        """``body``'s chat as the engine renders it for a request of ``form``, whose
        options vLLM reads as :meth:`ChatOptions.from_body` says (the simulated replica's
        rule too); ``server``: the pool's engine flags that lay defaults under them."""
        add_gen = add_generation_prompt(body)
        cont = continue_final_message(body)
        if "continue_final_message" in body and body["continue_final_message"] is not cont:
            body = {**body, "continue_final_message": cont}  # "false", 0...: the engine's bool
        try:
            opts = ChatOptions.from_body(body, form, server)
        except TokenizerError as exc:
            raise _option_error(exc) from None
        try:
            return self.tok.apply_chat_template(body.get("messages"), add_gen, opts)  # type: ignore[arg-type]
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from None

    def _special(
        self,
        ids: list[int],
        body: Mapping[str, Any],
        default: bool,
        trunc: Truncation | None = None,
    ) -> list[int]:
        """A text's ids as the engine makes them: the special tokens added when asked,
        then truncated as ``trunc`` says (the tokenizer keeps the special tokens)."""
        if not add_special_tokens(body, default):
            return ids if trunc is None else trunc.text(ids, ((), ()))
        ids = with_special_tokens(self.tok, ids)
        return ids if trunc is None else trunc.text(ids, self.tok.special_affixes)

    def chat_sync(
        self, body: Mapping[str, Any], scope: str | None = "", trunc: Truncation | None = None
    ) -> list[int]:
        return self._special(self.segments.encode(self._render(body), scope), body, False, trunc)

    def completion_sync(
        self, body: Mapping[str, Any], scope: str | None = "", trunc: Truncation | None = None
    ) -> list[int]:
        prompt = completion_prompt(body)
        if isinstance(prompt, list):  # token ids go to the engine as they are
            return prompt if trunc is None else prompt[trunc.kept(len(prompt))]
        return self._special(self.segments.encode(prompt, scope), body, True, trunc)

    async def chat(
        self,
        body: Mapping[str, Any],
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
        *,
        form: ChatForm = "chat",
        server: ServerChatDefaults | None = None,
    ) -> list[int]:
        """:meth:`chat_sync` that tokenizes long uncached text in a worker thread
        (``form``: the request that renders it, ``server``: the pool's engine flags,
        :meth:`_render`)."""
        text = self._render(body, form, server)
        ids = await self.segments.encode_async(text, scope, offload_chars)
        return self._special(ids, body, False, trunc)

    async def completion(
        self,
        body: Mapping[str, Any],
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
    ) -> list[int]:
        tokens, _ = await self.completion_packed(body, scope, offload_chars, trunc)
        return tokens

    async def completion_packed(
        self,
        body: Mapping[str, Any],
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
    ) -> tuple[list[int], Sequence[int]]:
        """:meth:`completion`, with the ids for the block keys: a token-id prompt's packed
        ids (its check built them), else the token list itself. ``trunc``: the request's
        ``truncate_prompt_tokens``, the part of the prompt the engine runs."""
        prompt, packed = completion_prompt_packed(body)
        if isinstance(prompt, str):
            tokens = await self.segments.encode_async(prompt, scope, offload_chars)
            tokens = self._special(tokens, body, True, trunc)
            return tokens, tokens
        assert packed is not None  # token ids come packed
        if trunc is not None and len(prompt) > trunc.keep:
            kept = trunc.kept(len(prompt))
            return prompt[kept], packed[kept]
        return prompt, packed

    async def prompt_lengths(
        self,
        body: Mapping[str, Any],
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
        field: str = "prompt",
    ) -> list[int]:
        """The tokens the engine runs for each prompt of a completion request (a batch:
        one engine request each; ``field``: an embeddings request's ``input``, whose
        shapes and ``add_special_tokens`` are a completion's): token arrays counted, text
        tokenized as one prompt is.
        Texts longer together than ``offload_chars`` are tokenized in one worker thread,
        as one long text is: 100,000 short prompts (1.1 MB) BPE'd one by one on the loop
        stalled it 426 ms, each under the bound alone (review V1). The thread runs the
        stateless tokenizer, not the segment cache (not thread-safe; a batch is unkeyed,
        so its texts are worth no cache slot)."""
        prompts = completion_prompts(body, field)
        add_special_tokens(body, True)  # a 400 before any work
        texts = [p for p, _ in prompts if isinstance(p, str)]
        if sum(map(len, texts)) > offload_chars:
            encode = self.tok.encode
            counted = iter(await asyncio.to_thread(lambda: [encode(t) for t in texts]))
        else:
            counted = iter(
                [await self.segments.encode_async(t, scope, offload_chars) for t in texts]
            )
        lengths: list[int] = []
        for prompt, _ in prompts:
            if isinstance(prompt, list):
                lengths.append(len(prompt) if trunc is None else min(len(prompt), trunc.keep))
            else:
                lengths.append(len(self._special(next(counted), body, True, trunc)))
        return lengths

    async def _counts(
        self, texts: Sequence[str], scope: str | None, offload_chars: int
    ) -> list[int]:
        """Each text's tokens, no special tokens: through the segment cache, or, longer
        together than ``offload_chars``, in one worker thread (:meth:`prompt_lengths`'
        rule)."""
        if sum(map(len, texts)) > offload_chars:
            encode = self.tok.encode
            return await asyncio.to_thread(lambda: [len(encode(t)) for t in texts])
        encode_async = self.segments.encode_async
        return [len(await encode_async(t, scope, offload_chars)) for t in texts]

    async def pair_lengths(
        self,
        pairs: Sequence[tuple[str, str]],
        texts: Sequence[str],
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
    ) -> tuple[list[int], list[int]]:
        """The tokens the engine runs for a /score or /rerank request, both ways a model
        scores: for each pair (:func:`pooling_pairs`) both texts' tokens with the special
        tokens of the tokenizer's pair template (a cross-encoder's ``text_pair``), or of its
        one-sequence template if more (an LLM reranker without ``use_sep_token`` runs the
        texts joined as one), and for each of ``texts`` (:func:`pair_texts`) its tokens
        with the one-sequence template's (an embedding model's, each text its own prompt);
        each at most ``trunc.keep``. Each distinct text is tokenized once; texts longer
        together than ``offload_chars`` in one worker thread, as :meth:`prompt_lengths`'."""
        distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
        size = dict(zip(distinct, await self._counts(distinct, scope, offload_chars), strict=True))
        prefix, suffix = self.tok.special_affixes
        extra = len(prefix) + len(suffix)
        pair_extra = max(extra, self.tok.pair_special_tokens)
        keep = None if trunc is None else trunc.keep

        def kept(n: int) -> int:  # truncation keeps the special tokens: min(n, k) all the same
            return n if keep is None else min(n, keep)

        return (
            [kept(size[a] + size[b] + pair_extra) for a, b in pairs],
            [kept(size[t] + extra) for t in texts],
        )

    async def truncated_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        per_query: int,
        per_doc: int,
        offload_chars: int = OFFLOAD_CHARS,
    ) -> list[tuple[str, str]]:
        """The pairs with each query and document cut as vLLM 0.33 cuts them
        (:func:`~cachecore.tokenizer.truncate_score_pairs`, the simulated replica's rule);
        texts longer together than ``offload_chars`` cut in one worker thread."""
        if not per_query and not per_doc:
            return list(pairs)
        if sum(len(a) + len(b) for a, b in pairs) > offload_chars:
            tok = self.tok
            return await asyncio.to_thread(truncate_score_pairs, tok, pairs, per_query, per_doc)
        return truncate_score_pairs(self.tok, pairs, per_query, per_doc)

    async def score_lengths(
        self,
        body: Mapping[str, Any],
        pairs: Sequence[tuple[str, str]],
        template_source: str,
        scope: str | None = "",
        offload_chars: int = OFFLOAD_CHARS,
        trunc: Truncation | None = None,
    ) -> list[int]:
        """The tokens a cross-encoder whose pairs a score template wraps runs for each
        pair (:class:`~cachecore.tokenizer.ScoreTemplate`, the simulated replica's
        rendering): the rendered text's tokens with the one-sequence special tokens, at
        most ``trunc.keep``. The request's ``chat_template_kwargs`` and ``instruction``
        are the template's variables (a 400 naming the field for what vLLM refuses).
        Texts longer together than ``offload_chars`` are tokenized in one worker thread,
        as :meth:`prompt_lengths`'."""
        template = self._score_templates.get(template_source)
        if template is None:
            if len(self._score_templates) >= 8:  # a pool's template replaced by reloads
                self._score_templates.clear()
            template = self._score_templates[template_source] = ScoreTemplate(template_source)
        try:
            kwargs = score_template_kwargs(body)
            texts = template.render_pairs(self.tok, pairs, kwargs)
        except TokenizerError as exc:
            raise _option_error(exc) from None
        counted = await self._counts(texts, scope, offload_chars)
        prefix, suffix = self.tok.special_affixes  # vLLM's scoring adds them
        extra = len(prefix) + len(suffix)
        keep = None if trunc is None else trunc.keep
        return [n + extra if keep is None else min(n + extra, keep) for n in counted]


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


_TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)
"""The fields of vLLM's chat ``/tokenize`` request that a chat completion request shares
(it has no ``documents``: :meth:`EnginePromptTokenizer.chat` sends them as a kwarg)."""


def _engine_refusal(payload: Any, text: str) -> GatewayError:
    """The engine's 400 for a prompt it will not tokenize (too long, a bad message), in its
    own words, param and type, as the proxy relays the same refusal from the engine's
    completion endpoint; text that is no error object is quoted."""
    shaped = engine_error_body(payload, 400)
    if shaped is None:
        return bad_request(f"the engine rejected the prompt: {text[:500]}")
    err = shaped["error"]
    message, param, kind = err.get("message"), err.get("param"), err.get("type")
    return GatewayError(
        400,
        message if isinstance(message, str) and message else "the engine rejected the prompt",
        param=param if isinstance(param, str) else None,
        type_=kind if isinstance(kind, str) and kind else None,
        extra={"code": err["code"]} if err.get("code") is not None else None,
    )


def _engine_busy(r: httpx.Response, payload: Any) -> GatewayError:
    """The engine's 429 or 503 (rate limited, overloaded, starting) with its Retry-After,
    as the proxy relays the same answer from the completion endpoint: the SDKs retry a
    429/503 after the engine's wait, where a 502 lost both the status and the wait."""
    shaped = engine_error_body(payload, r.status_code)
    err = shaped["error"] if shaped is not None else {}
    message, kind, code = err.get("message"), err.get("type"), err.get("code")
    retry_after = r.headers.get("retry-after")
    return GatewayError(
        r.status_code,
        message
        if isinstance(message, str) and message
        else f"engine tokenization returned {r.status_code}",
        type_=kind if isinstance(kind, str) and kind else None,
        headers={"Retry-After": retry_after} if retry_after else None,
        extra={"code": code} if code is not None else None,
    )


ENGINE_ANSWER_CAP = 64 << 20
"""The most bytes read of an engine's tokenize or render answer: the token ids (and
rendered text) of the longest prompts an engine takes are a few MiB."""


class EnginePromptTokenizer:
    """Asks a replica of the pool to tokenize (``mode`` = "render" or "tokenize").
    ``replica_url(tried)`` picks a replica's URL other than those ``tried``.

    Retries: a replica that could not be reached (connect refused or timed out, the
    connection dropped) or that answered 5xx is passed over for another (tokenizing has no
    side effects), as the proxy passes over an unreachable one for the request itself, up
    to ``ATTEMPTS`` replicas. A read timeout is not retried: that engine is alive but slow,
    and the others, under the same load, would most likely be too; retrying made the worst
    case ``ATTEMPTS`` times the timeout (6 s) before the client heard anything, and tripled
    the tokenization load on a struggling fleet. Every attempt shares one deadline,
    ``timeout_s`` from the first, so the client hears within it: a 504 when it runs out."""

    ATTEMPTS = 3

    def __init__(
        self,
        mode: str,
        client: httpx.AsyncClient,
        replica_url: Callable[[Collection[str]], str | None],
        timeout_s: float = 2.0,
        sizer: Callable[[], LocalPromptTokenizer] | None = None,
        server: ServerChatDefaults | None = None,
    ) -> None:
        """``sizer``: the local tokenizer that sizes a batch's texts (:meth:`prompt_lengths`;
        the built-in one when not given). ``server``: the pool's engines' flags that their
        /tokenize does not apply to a chat: ``--reasoning-effort-map`` (it takes no
        effort: the effort goes as a template kwarg, mapped here) and
        ``--exclude-tools-when-tool-choice-none`` (it takes no tool_choice: the tools are
        left out here); their default kwargs they lay under it themselves."""
        self.mode = mode
        self.name = f"engine_{mode}"
        self._client = client
        self._url = replica_url
        self._timeout = timeout_s
        self._sizer = sizer
        self._server = server or VLLM_SERVER

    async def _post(self, path: str, payload: Mapping[str, Any]) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):  # the whole, retries included
                r = await self._answer(path, payload, deadline, loop)
        except (TimeoutError, httpx.TimeoutException):
            raise GatewayError(
                504, f"engine tokenization timed out (after {self._timeout:g} s)", code="timeout"
            ) from None
        try:
            answer: Any = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            answer = None
        if r.status_code == 400:
            raise _engine_refusal(answer, r.text)
        if r.status_code in (429, 503):
            raise _engine_busy(r, answer)
        if r.status_code != 200:
            raise GatewayError(502, f"engine tokenization returned {r.status_code}")
        ids = _response_ids(answer)
        if ids is None:  # no JSON at all too: a 502, not an internal error with a traceback
            raise GatewayError(502, "engine tokenization returned no token ids")
        return ids

    async def _answer(
        self,
        path: str,
        payload: Mapping[str, Any],
        deadline: float,
        loop: asyncio.AbstractEventLoop,
    ) -> httpx.Response:
        """The first answer that is no 5xx, from up to ``ATTEMPTS`` replicas; the last 5xx
        when every attempt gave one. Raises a read timeout as it comes (not retried)."""
        tried: list[str] = []
        failure: Exception | None = None
        last: httpx.Response | None = None
        while len(tried) < self.ATTEMPTS:
            base = self._url(tried)
            if base is None:
                break
            tried.append(base)
            left = deadline - loop.time()
            if left <= 0:  # a connect timeout spent it: the client hears a timeout
                raise TimeoutError
            try:
                # the whole answer within what is left of the deadline, capped: one that did
                # not end (not an engine, or a broken one) was read into memory for as long
                # as the deadline let it come, per request
                r = await read_answer(
                    self._client,
                    "POST",
                    base + path,
                    json=payload,
                    timeout_s=left,
                    deadline_s=left,
                    cap=ENGINE_ANSWER_CAP,
                )
            except AnswerTooLarge as exc:
                raise GatewayError(502, f"engine tokenization {exc}") from None
            except (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                # not reached (refused, connect timed out), or the connection broke before
                # an answer (reset, closed while sending or reading): another
                failure = exc
                continue
            except httpx.TimeoutException:
                raise  # alive but slow (read, write or pool timeout): not retried
            except httpx.HTTPError as exc:
                raise GatewayError(502, f"engine tokenization failed: {exc}") from None
            if r.status_code < 500:
                return r
            last = r  # the engine could not tokenize now (starting, overloaded): another
        if last is not None:
            return last
        if tried:
            raise GatewayError(
                502, f"engine tokenization failed: {type(failure).__name__}: {failure}"
            )
        # not met by a request: prepare found a routable replica with no await since
        raise no_replica("no replica available to tokenize")

    async def chat(self, body: Mapping[str, Any], salt: str) -> list[int]:
        """``salt``: the request scope's cache salt. An engine may cache what it renders
        (the simulated replica does, per salt, as its prefix cache): without the salt every
        tenant's render would share one cache, and a hit there shows in the next tenant's
        TTFT, since routing waits for this call. The salt of the scope's primary secret
        (``SaltMinter.salt``), which also scopes the media uuids sent: vLLM's render (and
        a multimodal /tokenize) runs the multimodal processor, whose cache a uuid names
        unsalted, so a raw uuid told whether another scope's item was cached. They go as
        the generation body sends them (``Gateway.upstream_body``), one name per scope."""
        try:
            check_chat_tools(body)  # vLLM's /tokenize serves what its chat route refuses
        except TokenizerError as exc:
            raise _option_error(exc) from None
        messages = body.get("messages")
        scoped = scope_media_uuids(messages, salt)
        if scoped is not messages:
            body = {**body, "messages": scoped}
        if self.mode == "render":
            # the render endpoint takes the whole chat request: every field that changes
            # the rendering (tools, documents, template kwargs, ...) renders as it will
            return await self._post("/v1/chat/completions/render", {**body, "cache_salt": salt})
        payload = {k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}
        if "tools" in payload and self._server.excludes_tools(body.get("tool_choice")):
            try:  # the chat route validates what it then leaves out of the prompt
                chat_completion_tools(payload.pop("tools"))
            except TokenizerError as exc:
                raise _option_error(exc) from None
        docs = body.get("documents")
        if body.get("reasoning_effort") is not None or docs is not None:
            # /tokenize takes no reasoning_effort or documents (extras it ignores): as
            # template kwargs over the request's, as the chat completion passes them (a
            # 400 for a value the engine would refuse)
            try:
                kwargs = effort_template_kwargs(
                    body.get("chat_template_kwargs"),
                    body.get("reasoning_effort"),
                    self._server.effort_map,
                )
            except TokenizerError as exc:
                raise _option_error(exc) from None
            if docs is not None:
                if not isinstance(docs, list):
                    raise bad_request("'documents' must be an array", "documents")
                kwargs = {**(kwargs or {}), "documents": docs}
            payload["chat_template_kwargs"] = kwargs
        payload["cache_salt"] = salt  # vLLM's /tokenize ignores it (no cache to scope)
        return await self._post("/tokenize", payload)

    async def completion(self, body: Mapping[str, Any], salt: str) -> list[int]:
        prompt = completion_prompt(body)
        if isinstance(prompt, list):
            return prompt
        return await self._tokenize_text(body, prompt, salt)

    async def _tokenize_text(self, body: Mapping[str, Any], text: str, salt: str) -> list[int]:
        payload = {"model": body.get("model"), "prompt": text, "cache_salt": salt}
        if "add_special_tokens" in body:
            payload["add_special_tokens"] = body["add_special_tokens"]
        return await self._post("/tokenize", payload)

    async def prompt_lengths(
        self,
        body: Mapping[str, Any],
        salt: str,
        offload_chars: int = OFFLOAD_CHARS,
        field: str = "prompt",
    ) -> list[int]:
        """Each prompt's tokens of a completion request (a batch), before any truncation:
        token arrays counted, texts sized by the local ``sizer`` (the built-in tokenizer),
        not asked of the engine. One /tokenize call per text (8 at a time) made a batch's
        work linear in its length before the budget could refuse it (2,000 prompts: 1.7 s;
        review V4); a batch is routed by load, and only its budget charge and in-flight load
        read this size, so an estimate serves (docs/gateway.md says which)."""
        sizer = self._sizer() if self._sizer is not None else _builtin_sizer()
        return await sizer.prompt_lengths(body, None, offload_chars, None, field)


def _builtin_sizer() -> LocalPromptTokenizer:
    """A built-in tokenizer for an :class:`EnginePromptTokenizer` made without a sizer
    (tests, tools): :class:`TokenizerPools` passes its own, loaded once."""
    return LocalPromptTokenizer(builtin_tokenizer(), cache_tokens=0)


class TokenizerPools:
    """One tokenizer per model pool; local tokenizers are loaded once and shared."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        replica_url: Callable[[str, Collection[str]], str | None],
        cache_tokens: int = SEGMENT_CACHE_TOKENS,
    ):
        self._client = client
        self._replica_url = replica_url
        self._cache_tokens = cache_tokens  # each local tokenizer's segment cache bound
        self._sizer: LocalPromptTokenizer | None = None  # see :meth:`sizer`
        # by (tokenizer, tokenizer_dir, chat_template_content_format): _pool_key
        self._local: dict[tuple[str, str | None, str], LocalPromptTokenizer] = {}
        # each loaded hf tokenizer's files as they were read: a reload reads them again
        # only when they changed (a tokenizer updated in place)
        self._versions: dict[tuple[str, str | None, str], tuple[FileVersion | None, ...]] = {}
        # each hf directory that did not load: its files' version then, and why. The policy
        # watcher retries such a refusal: the same files are not parsed again (the parse
        # holds the GIL, ~65 ms/MB) while a file still being copied is
        self._failed: dict[str, tuple[tuple[FileVersion | None, ...], str]] = {}

    def for_pool(self, model: str, pool: ModelPool) -> PromptTokenizer:
        if pool.tokenizer in ("engine_render", "engine_tokenize"):
            mode = "render" if pool.tokenizer == "engine_render" else "tokenize"
            return EnginePromptTokenizer(
                mode, self._client, lambda tried: self._replica_url(model, tried),
                sizer=self.sizer, server=pool.chat_defaults,
            )  # fmt: skip
        return self.local(pool)

    def sizer(self) -> LocalPromptTokenizer:
        """The built-in tokenizer that sizes an engine-tokenized batch's texts, loaded once
        (parsing it takes ~30 ms); no segment cache (its texts are never cached)."""
        if self._sizer is None:
            self._sizer = LocalPromptTokenizer(builtin_tokenizer(), cache_tokens=0)
        return self._sizer

    def local(self, pool: ModelPool) -> LocalPromptTokenizer:
        key = _pool_key(pool)
        tok = self._local.get(key)
        if tok is None:
            fmt = pool.chat_template_content_format
            if pool.tokenizer == "hf" and pool.tokenizer_dir:
                # a policy the gateway applies had it loaded by load_hf: this is for a
                # TokenizerPools used without one (tests, tools)
                hf = HFTokenizer.from_dir(Path(pool.tokenizer_dir), content_format=fmt)
                tok = LocalPromptTokenizer(hf, self._cache_tokens)
            else:
                tok = LocalPromptTokenizer(builtin_tokenizer(fmt), self._cache_tokens)
            self._local[key] = tok
        return tok

    async def load_hf(self, models: ModelsPolicy) -> list[tuple[str, str]]:
        """Load every hf pool's tokenizer of ``models`` on a worker thread, before a policy
        with them is applied (at start-up and at each reload): a tokenizer.json that does
        not load (cut short, corrupt) then refuses the policy, where it was accepted and
        failed every request of its pool, each parsing the file again on the event loop.
        Returns (field, problem) pairs; when there are none, the loaded ones are what
        :meth:`local` serves (when there are, nothing changed).
        ``tokenizers`` holds the GIL while it parses, so the loop still waits for that
        part (~65 ms/MB here); the reads, the template and a failed request's retries no
        longer do."""
        problems: list[tuple[str, str]] = []
        named = [("models.default", models.default)]
        named += [(f"models.pools.{name}", pool) for name, pool in models.pools.items()]
        done: set[tuple[str, str | None, str]] = set()
        # installed only when all load: a refused policy changes nothing (a directory the
        # old policy shares would otherwise serve the new file's tokenizer already)
        staged: dict[
            tuple[str, str | None, str],
            tuple[LocalPromptTokenizer, tuple[FileVersion | None, ...]],
        ] = {}
        for field, pool in named:
            directory = pool.tokenizer_dir
            key = _pool_key(pool)
            if pool.tokenizer != "hf" or not directory or key in done:
                continue
            done.add(key)
            version = _hf_files_version(Path(directory))
            if self._versions.get(key) == version and key in self._local:
                continue
            failed = self._failed.get(directory)
            if failed is not None and failed[0] == version:
                problems.append((f"{field}.tokenizer_dir", failed[1]))
                continue
            fmt = pool.chat_template_content_format
            try:
                hf = await asyncio.to_thread(
                    HFTokenizer.from_dir, Path(directory), content_format=fmt
                )
            except Exception as exc:  # tokenizers raises a bare Exception for bad JSON
                # a chat template that does not compile is the directory's, not the file's
                tok_file = str(Path(directory) / "tokenizer.json")
                where = directory if isinstance(exc, TokenizerError) else tok_file
                problem = f"{where!r} does not load: {exc}"
                if not isinstance(exc, OSError):  # a read error may pass: tried again
                    self._failed[directory] = (version, problem)
                problems.append((f"{field}.tokenizer_dir", problem))
                continue
            self._failed.pop(directory, None)
            staged[key] = (LocalPromptTokenizer(hf, self._cache_tokens), version)
        if not problems:
            for key, (tok, version) in staged.items():
                self._local[key] = tok
                self._versions[key] = version
        return problems

    def retain(self, models: ModelsPolicy) -> None:
        """Forget the local tokenizers ``models`` no longer uses (requests in flight keep
        theirs): a reload's replaced directories are not held for ever."""
        pools = [models.default, *models.pools.values()]
        keep = {_pool_key(p) for p in pools}
        self._failed.clear()  # a policy applied: the refused directories are not held
        for key in [k for k in self._local if k not in keep]:
            del self._local[key]
            self._versions.pop(key, None)


def _pool_key(pool: ModelPool) -> tuple[str, str | None, str]:
    """What a pool's local tokenizer is loaded and kept by: its kind, directory and the
    content format it renders chats in (one directory may serve two formats)."""
    return (pool.tokenizer, pool.tokenizer_dir, pool.chat_template_content_format)


def _hf_files_version(directory: Path) -> tuple[FileVersion | None, ...]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    return tuple(file_version(directory / name) for name in names)


CHECK_ANSWER_CAP = 4 << 20
"""The most bytes a start-up check reads of an engine's answer (/metrics, /tokenize)."""


async def bounded_answer(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    timeout_s: float,
    json: Any = None,
    cap: int = CHECK_ANSWER_CAP,
) -> tuple[int, bytes]:
    """An engine's status and body for a start-up check: the whole answer within
    ``timeout_s`` (start-up awaits it) and at most ``cap`` bytes of body. Raises
    ``cachecore.httpread.AnswerTimeout`` (a ``TimeoutError``), :class:`AnswerTooLarge` or
    ``httpx.HTTPError``."""
    r = await read_answer(
        client, method, url, json=json, timeout_s=timeout_s, deadline_s=timeout_s, cap=cap
    )
    return r.status_code, r.content


async def check_alignment(
    client: httpx.AsyncClient,
    replica_url: str,
    model: str,
    tokenizer: LocalPromptTokenizer,
    timeout_s: float = 2.0,
    server: ServerChatDefaults | None = None,
) -> list[str]:
    """Compare the gateway's tokens with the engine's ``/tokenize`` for a probe prompt and
    a probe chat (rendered over ``server``'s default kwargs, the pool's, as the engine's
    /tokenize lays its own under it: an engine started with others than the policy says
    shows here when its template reads them). Returns the disagreements (empty when
    aligned or when the engine has no /tokenize endpoint, which is logged)."""
    problems: list[str] = []
    probes: Sequence[tuple[str, dict[str, Any], list[int]]] = [
        (
            "prompt",
            # as completions send it: the engine's default adds special tokens (a BOS)
            {"model": model, "prompt": PROBE_PROMPT},
            with_special_tokens(tokenizer.tok, tokenizer.tok.encode(PROBE_PROMPT)),
        ),
        (
            "chat",
            {"model": model, "messages": PROBE_CHAT, "add_generation_prompt": True},
            tokenizer.tok.encode_chat(
                PROBE_CHAT, True, ChatOptions.from_body({}, "tokenize", server)
            ),
        ),
    ]
    for name, payload, ours in probes:
        try:
            status, body = await bounded_answer(
                client, "POST", replica_url + "/tokenize", timeout_s, json=payload
            )
        except (httpx.HTTPError, TimeoutError, AnswerTooLarge) as exc:
            error = str(exc) or type(exc).__name__
            log.info("alignment check skipped", extra={"replica": replica_url, "error": error})
            return []
        if status == 404:
            log.info(
                "replica has no /tokenize: alignment unchecked", extra={"replica": replica_url}
            )
            return []
        try:
            theirs = _response_ids(orjson.loads(body)) if status == 200 else None
        except orjson.JSONDecodeError:  # a web server that is not the engine
            theirs = None
        if theirs is None:
            problems.append(f"{name}: /tokenize returned {status} and no token ids")
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
