"""The replica's HTTP API through the real ``openai`` SDK and plain HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from cachecore.replica import Fleet, ReplicaSettings, run_fleet
from cachecore.tokenizer import HFTokenizer, builtin_tokenizer

MODEL = "kvgate-sim-8b"


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[HFTokenizer]:
    yield builtin_tokenizer()


@pytest.fixture
async def fleet(tokenizer: HFTokenizer) -> AsyncIterator[Fleet]:
    settings = ReplicaSettings(time_scale=0.02, hash_seed=3, lora=["support-bot"])
    async with run_fleet(settings, count=1, tokenizer=tokenizer) as f:
        yield f


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def http(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as c:
        yield c


def text_of(tokenizer: HFTokenizer, n: int, offset: int = 0) -> str:
    return tokenizer.word_vocabulary.text_from_ids(range(offset, offset + n))


async def test_chat_and_completions_json_and_streaming(
    client: AsyncOpenAI, tokenizer: HFTokenizer
) -> None:
    msgs: Any = [{"role": "user", "content": "name three colours"}]
    chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7)
    content = chat.choices[0].message.content or ""
    assert len(tokenizer.encode(content)) == 7 and content.split() and content.startswith(" ")
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 7
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(msgs))

    stream = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=7, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == content  # same prompt, same output
    assert len(pieces) == 7 and finish == "length"
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 16 * ((usage.prompt_tokens - 1) // 16)

    comp = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5)
    assert comp.choices[0].finish_reason == "length" and comp.usage is not None
    assert comp.usage.completion_tokens == 5
    stream2 = await client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=5, stream=True
    )
    texts = [c.choices[0].text async for c in stream2 if c.choices]
    assert "".join(texts) == comp.choices[0].text and len(texts) == 5
    by_ids = await client.completions.create(
        model=MODEL, prompt=tokenizer.encode("once upon a time"), max_tokens=5
    )
    assert by_ids.choices[0].text == comp.choices[0].text


async def test_sse_wire_format_ends_with_done(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) == 4


async def test_shared_prefix_hits_and_salt_isolation(
    client: AsyncOpenAI, tokenizer: HFTokenizer
) -> None:
    system = text_of(tokenizer, 2048)

    async def ask(question: str, salt: str | None = None) -> int:
        msgs: Any = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        extra = {"cache_salt": salt} if salt else None
        r = await client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, extra_body=extra
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached is not None
        return cached

    assert await ask("first question") == 0
    assert await ask("a different question") >= 2048 - 16
    assert await ask("a different question", salt="kvg1:tenant-b") == 0
    assert await ask("yet another one", salt="kvg1:tenant-b") >= 2048 - 16
    assert await ask("yet another one", salt="kvg1:tenant-c") == 0


async def test_errors_are_openai_error_objects(
    client: AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="gpt-nope", messages=msgs)
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=MODEL, messages=msgs, extra_body={"cache_salt": ""}
        )
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=40_000)
    assert "maximum context length" in str(too_long.value)
    # unknown fields are ignored
    ok = await client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2,
        extra_body={"ignore_eos": True, "top_k": 5, "whatever": {"x": 1}}, temperature=0.3,
    )  # fmt: skip
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    for body in (b"{not json", b"[1, 2]"):
        r = await http.post("/v1/completions", content=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == 400 and err["type"] == "BadRequestError"
        assert set(err) == {"message", "type", "param", "code"}
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["message"]


async def test_tokenize_detokenize_render(http: httpx.AsyncClient, tokenizer: HFTokenizer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = tokenizer.encode_chat(msgs)
    r = await http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": msgs})
    assert r.status_code == 200 and r.json()["token_ids"] == expected
    t = (await http.post("/tokenize", json={"model": MODEL, "messages": msgs})).json()
    assert t["tokens"] == expected and t["count"] == len(expected) and t["max_model_len"] > 0
    t2 = (await http.post("/tokenize", json={"prompt": "hello world"})).json()
    assert t2["tokens"] == tokenizer.encode("hello world") and t2["token_strs"] is None
    d = (await http.post("/detokenize", json={"model": MODEL, "tokens": t2["tokens"]})).json()
    assert d == {"prompt": "hello world"}
    rc = await http.post("/v1/completions/render", json={"model": MODEL, "prompt": "hello world"})
    assert rc.json()["token_ids"] == t2["tokens"]


async def test_models_health_load_and_info(http: httpx.AsyncClient, fleet: Fleet) -> None:
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "support-bot"]
    assert models["data"][1]["parent"] == MODEL
    assert (await http.get("/health")).status_code == 200
    load = (await http.get("/get_load")).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    info = (await http.get("/get_server_info")).json()
    assert info["block_size"] == 16 and info["num_gpu_blocks"] == 4096
    assert info["kv_events"]["endpoint"] == fleet.endpoints[0].events_endpoint
    assert (await http.get("/get_model_info")).json()["model_path"] == MODEL
    # chaos: unhealthy
    await http.post("/debug/health", json={"healthy": False})
    assert (await http.get("/health")).status_code == 503


async def test_load_is_visible_while_requests_run(
    fleet: Fleet, http: httpx.AsyncClient, tokenizer: HFTokenizer
) -> None:
    body = {"model": MODEL, "prompt": text_of(tokenizer, 64), "max_tokens": 400}
    task = asyncio.create_task(http.post("/v1/completions", json=body))
    for _ in range(200):
        load = (await http.get("/get_load")).json()[0]
        if load["num_reqs"] == 1:
            break
        await asyncio.sleep(0.01)
    assert load["num_reqs"] == 1 and load["num_tokens"] >= 64
    r = await http.post("/flush_cache")  # blocks in use: refused, nothing changes
    assert r.status_code == 400 and "running" in r.json()["error"]["message"]
    r = await http.post("/reset_prefix_cache")  # vLLM's shape: 200, success false
    assert r.status_code == 200 and r.json() == {"success": False}
    fams = {m.name: m for m in text_string_to_metric_families((await http.get("/metrics")).text)}
    assert fams["vllm:num_requests_running"].samples[0].value == 1
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value > 0
    (running,) = fleet.replicas[0].core.running
    fleet.replicas[0].driver.abort(running.request_id)
    aborted = await asyncio.wait_for(task, 5)
    assert aborted.status_code == 503 and "aborted" in aborted.json()["error"]["message"]


async def test_metrics_names_and_values(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    for _ in range(2):
        await client.completions.create(model=MODEL, prompt="x " * 40, max_tokens=3)
    fams = {m.name: m for m in text_string_to_metric_families((await http.get("/metrics")).text)}
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:cache_config_info", "process_start_time_seconds", "kvgate_replica_loop_lag_seconds",
    ):  # fmt: skip
        assert name in fams, name
    for name in ("vllm:num_requests_running", "vllm:prefix_cache_hits", "vllm:cache_config_info"):
        assert all(s.labels.get("model_name") == MODEL for s in fams[name].samples)
    hits = fams["vllm:prefix_cache_hits"].samples[0]
    assert hits.name == "vllm:prefix_cache_hits_total" and hits.value >= 32
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "4096"
    ttft = {s.name: s.value for s in fams["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 2


async def test_flush_cache_when_idle(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
    await client.completions.create(model=MODEL, prompt="y " * 64, max_tokens=2)
    assert (await http.get("/debug/blocks")).json()["num_cached_blocks"] > 0
    r = await http.post("/flush_cache")
    assert r.status_code == 200
    assert (await http.get("/debug/blocks")).json()["blocks"] == []
    r = await http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    again = await client.completions.create(model=MODEL, prompt="y " * 64, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0


async def test_lora_adapter_enters_every_block(
    client: AsyncOpenAI, http: httpx.AsyncClient, tokenizer: HFTokenizer
) -> None:
    prompt = text_of(tokenizer, 40, 500)
    r = await client.completions.create(
        model="support-bot", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "kvg1:t"}
    )
    assert r.model == "support-bot"
    blocks = (await http.get("/debug/blocks")).json()["blocks"]
    keyed = sorted((b["parent_block_hash"] is not None, b["extra_keys"]) for b in blocks)
    assert keyed == [(False, ["support-bot", "kvg1:t"]), (True, ["support-bot"])]
    base = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "kvg1:t"}
    )
    assert base.usage is not None and base.usage.prompt_tokens_details is not None
    assert base.usage.prompt_tokens_details.cached_tokens == 0  # adapters never share


async def test_client_disconnect_aborts_the_request(fleet: Fleet, http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 2000, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += bool(line)
            if n == 3:
                break
    core = fleet.replicas[0].core
    for _ in range(200):
        if not core.has_work():
            break
        await asyncio.sleep(0.01)
    assert not core.has_work() and core.pool.num_used_blocks == 0


async def test_client_disconnect_aborts_a_non_streamed_request(
    fleet: Fleet, http: httpx.AsyncClient
) -> None:
    """vLLM cancels a non-streamed request whose client hung up; so does the replica."""
    core = fleet.replicas[0].core
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 2000}
    request = asyncio.ensure_future(http.post("/v1/completions", json=body))
    for _ in range(200):  # bounded: until the engine runs it
        if core.has_work():
            break
        await asyncio.sleep(0.01)
    assert core.has_work()
    request.cancel()  # closes the connection
    with contextlib.suppress(asyncio.CancelledError):
        await request
    for _ in range(200):
        if not core.has_work():
            break
        await asyncio.sleep(0.01)
    assert not core.has_work() and core.pool.num_used_blocks == 0


async def test_restart_fails_in_flight_requests(fleet: Fleet, http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "z", "max_tokens": 1000, "stream": True}
    t0 = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        lines: list[str] = []
        async for line in r.aiter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 2:
                assert (await http.post("/debug/restart")).status_code == 200
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert time.monotonic() - t0 < 5
    assert fleet.replicas[0].num_restarts == 1


async def test_render_caches_long_segments_per_salt(
    http: httpx.AsyncClient, fleet: Fleet, tokenizer: HFTokenizer
) -> None:
    # a router that renders every request on every replica: the shared system prompt is
    # tokenized once per scope, the answer stays exact
    system = text_of(tokenizer, 1500)
    assert len(system) > 4096  # the threaded, cached path
    app = fleet.servers[0].config.app
    assert isinstance(app, FastAPI)
    segments = app.state.segments
    for k in range(3):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"q{k}"}]
        r = await http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": msgs})
        assert r.json()["token_ids"] == tokenizer.encode_chat(msgs)
    assert segments.hits == 1  # admitted on second sight, hit on the third
    # another cache salt is another scope: no hit on the unsalted entry
    misses = segments.misses
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 1, "cache_salt": "tenant-b"}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(msgs))
    assert segments.hits == 1 and segments.misses > misses


async def test_request_id_from_the_header_first_and_a_running_one_is_refused(
    tokenizer: HFTokenizer,
) -> None:
    """vLLM's engine id is ``X-Request-Id``, else the body's ``request_id``; an id still
    running is refused. The driver used to accept it once the core was done with the first
    request but its outputs were not yet delivered: the second took the first's answer and
    the first hung."""
    slow = ReplicaSettings(time_scale=1.0)  # a 1,600-token prefill: ~0.43 s of real time
    async with (
        run_fleet(slow, count=1, tokenizer=tokenizer) as f,
        httpx.AsyncClient(base_url=f.urls[0], timeout=10) as h,
    ):
        body = {"model": MODEL, "max_tokens": 1, "request_id": "from-body"}
        r = await h.post("/v1/completions", json={**body, "prompt": "hi"})
        assert r.json()["id"] == "cmpl-from-body"
        r = await h.post(
            "/v1/completions", json={**body, "prompt": "hi"}, headers={"x-request-id": "hdr"}
        )
        assert r.json()["id"] == "cmpl-hdr"
        msgs = [{"role": "user", "content": text_of(tokenizer, 1600, 7)}]
        first = asyncio.create_task(
            h.post(
                "/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 1, "messages": msgs},
                headers={"x-request-id": "dup"},
            )
        )
        # duplicates only once the first is in the engine: sent earlier, a duplicate could
        # reach the replica first and take the id (CI saw the first refused that way)
        driver = f.replicas[0].driver
        for _ in range(300):  # bounded: ~3 s
            if driver.num_in_flight == 1 or first.done():
                break
            await asyncio.sleep(0.005)
        refused = 0
        for _ in range(200):  # bounded: ~4 s; duplicates over the first's whole life
            if first.done():
                break
            r = await h.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"x-request-id": "dup"},
            )
            if r.status_code == 200:  # only once the first has been answered
                assert first.done()
                break
            assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
            refused += 1
            await asyncio.sleep(0.02)
        r = await first
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-dup" and refused >= 3
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(msgs))


@pytest.mark.parametrize(
    ("value", "status"), [("yes", 200), ("false", 200), (1, 200), ("maybe", 400), (2, 400)]
)
async def test_tokenize_flags_are_lax_bools_as_in_vllm(
    http: httpx.AsyncClient, value: object, status: int
) -> None:
    """vLLM's request models are plain pydantic models (not strict): a bool field takes
    "yes"/"false"/1 and refuses "maybe" or 2 with a 400. The simulated replica answers the
    same, so a client (or the gateway's engine tokenization) sees what vLLM would do."""
    body = {"prompt": "hello", "add_special_tokens": value}
    resp = await http.post("/tokenize", json=body)
    assert resp.status_code == status, resp.text
    if status == 400:
        assert resp.json()["error"]["param"] == "add_special_tokens"


async def test_a_bad_data_parallel_rank_header_is_quoted_as_text(tokenizer: HFTokenizer) -> None:
    """The 400 for X-data-parallel-rank: 2 on a two-core replica said "got b'2'" (the
    header's bytes repr)."""
    settings = ReplicaSettings(time_scale=0.05, data_parallel_size=2)
    async with (
        run_fleet(settings, count=1, tokenizer=tokenizer) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0]) as h,
    ):
        body = {"prompt": "hello", "max_tokens": 1}
        r = await h.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "2"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "X-data-parallel-rank must be 0 to 1, got '2'"
