"""The OpenAI-compatible request and response shapes of a simulated replica (vLLM's
flavour): request parsing that ignores unknown fields, OpenAI error objects, usage with
``prompt_tokens_details.cached_tokens``, and the JSON/SSE bodies."""

from __future__ import annotations

import array
import base64
import time
from collections.abc import Sequence
from http import HTTPStatus
from typing import Annotated, Any, Literal, cast

import numpy as np
import numpy.typing as npt
import orjson
import xxhash
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from cachecore.cacheread import reads_prefix_cache
from cachecore.engine import DEFAULT_MAX_TOKENS, RequestOutput
from cachecore.tokenizer import (
    REASONING_EFFORTS,
    ChatOptions,
    ServerChatDefaults,
    Tokenizer,
    TokenizerError,
    Truncation,
    chat_completion_messages,
    check_chat_tools,
    check_score_token_limit,
    doc_limited_pair,
    embedding_chat_input,
    is_conversation_batch,
    option_param,
    truncated_pair,
    with_pair_special_tokens,
)


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.err_type = err_type or _default_type(self.status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.err_type, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def option_error(exc: TokenizerError) -> APIError:
    """A refused chat option's 400, naming the field as the gateway names it
    (``gateway.tokenization._option_error``)."""
    return APIError(str(exc), param=option_param(exc))


def _default_type(status: int) -> str:
    return {
        400: "BadRequestError",
        404: "NotFoundError",
        409: "ConflictError",
        422: "BadRequestError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_body(
    message: str, status: int, err_type: str, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _SamplingFields(BaseModel):
    """vLLM's sampling and output fields (both generation requests) that the simulated
    engine does not act on, declared with vLLM's types (its ``ChatCompletionRequest`` and
    ``CompletionRequest``: pydantic in its default lax mode, as vLLM's, so ``"0.5"`` is a
    float and ``"yes"`` a bool there too) so that a value vLLM refuses is refused here, a
    400 naming the field. Ignored, they let ``"temperature": "hot"`` through with a 200,
    and the gateway's handling of bad client input was never exercised against the
    engine's refusal. Ranges (temperature >= 0, top_p in (0, 1], ...), which vLLM checks
    in its ``SamplingParams`` and which differ between its versions, are not checked."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    seed: _INT64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    user: str | None = None
    # vLLM's scheduling priority (the engine here schedules first come, first served)
    priority: _INT64 = 0
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


class _GenerationRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Any = None  # validated by hand: vLLM's own message on a bad salt
    n: int | None = 1
    request_id: str | None = None
    prompt_logprobs: int | None = None
    echo: bool | None = False
    # vLLM's: keep the prompt's last (left) or first (right) k tokens; -1: the context
    # less the output tokens asked for (its max_input_tokens)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None

    def max_output_tokens(self) -> int:
        """What vLLM reserves of the context for the output when it resolves -1."""
        return 0

    def truncation(self, max_model_len: int) -> int | None:
        """How many prompt tokens the engine keeps (None: all), refused as vLLM refuses:
        more than the context less the output tokens, or none at all (an empty prompt)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        max_input = max_model_len - self.max_output_tokens()
        if keep > max_input:
            raise APIError(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - "
                f"max_tokens = {max_input}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if keep == -1:
            keep = max_input
        if keep < 1:
            raise APIError("The decoder prompt cannot be empty", param="truncate_prompt_tokens")
        return keep

    def truncate(
        self, ids: list[int], keep: int | None, affixes: tuple[Sequence[int], Sequence[int]]
    ) -> list[int]:
        """``ids`` as vLLM truncates them (:class:`~cachecore.tokenizer.Truncation`, the
        gateway's rule too). ``affixes``: the special tokens added around a text
        (add_special_tokens), kept while the text between them is shortened; none for
        token ids or a chat's template text."""
        if keep is None:
            return ids
        return Truncation(keep, self.truncation_side != "right").text(ids, affixes)

    def reads_prefix_cache(self) -> bool:
        """vLLM's rule (:mod:`cachecore.cacheread`): no prefix hit for prompt logprobs."""
        return reads_prefix_cache(self.prompt_logprobs, bool(self.echo), self._echo_logprobs())

    def _echo_logprobs(self) -> object:
        return None


class _ChatTemplateFields(BaseModel):
    """The fields besides the messages that change a rendered chat in every vLLM chat
    request (its pooling chat forms' too)."""

    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class _ChatRendering(_ChatTemplateFields):
    """The fields besides the messages that change a rendered chat (vLLM's)."""

    tools: list[Any] | None = None

    def _template_fields(self) -> dict[str, Any]:
        return {
            "tools": self.tools,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.chat_template_kwargs,
            # read with a kwargs tokenize (ChatOptions.from_body)
            "add_special_tokens": getattr(self, "add_special_tokens", None),
        }


def _effort(value: str) -> str:
    if value not in REASONING_EFFORTS:
        raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}")
    return value


class ChatCompletionRequest(_GenerationRequest, _ChatRendering):
    messages: list[Any] = Field(default_factory=list)
    documents: list[Any] | None = None
    # vLLM's: a template variable (with enable_thinking) for templates that read it
    reasoning_effort: Annotated[str, AfterValidator(_effort)] | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the chat template writes the BOS
    top_logprobs: int | None = 0  # vLLM's default: echo alone asks for prompt logprobs
    logprobs: bool | None = False  # a chat's is a flag (a completion's a count)
    parallel_tool_calls: bool | None = True
    # read by the simulated model's call rule (cachecore.replica.toolcalls), checked as
    # vLLM's check_tool_usage checks it (_tool_usage), its type not validated
    tool_choice: Any = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            return {**data, "messages": chat_completion_messages(data["messages"])}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tool_usage(cls, data: Any) -> Any:
        # vLLM's check_tool_usage, a before-validator: refused as the gateway refuses it
        if isinstance(data, dict):
            try:
                check_chat_tools(data)
            except TokenizerError as exc:
                raise option_error(exc) from exc
        return data

    def requested_max_tokens(self) -> int:
        return _max_tokens(self.max_completion_tokens, self.max_tokens)

    def chat_options(self, server: ServerChatDefaults | None = None) -> ChatOptions | None:
        """As vLLM 0.33's chat completion renders it on ``server``
        (:meth:`ChatOptions.from_body`)."""
        fields = {
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
            "tool_choice": self.tool_choice,  # --exclude-tools-when-tool-choice-none reads it
        }
        return ChatOptions.from_body({**self._template_fields(), **fields}, "chat", server)

    def max_output_tokens(self) -> int:
        value = self.max_completion_tokens
        return (value if value is not None else self.max_tokens) or 0

    def _echo_logprobs(self) -> object:
        return self.top_logprobs


class CompletionRequest(_GenerationRequest):
    prompt: Any = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the BOS
    logprobs: int | None = None
    suffix: str | None = None

    def requested_max_tokens(self) -> int:
        return _max_tokens(None, self.max_tokens)

    def max_output_tokens(self) -> int:
        # vLLM's completion request: max_tokens is 16 when absent, and null reserves none
        if "max_tokens" not in self.model_fields_set:
            return DEFAULT_MAX_TOKENS
        return self.max_tokens or 0

    def _echo_logprobs(self) -> object:
        return self.logprobs


class TokenizeRequest(_ChatRendering):
    """vLLM's two /tokenize requests; the chat one declares no ``documents`` or
    ``reasoning_effort`` (extras it ignores: only the kwargs' render)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's two tokenize requests: true for a prompt, false for messages (absent here)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    # not vLLM's (it ignores the field): the scope of this replica's tokenization cache,
    # which kvgate's gateway sends so that no two tenants' tokenize calls share an entry
    cache_salt: Any = None

    def chat_options(self, server: ServerChatDefaults | None = None) -> ChatOptions | None:
        return ChatOptions.from_body(self._template_fields(), "tokenize", server)

    def cache_scope(self) -> str:
        salt = self.cache_salt
        return salt if isinstance(salt, str) and salt else ""


EMBEDDING_DIM = 256
"""The simulated model's embedding size: ``dimensions`` may ask for fewer (its leading
components, renormalised, as a matryoshka model answers), never more."""


class _PoolingBase(BaseModel):
    """The fields every vLLM pooling request shares, its types read in pydantic's lax mode
    as vLLM's: a value of another type is a 400 naming the field."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    # vLLM's (TokenizeParams.with_kwargs): "max_length" pads each prompt, after its
    # truncation, with the pad token to the model's context, all of which the engine runs
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: _INT64 = 0  # read, not acted on (the engine schedules first come, first served)
    request_id: str | None = None
    cache_salt: Any = None  # validated by hand, as the generation requests' (vLLM's message)

    def check_fields(self) -> None:
        """The endpoint's own refusals that vLLM makes before it reads the prompts."""

    def padded_len(self, max_model_len: int) -> int | None:
        """The length ``padding`` pads each prompt to (None: none)."""
        return max_model_len if self.padding == "max_length" else None

    def truncation(self, max_model_len: int) -> int | None:
        """How many tokens of each input the engine keeps (None: all; -1: the model's
        context), refused past the context as vLLM refuses it."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        if keep > max_model_len:
            raise APIError(
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                f"({max_model_len}). Please, select a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if keep == -1:
            return max_model_len
        if keep < 1:
            raise APIError("The decoder prompt cannot be empty", param="truncate_prompt_tokens")
        return keep

    def truncate(
        self, ids: list[int], keep: int | None, affixes: tuple[Sequence[int], Sequence[int]]
    ) -> list[int]:
        """A prompt's ids as vLLM 0.33 truncates a pooling prompt to ``keep``: with no
        ``truncation_side``, its tokenizer does, which for a pooling model truncates from
        the right (its first tokens kept, and the special tokens added around a text,
        ``affixes``; none for token ids or a chat's template text); with one, vLLM skips
        the tokenizer's truncation and slices the whole prompt from that side, special
        tokens included. A pair: :meth:`truncate_pair`."""
        if keep is None:
            return ids
        if self.truncation_side is None:
            return Truncation(keep, False).text(ids, affixes)
        return ids[Truncation(keep, self.truncation_side == "left").kept(len(ids))]

    def truncate_pair(
        self,
        tok: Tokenizer,
        first: list[int],
        second: list[int],
        keep: int | None,
        per_doc: int = 0,
    ) -> list[int]:
        """A text pair (each text's ids) laid out by the tokenizer's pair template and
        truncated to ``keep`` as vLLM 0.33 does: with no ``truncation_side`` by its
        tokenizer (:func:`~cachecore.tokenizer.truncated_pair`, the longer text first;
        under a ``max_tokens_per_doc`` ``per_doc`` the document alone when the first
        text fits, :func:`~cachecore.tokenizer.doc_limited_pair`), with one by its slice
        of the whole pair (:meth:`truncate`)."""
        paired = with_pair_special_tokens(tok, first, second)
        if keep is None or self.truncation_side is not None:
            return self.truncate(paired, keep, ((), ()))
        if per_doc > 0:
            only_second = doc_limited_pair(tok, first, second, keep, per_doc)
            if only_second is not None:
                return only_second
        return truncated_pair(tok, first, second, keep)


_CHAT_ONLY_FIELDS = frozenset(
    ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")
)
"""Fields vLLM's pooling chat form declares and its completion form does not (vLLM 0.33's
``ChatRequestOptionsMixin``; its ``media_io_kwargs`` is not read here)."""


class PoolingInputRequest(_PoolingBase, _ChatTemplateFields):
    """vLLM's pooling requests over one input each (embeddings, /pooling, /classify), in
    either of vLLM's two forms: the completion form (``input``: a string, token ids or a
    batch of either) or the chat form (``messages``, rendered with the chat template). With
    both, the form vLLM's union runs (:attr:`chat`)."""

    input: list[int] | list[list[int]] | str | list[str] | None = None
    messages: list[Any] | None = None
    # the chat form's: no generation prompt (nothing is generated), and the template writes
    # the special tokens; the completion form adds them by default
    add_generation_prompt: bool = False
    add_special_tokens: bool | None = None
    chat_template: str | None = None  # read; the replica renders with its own template

    @property
    def chat(self) -> bool:
        """Whether the chat form runs. vLLM's request is a union of the two forms, and
        pydantic's smart union runs the member with the most fields set, counting the
        fields of nested typed dicts: each message's own keys count for the chat form, so
        with both given the messages run whenever they are chat messages (objects with a
        string ``role``), unless there are none and no chat-only field is set (a tie: the
        completion form, the union's first member). Messages that are not chat messages
        fail the chat form: the input runs."""
        msgs = self.messages
        if msgs is None:
            return False
        if self.input is None:
            return True
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            return False
        return bool(msgs) or bool(self.model_fields_set & _CHAT_ONLY_FIELDS)

    def conversations(self) -> list[Any]:
        """The chat form's conversations, one engine request each: the messages, one."""
        return [self.messages or []]

    def chat_options(self, server: ServerChatDefaults | None = None) -> ChatOptions | None:
        """The chat form's options as vLLM 0.33 renders them (no ``tools``,
        ``documents`` or ``reasoning_effort``: fields its pooling requests ignore; nor the
        server's default kwargs, ``server`` unread; the gateway sizes by the same rule,
        :meth:`ChatOptions.for_pooling`)."""
        return ChatOptions.for_pooling(
            {
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs,
                "add_special_tokens": self.add_special_tokens,
            }
        )

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return not self.chat

    def prompts(self) -> list[str | list[int]]:
        """One engine request per element of a batch (a list of strings or of token
        arrays), as vLLM runs them; a string or a token array alone is one. Empty: a 400.
        The chat form is one prompt, rendered by the caller."""
        if self.chat:
            return []
        inp = self.input
        if inp is None:
            raise APIError("Field required: 'input' (or 'messages')", param="input")
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            return [inp]
        if not inp:
            raise APIError("input must not be empty", param="input")
        return list(cast(list[str] | list[list[int]], inp))


class EmbeddingRequest(PoolingInputRequest):
    """vLLM's ``EmbeddingCompletionRequest``, ``EmbeddingChatRequest``,
    ``EmbeddingChatInputRequest`` (a conversation in ``input``: the chat form) and the
    batched ``EmbeddingBatchChatRequest`` / ``EmbeddingBatchChatInputRequest`` (a batch of
    conversations in ``messages`` or ``input``: one engine request each)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _conversation_input(cls, data: Any) -> Any:
        return embedding_chat_input(data) if isinstance(data, dict) else data

    @property
    def chat(self) -> bool:
        # a batch of conversations runs whatever the input beside it: in vLLM's smart
        # union each message's keys count for the batched form, none for the completion form
        return is_conversation_batch(self.messages) or super().chat

    def conversations(self) -> list[Any]:
        msgs = self.messages
        return list(msgs) if msgs is not None and is_conversation_batch(msgs) else [msgs or []]

    def check_fields(self) -> None:
        self.output_dimensions()

    def output_dimensions(self) -> int:
        """The size of each embedding: ``dimensions`` up to :data:`EMBEDDING_DIM`."""
        d = self.dimensions
        if d is None:
            return EMBEDDING_DIM
        if d < 1:
            raise APIError("dimensions must be greater than 0", param="dimensions")
        if d > EMBEDDING_DIM:
            raise APIError(
                f"dimensions ({d}) must be at most the model's embedding size, {EMBEDDING_DIM}",
                param="dimensions",
            )
        return d


class PoolingRequest(PoolingInputRequest):
    """vLLM's ``/pooling`` request (``PoolingCompletionRequest`` / ``PoolingChatRequest``):
    the model's pooled hidden state per input."""

    encoding_format: Literal["float", "base64"] = "float"


class ClassificationRequest(PoolingInputRequest):
    """vLLM's ``/classify`` request (``ClassificationCompletionRequest`` / ``...Chat...``)."""

    use_activation: bool | None = None  # read; the probabilities are always a softmax


class _ScoringFields(_PoolingBase):
    """vLLM 0.33's ``ScoringRequestMixin`` fields a score template reads: its
    ``chat_template_kwargs`` and ``instruction`` (folded into them)."""

    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # each query and each document cut to that many tokens first (0: whole)
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0

    def token_limits(self, max_model_len: int) -> tuple[int, int]:
        """``max_tokens_per_query`` and ``max_tokens_per_doc``, refused as vLLM 0.33's
        scorer refuses them (a 400 naming no field)."""
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            value = getattr(self, name)
            if value:
                try:
                    check_score_token_limit(name, value, max_model_len)
                except TokenizerError as exc:
                    raise APIError(str(exc)) from exc
        return self.max_tokens_per_query, self.max_tokens_per_doc


class ScoreRequest(_ScoringFields):
    """vLLM's ``/score`` request: ``text_1`` against ``text_2``, 1:1, 1:N or N:N; each
    pair one engine request of both texts' tokens (a cross-encoder's pair prompt)."""

    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        a = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        b = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not a:
            raise APIError("At least one text element must be given", param="text_1")
        if not b:
            raise APIError("At least one text element must be given", param="text_2")
        if len(a) == 1:
            return [(a[0], t) for t in b]
        if len(a) != len(b):
            raise APIError("Input lengths must be either 1:1, 1:N or N:N", param="text_2")
        return list(zip(a, b, strict=True))


class RerankRequest(_ScoringFields):
    """vLLM's ``/rerank`` request (``/v1/rerank``, ``/v2/rerank``): the query paired with
    each document; ``top_n`` the best n (0 or absent: all). vLLM reads no
    ``return_documents``: each result holds its document."""

    query: str
    # vLLM's `ScoreInput | list[ScoreInput]`: one document alone is a list of one
    documents: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]
    top_n: Annotated[int, Field(ge=0)] = 0

    def pairs(self) -> list[tuple[str, str]]:
        if not self.documents:
            raise APIError("At least one document must be given", param="documents")
        return [(self.query, d) for d in self.documents]


