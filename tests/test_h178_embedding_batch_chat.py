"""Embeddings' batched chat forms (H178). vLLM 0.33's ``EmbeddingRequest`` union
(``vllm/entrypoints/pooling/embed/protocol.py``) has two members that take a list of
conversations: ``EmbeddingBatchChatRequest`` (in ``messages``) and
``EmbeddingBatchChatInputRequest`` (in ``input``, copied into ``messages`` by its
before-validator when there are none, if it is ``_is_batched_chat_messages``);
``EmbedIOProcessor._get_request_factory_chat_input_online`` renders each conversation with
the chat form's template and parameters, one engine request each, and the usage is the sum
of their prompt tokens (``get_pooling_usage``). The gateway and the simulated replica
answered both with a 400. Which member runs is pydantic's smart union's choice: checked
here against a mirror of vLLM's five request models (:data:`_VLLM_EMBEDDING_REQUEST`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Required, TypeAlias

import httpx
import orjson
import pytest
from openai.types.chat import ChatCompletionContentPartParam as _OpenAIPart
from openai.types.chat import ChatCompletionMessageParam as _OpenAIMessage
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from typing_extensions import TypedDict

from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- the mirror
# vLLM 0.33's embeddings request models, abridged to the fields and validators that decide
# which member validates and how many fields it sets (pydantic's smart union runs the
# member with the most, nested typed dicts' keys counted; a tie the first). Left out: the
# openai_harmony Message member of ChatCompletionMessageParam (a dataclass whose required
# ``author`` no message here has) and vLLM's own content-part types (text content only).
class _CustomMessage(TypedDict, total=False):  # vLLM's CustomChatCompletionMessageParam
    role: Required[str]
    content: str | list[_OpenAIPart | str]
    name: str
    tool_call_id: str | None
    reasoning: str | None
    task: str | None


_Message: TypeAlias = _OpenAIMessage | _CustomMessage


class _OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's OpenAIBaseModel


class _Basic(_OpenAIBase):  # PoolingBasicRequestMixin
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str = "id"
    priority: int = 0
    cache_salt: str | None = None


class _Embed(_OpenAIBase):  # EmbedRequestMixin
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    dimensions: int | None = None
    use_activation: bool | None = None


class _ChatOptions(_OpenAIBase):  # ChatRequestOptionsMixin
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _Completion(_Basic, _Embed):  # EmbeddingCompletionRequest
    input: list[int] | list[list[int]] | str | list[str]
    add_special_tokens: bool = True


class _Chat(_Basic, _ChatOptions, _Embed):  # EmbeddingChatRequest
    messages: list[_Message]


class _BatchChat(_Basic, _ChatOptions, _Embed):  # EmbeddingBatchChatRequest
    messages: Sequence[Annotated[list[_Message], Field(min_length=1)]] = Field(min_length=1)


def _is_messages(value: Any) -> bool:  # vLLM's _is_chat_messages
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


class _ChatInput(_Chat):  # EmbeddingChatInputRequest
    input: list[_Message]

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "messages" in data or "input" not in data:
            return data
        return {**data, "messages": data["input"]} if _is_messages(data["input"]) else data


class _BatchChatInput(_BatchChat):  # EmbeddingBatchChatInputRequest
    input: Sequence[Annotated[list[_Message], Field(min_length=1)]] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "messages" in data or "input" not in data:
            return data
        batched = isinstance(data["input"], list) and bool(data["input"])
        batched = batched and all(_is_messages(c) for c in data["input"])
        return {**data, "messages": data["input"]} if batched else data


_VLLM_EMBEDDING_REQUEST: TypeAdapter[Any] = TypeAdapter(
    _Completion | _Chat | _BatchChat | _ChatInput | _BatchChatInput
)


def _vllm_runs(body: dict[str, Any]) -> dict[str, Any]:
    """The body of the one form vLLM's union runs for ``body``: ``{"input": ...}``, one
    conversation's ``{"messages": [...]}``, or a batch's ``{"messages": [[...], ...]}``
    (each its own answer, :func:`_singles`); the request's other fields kept."""
    got = _VLLM_EMBEDDING_REQUEST.validate_python(body)
    rest = {k: v for k, v in body.items() if k not in ("input", "messages")}
    if isinstance(got, _Completion):
        return {**rest, "input": body["input"]}
    chosen = body["messages"] if "messages" in body else body["input"]
    return {**rest, "messages": chosen}


