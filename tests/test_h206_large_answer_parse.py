"""A large non-streamed answer's usage is read off its tail, not by parsing it whole (H206).

The relay parsed every JSON answer whole to read its top-level ``usage``: for an
embedding's floats that parse costs several times the answer (5M float objects for
100 MiB), so a tenant choosing large batches could run the gateway out of memory with a
few concurrent requests under ``KVGATE_MAX_UPSTREAM_BODY_BYTES`` (512 MiB). Now an answer
over 1 MiB that is no Responses object has its last ``usage`` key, when near its end,
parsed alone (vLLM ends its pooling answers with it); the usage read is the whole parse's,
and a truncated answer is still refused."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from pydantic import SecretStr

from cachecore.httpread import AnswerTooLarge
from cachecore.testing import free_port
from gateway import proxy
from gateway.core import Outcome
from gateway.hotpath import HotCycle
from gateway.proxy import UpstreamExchange, _usage_tail
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET, stack, words
from tests.test_h24_query_of_death import MODELS, read_request
from tests.test_pooling_gateway import _bodies
from tests.test_rc_body_bound_review import _gateway

pytestmark = pytest.mark.timeout(90)

USAGE = {"prompt_tokens": 8, "total_tokens": 8, "completion_tokens": 0,
         "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def embeddings(size: int, usage: Any = USAGE) -> bytes:
    """A vLLM-shaped float embeddings answer of about ``size`` bytes (vectors of 1024)."""
    vector = b",".join([b"-0.012345678901234567"] * 1024)
    head = b'{"id":"embd-1","object":"list","created":1,"model":"m","data":['
    tail = b'],"usage":' + orjson.dumps(usage) + b"}"
    items: list[bytes] = []
    n = len(head) + len(tail)
    while n < size:
        items.append(b'{"index":%d,"object":"embedding","embedding":[%s]}' % (len(items), vector))
        n += len(items[-1]) + 1
    return head + b",".join(items) + tail


@contextlib.asynccontextmanager
async def _engine(answers: list[tuple[int, bytes]]) -> AsyncIterator[str]:
    """A loopback engine answering each embeddings request (and poll) with the next of
    ``answers`` (status, body; made by the caller, so its bytes are not the gateway's to
    count), the last again."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(20):  # bounded: a test sends a few requests
                path, _ = await read_request(reader)
                if path.startswith((b"/v1/embeddings", b"/v1/responses/")):
                    status, answer = answers.pop(0) if len(answers) > 1 else answers[0]
                else:  # /health, /v1/models
                    status, answer = 200, MODELS
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % (status, len(answer))
                )
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def outcomes(monkeypatch: pytest.MonkeyPatch) -> list[Outcome]:
    """Each exchange's outcome, as the gateway charges it."""
    seen: list[Outcome] = []
    finish = UpstreamExchange._finish

    def recorded(self: UpstreamExchange, out: Outcome) -> None:
        seen.append(out)
        finish(self, out)

    monkeypatch.setattr(UpstreamExchange, "_finish", recorded)
    return seen


async def test_a_large_float_answer_is_not_parsed_whole(
    monkeypatch: pytest.MonkeyPatch, outcomes: list[Outcome]
) -> None:
    size = 32 * 1024 * 1024
    body = embeddings(size)
    peaks: list[int] = []
    answer = HotCycle.answer

    async def measured(self: HotCycle, status: int, headers: Any, data: Any) -> None:
        # read off its tail, the answer comes in its chunks (H209)
        n = len(data) if isinstance(data, bytes) else sum(map(len, data))
        if n == len(body) and tracemalloc.is_tracing():
            peaks.append(tracemalloc.get_traced_memory()[1])
        await answer(self, status, headers, data)

    monkeypatch.setattr(HotCycle, "answer", measured)
    request = {"model": "m", "input": "hello there"}
    async with _engine([(200, body)]) as url, _gateway(url) as h:
        assert (await h.post("/v1/embeddings", json=request)).content == body  # a warm-up
        tracemalloc.start()
        try:
            r = await h.post("/v1/embeddings", json=request)
        finally:
            tracemalloc.stop()
        assert r.status_code == 200 and r.content == body
    # the gateway's peak of allocations since the start, up to the write: the answer's
    # read (its chunks and their join, 2n); parsed whole, its floats came on top (~14n)
    assert len(peaks) == 1
    assert peaks[0] < 2.5 * len(body), peaks[0] / len(body)
    assert [
        (o.status, o.prompt_tokens, o.cached_tokens, o.completion_tokens) for o in outcomes
    ] == [(200, 8, 0, 0)] * 2