CLASSIFY_LABELS = ("negative", "neutral", "positive")
"""The simulated classifier's labels (its ``id2label``)."""


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """A pooling answer's usage: the prompts only (no output, no cache report)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _ids_digest(ids: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(array.array("I", ids).tobytes())


def pair_score(ids: Sequence[int]) -> float:
    """A deterministic relevance score in [0, 1) for a pair prompt's token ids."""
    return _ids_digest(ids) / 2.0**64


def class_probs(ids: Sequence[int]) -> list[float]:
    """A deterministic softmax over :data:`CLASSIFY_LABELS` for a prompt's token ids."""
    logits = np.random.default_rng(_ids_digest(ids)).standard_normal(len(CLASSIFY_LABELS))
    e = np.exp(logits - logits.max())
    return [float(p) for p in e / e.sum()]


def encode_floats(v: npt.NDArray[np.float32], encoding_format: str) -> Any:
    """A vector as a list of floats, or with ``base64`` its little-endian float32 bytes in
    base64 (what the openai SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def embedding_vector(ids: Sequence[int], dimensions: int) -> npt.NDArray[np.float32]:
    """A deterministic unit vector for a prompt's token ids: a normal draw seeded by the
    ids' xxh3 digest, its first ``dimensions`` components renormalised (the same prompt
    gives the same vector, in every size a prefix of the full one's direction)."""
    seed = xxhash.xxh3_64_intdigest(array.array("I", ids).tobytes())
    full = np.random.default_rng(seed).standard_normal(EMBEDDING_DIM)
    part = full[:dimensions]
    norm = float(np.linalg.norm(part))
    return (part / (norm or 1.0)).astype(np.float32)


