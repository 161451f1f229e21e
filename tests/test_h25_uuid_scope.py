"""Media uuids are scoped whatever the part's type, on every call that carries them to an
engine, under one name per scope (review 4: V3, V3b, V8 and the rotation note).

vLLM takes a content part's client ``uuid`` as the media item's hash in its processor and
encoder caches, which no cache_salt scopes, and serves a part with no data but a uuid from
them. Its parser reads a uuid from a part with no type, and its request model reads
``{"type": "text", "image_url": null, "uuid": U}`` (no text) as a type-less image part
(vllm/entrypoints/chat_utils.py): c706ef9 scoped only media-typed parts, and only in the
generation body, keyed by the salt the request was served under."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import orjson
import pytest

from cachecore.keys import SaltMinter
from cachecore.tokenizer import (
    TokenizerError,
    media_uuids,
    message_text,
    scope_media_uuids,
    strip_media,
)
from gateway.auth import KeyStore, hash_key
from gateway.errors import GatewayError
from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(120)

KEYS = {"sk-a": "a", "sk-b": "b"}
UID = "acme-contract-scan-0042"
SALT_A, SALT_B = "kvg-salt-a", "kvg-salt-b"
TEXT = {"type": "text", "text": "describe"}
IMAGE = {"url": "data:image/png;base64,iVBORw0KGgo="}


def chat(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [TEXT, *parts]}]


def sent_part(messages: Any, salt: str = SALT_B) -> Any:
    return scope_media_uuids(messages, salt)[0]["content"][1]


# parts vLLM reads as a media item named by the uuid, whatever their type says
UUID_ITEMS = [
    {"type": "image_url", "image_url": None, "uuid": UID},
    {"image_url": None, "uuid": UID},  # no type (V3)
    {"video_url": None, "uuid": UID},
    {"image_embeds": None, "uuid": UID},
    {"image_pil": None, "uuid": UID},
    {"type": "text", "image_url": None, "uuid": UID},  # text-typed, no text (V3b)
    {"type": "text", "text": None, "video_url": None, "uuid": UID},
    {"type": "refusal", "image_url": None, "uuid": UID},
    {"type": "no-such-type", "image_url": None, "uuid": UID},
]


@pytest.mark.parametrize("part", UUID_ITEMS, ids=lambda p: json.dumps(p))
def test_every_uuid_that_names_an_item_is_scoped(part: dict[str, Any]) -> None:
    msgs = chat(part)
    before = copy.deepcopy(msgs)
    b = sent_part(msgs)
    assert media_uuids(msgs)
    assert b["uuid"] != UID and b["uuid"].startswith("kvg1:")
    assert {k: v for k, v in b.items() if k != "uuid"} == {
        k: v for k, v in part.items() if k != "uuid"
    }
    assert sent_part(msgs) == b  # the same name within a scope: reuse works
    assert sent_part(msgs, SALT_A)["uuid"] != b["uuid"]  # another in another scope
    assert msgs == before  # the client's messages are not changed in place
    # and the gateway reads the part as the engine does: media, stripped for sizing
    # (the request is then routed by load), never an empty text part
    text_only, found = strip_media(msgs)
    assert found == 1 and text_only[0]["content"] == [TEXT]


def test_the_uuid_of_a_text_part_with_its_text_is_scoped_and_the_part_is_text() -> None:
    """vLLM's model validates it as a text part (the uuid dropped): sized as text; its
    uuid is scoped anyway (the simplest safe rule: every string uuid of every part)."""
    part = {"type": "text", "text": "x", "image_url": None, "uuid": UID}
    msgs = chat(part)
    assert strip_media(msgs) == (msgs, 0)
    assert message_text([part]) == "x"
    assert sent_part(msgs)["uuid"] == sent_part(chat({"type": "image_url", "uuid": UID}))["uuid"]


def test_a_text_typed_part_read_as_media_is_not_text() -> None:
    with pytest.raises(TokenizerError, match="media"):
        message_text([{"type": "text", "image_url": None, "uuid": UID}])
    with pytest.raises(TokenizerError, match="media"):
        message_text([{"type": "output_text", "text": 5, "image_url": "http://x"}])
    # no media key: as before (an empty text part; a non-string text refused)
    assert message_text([{"type": "text", "text": None}, {"type": "text"}, "a"]) == "a"
    with pytest.raises(TokenizerError, match="must be a string"):
        message_text([{"type": "text", "text": 5}])


def test_parts_and_messages_that_are_not_objects_are_left_alone() -> None:
    msgs: list[Any] = [
        {"role": "user", "content": ["bare", ["nested", {"uuid": UID}], None, 5, TEXT]},
        {"role": "user", "content": f"plain text naming {UID}"},
        {"role": "user", "content": {"uuid": UID}},  # not a list: the engine refuses it
        "not a message",
        None,
        {"role": "user"},
    ]
    before = copy.deepcopy(msgs)
    assert not media_uuids(msgs)
    assert scope_media_uuids(msgs, SALT_B) is msgs and msgs == before
    assert strip_media(msgs) == (msgs, 0)
    others: tuple[Any, ...] = (None, "x", {"messages": []}, 5)
    for other in others:
        assert scope_media_uuids(other, SALT_B) is other
        assert not media_uuids(other)
    # a part whose type is not a string (a list: unhashable) is read, not a crash
    odd = chat({"type": ["image_url"], "image_url": None, "uuid": UID})
    assert strip_media(odd)[1] == 1 and sent_part(odd)["uuid"] != UID


@pytest.mark.parametrize("uuid", [5, 1.5, True, {"id": UID}, [UID]])
def test_a_uuid_that_is_not_a_string_is_left_for_the_engine(uuid: Any) -> None:
    """vLLM's model takes ``str | None``: it drops or refuses any other, so it names no
    item; left as it came (the request is re-serialized, nothing else changes)."""
    msgs = chat({"type": "image_url", "image_url": None, "uuid": uuid})
    assert media_uuids(msgs)
    assert scope_media_uuids(msgs, SALT_B) is msgs
    null = chat({"type": "image_url", "image_url": IMAGE, "uuid": None})
    assert not media_uuids(null) and scope_media_uuids(null, SALT_B) is null


def test_only_parts_with_a_uuid_are_copied_and_odd_text_is_hashed() -> None:
    plain = {"role": "system", "content": "sys"}
    msgs = [plain, *chat({"image_url": None, "uuid": "\ud800lone"})]
    out = scope_media_uuids(msgs, SALT_B)
    assert out[0] is plain and out[1]["content"][0] is TEXT
    assert out[1]["content"][1]["uuid"].startswith("kvg1:")


def key_store() -> KeyStore:
    return KeyStore({hash_key(k): t for k, t in KEYS.items()})


def body_of(model: str, part: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "messages": chat(part)}


async def test_the_default_stack_sends_every_uuid_scoped_and_routes_such_parts_by_load() -> None:
    """V3b end to end on the default (local tokenizer) stack: b types a part naming a's
    item "text"; the gateway sized it as an empty text part and sent the raw uuid. Now
    it is media to the gateway too (unkeyed, routed by load) and its uuid goes scoped: the
    name b's own image part gets, never a's. A type-less part (V3) is served the same
    way, no longer refused as an unknown type."""
    async with stack(count=1, build={"key_store": key_store()}, open_access=False) as st:

        async def sent(tenant: str, part: dict[str, Any]) -> tuple[dict[str, Any], bool]:
            d = await st.gw.prepare(
                "chat", tenant, body_of(st.model, part), {}, "x", explain_only=True
            )
            up = orjson.loads(st.gw.upstream_body(d))
            assert up["messages"][0]["content"][0] == TEXT
            return up["messages"][0]["content"][1], d.unkeyed

        a, _ = await sent("a", {"type": "image_url", "image_url": IMAGE, "uuid": UID})
        b_typed, _ = await sent("b", {"type": "image_url", "image_url": None, "uuid": UID})
        assert a["uuid"] != b_typed["uuid"] and UID not in (a["uuid"], b_typed["uuid"])
        for part in (
            {"type": "text", "image_url": None, "uuid": UID},
            {"image_url": None, "uuid": UID},
            {"type": "text", "video_url": None, "uuid": UID},
        ):
            got, unkeyed = await sent("b", part)
            assert got["uuid"] == b_typed["uuid"], part  # b's own name, not a's, not raw
            assert unkeyed, part  # media to the gateway as to the engine
        # a text part with its text stays text (keyed), its uuid scoped all the same
        got, unkeyed = await sent("b", {"type": "text", "text": "x", "uuid": UID})
        assert got["uuid"] == b_typed["uuid"] and not unkeyed


async def test_a_uuid_keeps_its_name_through_a_secret_rotation() -> None:
    """During a rotation a scope's requests are served under either secret's salt (the
    one the replica holds the prefix under): the uuid was keyed by that salt, so one
    scope's item got two names and a reference without data missed it. Now it is keyed
    by the scope's primary salt whatever the request is served under."""
    async with stack(count=1, build={"key_store": key_store()}, open_access=False) as st:
        st.gw.minter = SaltMinter([b"new-secret-0123456789", b"old-secret-0123456789"])
        part = {"type": "image_url", "image_url": None, "uuid": UID}
        d = await st.gw.prepare("chat", "a", body_of(st.model, part), {}, "x", explain_only=True)
        assert len(d.salts) == 2
        names, salts = set(), set()
        for index in (0, 1):
            up = orjson.loads(st.gw.upstream_body(dataclasses.replace(d, salt_index=index)))
            names.add(up["messages"][0]["content"][1]["uuid"])
            salts.add(up["cache_salt"])
        assert len(salts) == 2  # served under either secret's salt
        assert names == {sent_part(chat(part), st.gw.minter.salt(d.scope))["uuid"]}