def _same_usage(raw: bytes) -> bool:
    """``_usage_tail`` on ``raw`` agrees with the whole parse; True if it read the tail."""
    tail = _usage_tail(raw)
    if tail is None:
        return False
    whole = orjson.loads(raw)
    assert isinstance(whole, dict) and "usage" in whole, raw[-300:]
    assert tail["usage"] == whole["usage"], raw[-300:]
    return True


async def test_the_replicas_answers_read_the_whole_parses_usage(
    monkeypatch: pytest.MonkeyPatch, outcomes: list[Outcome]
) -> None:
    tails: list[bool] = []

    def spied(raw: bytes, start: bytes | None = None) -> dict[str, Any] | None:
        got = _usage_tail(raw, start)
        tails.append(got is not None)
        return got

    monkeypatch.setattr(proxy, "_usage_tail", spied)
    async with stack(count=1) as st, st.http() as h:
        replica = st.fleet.endpoints[0].url
        bodies = _bodies(st.model)
        for fmt in ("float", "base64"):
            bodies[f"/v1/embeddings {fmt}"] = {
                "model": st.model,
                "input": "a b",
                "encoding_format": fmt,
            }
            bodies[f"/pooling {fmt}"] = {**bodies["/pooling"], "encoding_format": fmt}
        for key, body in bodies.items():
            r = await h.post(replica + key.split()[0], json=body)
            assert r.status_code == 200, (key, r.text)
            assert _same_usage(r.content), key  # each ends with (or nearly) its usage
        # large answers through the gateway: charged the usage they report
        for fmt, n in (("float", 300), ("base64", 900)):
            body = {
                "model": st.model,
                "input": [words(3, i) for i in range(n)],
                "encoding_format": fmt,
            }
            outcomes.clear()
            r = await h.post("/v1/embeddings", json=body)
            assert r.status_code == 200 and len(r.content) > 1 << 20, (fmt, r.text[:300])
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] > n
            got = outcomes[0]
            assert (got.prompt_tokens, got.completion_tokens) == (
                usage["prompt_tokens"], usage.get("completion_tokens")
            ), fmt  # fmt: skip
        assert tails == [True, True]  # the two large answers' usage read off their tails


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.random() * 10 ** rng.randint(-5, 5)
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind in (3, 4):  # strings that look like a usage key, braces, quotes, escapes
        return rng.choice([
            '"usage":{"prompt_tokens":1}}', '\\"usage\\":', ',"usage":{}', "{,}", "\\",
            'x","usage":{"prompt_tokens":9}}', base64.b64encode(rng.randbytes(30)).decode(),
            "usage", "é\u2028\"usage\"", "",
        ])  # fmt: skip
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = ["a", "data", 'k"usage', "usage\\", "usage ", "results", "usage"]
    out = {rng.choice(keys): _value(rng, depth) for _ in range(rng.randrange(5))}
    if depth == 0 and rng.random() < 0.8:  # the top level's usage at a random place
        items = list(out.items())
        usage: dict[str, Any] = {"prompt_tokens": rng.randrange(10**6)}
        usage["completion_tokens"] = rng.randrange(99)
        if rng.random() < 0.5:
            usage["prompt_tokens_details"] = {"cached_tokens": rng.randrange(99)}
        items.insert(rng.randrange(len(items) + 1), ("usage", rng.choice([usage, None, 3, "x"])))
        out = dict(items)
    return out