def embedding_response(
    request_id: str,
    model: str,
    vectors: Sequence[npt.NDArray[np.float32]],
    prompt_tokens: int,
    encoding_format: str,
    created: int,
) -> dict[str, Any]:
    """vLLM's ``EmbeddingResponse``: ``data[i].embedding`` a list of floats, or with
    ``base64`` the little-endian float32 bytes in base64 (what the openai SDK decodes);
    usage counts the prompts (no output, no cache report)."""
    data = [
        {"index": i, "object": "embedding", "embedding": encode_floats(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": pooling_usage(prompt_tokens),
    }


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def _max_tokens(primary: int | None, fallback: int | None) -> int:
    value = primary if primary is not None else fallback
    if value is None:
        return DEFAULT_MAX_TOKENS
    if value < 1:
        raise APIError(f"max_tokens must be at least 1, got {value}.", param="max_tokens")
    return value


def validate_common(req: _GenerationRequest) -> str | None:
    """Checks shared by both generation endpoints; returns the cache salt."""
    if req.n not in (None, 1):
        raise APIError("the simulated replica only supports n=1", param="n")
    return validate_salt(req.cache_salt)


def validate_salt(salt: Any) -> str | None:
    """A request's ``cache_salt`` as vLLM checks it: absent, or a non-empty string."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    return salt


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "completion_tokens": out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE event (one per token on a stream: orjson, no str round trip)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())


def chat_response(
    request_id: str,
    model: str,
    text: str | None,
    last: RequestOutput,
    created: int,
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
) -> dict[str, Any]:
    """A chat completion; with ``tool_calls`` (:func:`tool_call`) its content null and
    ``finish`` its finish reason (vLLM's ``resolve_finish_reason``), else the engine's."""
    if finish is None and last.finish_reason is not None:
        finish = last.finish_reason.value
    message = {"role": "assistant", "content": text, "tool_calls": tool_calls or []}
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": usage(last),
        "prompt_logprobs": None,
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A chat completion message's tool call, as vLLM's ``ToolCall`` dumps it."""
    return {
        "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments},
    }  # fmt: skip


def completion_response(
    request_id: str, model: str, text: str, last: RequestOutput, created: int
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": last.finish_reason.value if last.finish_reason else None,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": usage(last),
    }


def chat_chunk(
    request_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def completion_chunk(
    request_id: str, model: str, created: int, text: str, finish: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
    }


def usage_chunk(
    request_id: str, model: str, created: int, obj: str, last: RequestOutput
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(last),
    }


def completion_prompts(prompt: Any) -> list[Any]:
    """A /v1/completions ``prompt`` as vLLM's request model takes it: a string or a token
    array (one prompt), or a batch, a list of strings or of token arrays (one engine
    request each); each checked by :func:`completion_prompt_ids`."""
    batch = isinstance(prompt, list) and bool(prompt)
    if batch and (
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)
    ):
        return cast(list[Any], prompt)
    return [prompt]


def completion_prompt_ids(
    prompt: Any, encode: Any, vocab_size: int, param: str = "prompt"
) -> list[int]:
    """One prompt of a /v1/completions request (:func:`completion_prompts`): a string or a
    list of token ids. ``param``: the field it came from (an embedding's ``input``)."""
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(f"{param} must not be empty", param=param)
        ids: list[int] = encode(prompt)
        return ids
    # type() per element, then min/max, all in C: a per-token Python check was a tenth of
    # the replica's CPU for a 2k-token prompt
    kinds = set(map(type, prompt)) if isinstance(prompt, list) and prompt else None
    if kinds is not None and kinds <= {int, bool}:
        if bool in kinds or min(prompt) < 0 or max(prompt) >= vocab_size:
            raise APIError(f"token ids must be in [0, {vocab_size})", param=param)
        return list(prompt)
    raise APIError(f"{param} must be a string or a list of token ids", param=param)


def batch_usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """A batch's usage as vLLM reports it: prompt and completion tokens summed over its
    prompts, cached tokens the last prompt's (vLLM reads them off its last result)."""
    prompt = sum(o.num_prompt_tokens for o in outs)
    output = sum(o.num_output_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + output,
        "completion_tokens": output,
        "prompt_tokens_details": {"cached_tokens": outs[-1].num_cached_tokens},
    }


def completion_batch_response(
    request_id: str, model: str, results: Sequence[tuple[str, RequestOutput]], created: int
) -> dict[str, Any]:
    """A batch's answer: one choice per prompt, ``index`` its place in the batch."""
    choices = []
    for i, (text, last) in enumerate(results):
        choice = completion_response(request_id, model, text, last, created)["choices"][0]
        choice["index"] = i
        choices.append(choice)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": batch_usage([last for _, last in results]),
    }


def joined_text(texts: Sequence[str]) -> str:
    return "".join(texts)