class Recorder:
    """ASGI wrapper of a simulated replica: records the JSON body of each request to one
    of ``paths`` and replays it to the replica."""

    def __init__(self, app: Any, paths: set[str], seen: list[tuple[str, Any]]) -> None:
        self.app, self.paths, self.seen = app, paths, seen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        chunks = []
        for _ in range(100_000):  # bounded
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        self.seen.append((scope["path"], json.loads(raw)))
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@pytest.mark.parametrize("kind", ["engine_render", "engine_tokenize"])
async def test_the_engines_render_and_tokenize_calls_get_the_scoped_uuids(kind: str) -> None:
    """V8: under engine tokenizers the gateway's own call to the replica's render or
    /tokenize sent the client's uuids raw (vLLM's render runs the multimodal processor:
    a yes/no oracle on another scope's uuid). It now sends the name the generation body
    gets."""
    path = "/v1/chat/completions/render" if kind == "engine_render" else "/tokenize"
    policy = f"models: {{default: {{tokenizer: {kind}}}}}"
    build = {"key_store": key_store()}
    async with stack(count=1, build=build, open_access=False, policy=policy) as st:
        seen: list[tuple[str, Any]] = []
        for server in st.fleet.servers:
            # inside the middleware the server's open connections already hold
            outer = server.config.loaded_app
            outer.app = Recorder(outer.app, {path}, seen)
        # a text part with a uuid: the simulated replica renders it, so the request is
        # prepared and the generation body can be compared with what the render got
        text_uuid = {"type": "text", "text": "x", "uuid": UID}
        d = await st.gw.prepare(
            "chat", "b", body_of(st.model, text_uuid), {}, "x", explain_only=True
        )
        generation = orjson.loads(st.gw.upstream_body(d))["messages"][0]["content"][1]
        assert [p for p, _ in seen] == [path]
        rendered = seen[0][1]["messages"][0]["content"][1]
        assert rendered["uuid"] == generation["uuid"] != UID
        # media parts naming a's uuid: the simulated replica refuses media (vLLM renders
        # it), but what reached it is what counts
        for part in UUID_ITEMS:
            seen.clear()
            with pytest.raises(GatewayError):
                await st.gw.prepare(
                    "chat", "b", body_of(st.model, part), {}, "x", explain_only=True
                )
            assert len(seen) == 1, part
            assert UID not in json.dumps(seen[0][1]), part
            assert seen[0][1]["messages"][0]["content"][1]["uuid"] == generation["uuid"]