def test_usage_read_off_the_tail_is_the_whole_parses() -> None:
    rng = random.Random(206)
    tails = 0
    for _ in range(3000):  # bounded
        obj = _object(rng, 0)
        dumps = [
            orjson.dumps(obj),
            json.dumps(obj, indent=rng.choice([None, 1, 4])).encode(),
            json.dumps(obj, ensure_ascii=False, separators=(" , ", " : ")).encode() + b"\n",
        ]
        for raw in dumps:
            tails += _same_usage(raw)
    assert tails > 3000, tails  # most: those ending with their usage or near it
    # by hand: a usage key in a string, nested, repeated, or none at the top level
    for raw, want in [
        (b'{"a":"x\\",\\"usage\\":{\\"prompt_tokens\\":1}}","usage":{"prompt_tokens":2}}', 2),
        (b'{"usage":{"prompt_tokens":1},"b":2,"usage":{"prompt_tokens":3}}', 3),
        (b'{"usage":{"prompt_tokens":1},"r":[{"text":"\\"usage\\":{}"}]}', 1),
        (b'{"k\\"usage":{"prompt_tokens":1}}', None),
        (b'{"a":{"usage":{"prompt_tokens":1}}}', None),
        (b'{"a":["usage",{"usage":{"prompt_tokens":1}}]}', None),
        (b'{"a":"usage","b":{"prompt_tokens":1}}', None),
    ]:
        tail = _usage_tail(raw)
        assert (tail["usage"]["prompt_tokens"] if tail is not None else None) == want, raw
        if tail is not None:
            assert tail["usage"] == orjson.loads(raw)["usage"]


def test_a_truncated_or_foreign_body_is_parsed_whole() -> None:
    raw = embeddings(2 << 20)
    assert _usage_tail(raw) is not None
    rng = random.Random(6)
    cuts = [*range(len(raw) - 400, len(raw)), *(rng.randrange(len(raw)) for _ in range(50))]
    for cut in cuts:  # bounded: 450
        assert _usage_tail(raw[:cut]) is None, cut
    for bad in (b"[" + raw[1:], b"x" + raw, raw + b"}", raw + b",", raw[:-1] + b"]"):
        assert _usage_tail(bad) is None, bad[:10] + bad[-10:]
    assert _usage_tail(b" \r\n\t" + raw + b" \n") is not None  # JSON's whitespace


async def test_a_truncated_large_answer_is_refused(outcomes: list[Outcome]) -> None:
    raw = embeddings(2 << 20)
    cut = [raw[:-1], raw[: raw.rindex(b'"usage"')], raw[:-50], b"[" + raw[1:]]
    request = {"model": "m", "input": "hello"}
    # each after a whole one: three failures in a row would eject the replica
    answers = [(200, body) for bad in cut for body in (bad, raw)]
    async with _engine(answers) as url, _gateway(url) as h:
        for body in cut:
            r = await h.post("/v1/embeddings", json=request)
            assert r.status_code == 502, (len(body), r.text[:200])
            assert "not a JSON object" in r.json()["error"]["message"]
            assert (await h.post("/v1/embeddings", json=request)).content == raw
    assert [o.error for o in outcomes] == ["protocol", None] * len(cut)


async def test_a_polls_error_body_is_not_read() -> None:
    # a watcher's poll or an orphan's cancel reads a status other than 200 alone: an
    # error body over the bound raised AnswerTooLarge (a poll's: the watch ended as
    # too_large), one under it was read for nothing
    error = b'{"error":{"message":"' + b"x" * (2 << 20) + b'"}}'
    async with _engine([(500, error)]) as url:
        gs = GatewaySettings(
            replicas=[url], port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)],
            max_upstream_body_bytes=1 << 20,
        )  # fmt: skip
        gw = build_gateway(gs)
        async with serve_in_loop(gw):
            rep = gw.pool.get(gw.specs[0].id) if gw.pool is not None else None
            assert rep is not None
            try:
                resp = await gw._replica_read(rep, False, "/v1/responses/resp_x")
            except AnswerTooLarge:
                pytest.fail("an error body read to the bound")
            assert resp.status_code == 500 and resp.content == b""