# ----------------------------------------------------------------------------- the tests
_A = [{"role": "system", "content": words(30, 1)}, {"role": "user", "content": words(12, 2)}]
_B = [{"role": "user", "content": words(50, 3)}]
_C = [
    {"role": "user", "content": words(7, 4)},
    {"role": "assistant", "content": words(9, 5)},
    {"role": "user", "content": [{"type": "text", "text": words(20, 6)}]},
]
_BATCH = [_A, _B, _C]


def _stable(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


async def _direct(st: Stack, body: dict[str, Any], path: str = "/v1/embeddings") -> httpx.Response:
    async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=30) as h:
        return await h.post(path, json=body)


async def _singles(st: Stack, conversations: list[Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The answer a batch should be: each conversation's own answer (the chat form alone),
    concatenated, indexed in order, their usages summed."""
    data: list[Any] = []
    n = 0
    for conversation in conversations:
        r = await _direct(st, {**extra, "messages": conversation})
        assert r.status_code == 200, r.text
        got = r.json()
        data += [{**d, "index": len(data) + i} for i, d in enumerate(got["data"])]
        n += got["usage"]["prompt_tokens"]
    return {"data": data, "prompt_tokens": n}


async def test_a_batch_of_conversations_is_one_engine_request_each_and_charged_their_sum() -> None:
    """In ``messages`` and in ``input``, with the chat form's options: the answer is the
    conversations' own answers concatenated, its usage their sum, through the gateway as at
    the replica, and the gateway charges exactly what the replica reports."""
    options: list[dict[str, Any]] = [
        {},
        {"add_generation_prompt": True},
        {"continue_final_message": True, "add_special_tokens": True},
        {"truncate_prompt_tokens": 20},
        {"truncate_prompt_tokens": 20, "truncation_side": "left", "dimensions": 8},
    ]
    async with stack(count=1) as st, st.http() as h:
        for extra in options:
            want = await _singles(st, _BATCH, extra)
            for field in ("messages", "input"):
                body = {"model": st.model, field: _BATCH, **extra}
                direct = await _direct(st, body)
                assert direct.status_code == 200, (field, extra, direct.text)
                r = await h.post("/v1/embeddings", json=body)
                assert r.status_code == 200, (field, extra, r.text)
                got = r.json()
                assert _stable(got) == _stable(direct.json()), (field, extra)
                assert got["data"] == want["data"], (field, extra)
                assert got["usage"]["prompt_tokens"] == want["prompt_tokens"] >= 60, extra
                d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
                assert d.prompt_tokens == got["usage"]["prompt_tokens"], (field, extra)


async def test_the_form_that_runs_is_the_one_vllms_union_picks_and_its_refusals_400() -> None:
    """Bodies with ``input`` and ``messages`` both, and the shapes a batch shares with a
    token-id batch: the replica answers what the mirror of vLLM's union runs, and the
    gateway charges that (a batch exactly; a single conversation beside an input at least
    it, D29's larger form). The shapes no member of the mirror takes (a batch with an empty
    or non-conversation element; a batch beside messages that are no conversation) stay a
    400 naming the field at fault, at the gateway before routing and at the replica (they
    were before the batched forms, too); and /pooling and /classify, whose unions have no
    batched member, refuse a batch."""
    ids = [[5, 6, 7], [8, 9]]
    cases: list[tuple[dict[str, Any], type[BaseModel]]] = [
        ({"input": ids}, _Completion),
        ({"input": [[5]]}, _Completion),
        ({"input": _BATCH}, _BatchChatInput),
        ({"input": _A}, _ChatInput),
        ({"input": _A, "messages": _B}, _ChatInput),
        ({"messages": _BATCH}, _BatchChat),
        ({"input": words(40, 9), "messages": _BATCH}, _BatchChat),
        ({"input": ids, "messages": _BATCH}, _BatchChat),
        ({"input": [words(300, 9), words(300, 8)], "messages": [_B]}, _BatchChat),
        ({"input": _A, "messages": _BATCH}, _BatchChat),
        ({"input": _BATCH, "messages": _B}, _Chat),
        ({"input": _BATCH, "messages": [_A, _B]}, _BatchChatInput),
        ({"input": _BATCH, "messages": _C, "add_generation_prompt": True}, _Chat),
    ]
    refused: list[tuple[dict[str, Any], str]] = [
        ({"input": [_A, []]}, "input"),
        ({"input": [_A, [1, 2]]}, "input"),
        ({"input": [_A, _B[0]]}, "input"),
        ({"messages": [_A, []]}, "messages"),
        ({"messages": [_A, _B[0]]}, "messages"),
        ({"messages": [[]]}, "messages"),
        # vLLM's own param here is its first member's complaint (input: no token ids)
        ({"input": _BATCH, "messages": [{"content": "no role"}]}, "messages"),
    ]
    async with stack(count=1) as st, st.http() as h:
        for body, member in cases:
            assert type(_VLLM_EMBEDDING_REQUEST.validate_python(body)) is member, body
            runs = _vllm_runs(body)
            alone = await _direct(st, runs)
            assert alone.status_code == 200, alone.text
            if "messages" in runs and _is_messages(runs["messages"][0]):
                want = await _singles(st, runs["messages"], {})
                assert alone.json()["data"] == want["data"]
            direct = await _direct(st, body)
            assert direct.status_code == 200, (body, direct.text)
            assert direct.json()["data"] == alone.json()["data"], member
            assert direct.json()["usage"] == alone.json()["usage"], member
            r = await h.post("/v1/embeddings", json=body)
            assert r.status_code == 200, (body, r.text)
            assert r.json()["data"] == alone.json()["data"], member
            n = alone.json()["usage"]["prompt_tokens"]
            d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
            if member in (_BatchChat, _BatchChatInput):
                assert d.prompt_tokens == n, (member, body)
            else:
                assert d.prompt_tokens >= n, (member, body)
        for body, field in refused:
            with pytest.raises(ValidationError):
                _VLLM_EMBEDDING_REQUEST.validate_python(body)
            r = await h.post("/v1/embeddings", json={"model": st.model, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, (body, r.text)
            direct = await _direct(st, body)
            assert direct.status_code == 400, (body, direct.text)
            assert direct.json()["error"]["param"].startswith(field), (body, direct.text)
        for path in ("/pooling", "/classify"):
            for field in ("input", "messages"):
                r = await h.post(path, json={"model": st.model, field: _BATCH})
                assert r.status_code == 400, (path, field, r.text)
                assert r.json()["error"]["param"] == field, (path, field, r.text)
                direct = await _direct(st, {field: _BATCH}, path)
                assert direct.status_code == 400, (path, field, direct.text)


async def test_the_batch_cap_counts_conversations() -> None:
    """``KVGATE_MAX_PROMPT_BATCH`` caps engine requests: a batch of conversations is as
    many as an ``input`` list (past it a 400 naming the field that holds them)."""
    async with stack(count=1, max_prompt_batch=3) as st, st.http() as h:
        for field in ("messages", "input"):
            r = await h.post("/v1/embeddings", json={"model": st.model, field: _BATCH})
            assert r.status_code == 200, r.text
            body = {"model": st.model, field: [*_BATCH, _B]}
            r = await h.post("/v1/embeddings", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field, r.text
            assert "4 inputs" in r.json()["error"]["message"], r.text


async def test_every_conversations_media_uuids_go_scoped() -> None:
    """A content part's ``uuid`` names an item in vLLM's unsalted multimodal caches: in
    every conversation of a batch (in ``messages`` or ``input``) it is scoped per scope,
    as a chat's messages' are."""

    def conversation(uid: str) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": [
                {"type": "text", "text": "describe"},
                {"type": "image_url", "image_url": None, "uuid": uid},
            ]},
        ]  # fmt: skip

    batch = [conversation("their-image-0001"), _B, conversation("their-image-0002")]
    async with stack(count=1) as st:
        for field in ("messages", "input"):
            body = {"model": st.model, field: batch}
            d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
            d.raw_body = orjson.dumps(body)
            sent = orjson.loads(st.gw.upstream_body(d))[field]
            assert sent[1] == _B
            uids = [sent[i][0]["content"][1]["uuid"] for i in (0, 2)]
            assert all(u.startswith("kvg1:") for u in uids) and uids[0] != uids[1], uids
