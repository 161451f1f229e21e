"""Stand-ins for the external engine side of the agent, for tests and ``kvgate bench
ingest``: a vLLM-format KV-event publisher (PUB + replay ROUTER, written from the facts
sheet) and a minimal engine HTTP surface (``/metrics`` with vLLM names, ``/v1/models``).

They let the agent's receive path be driven byte for byte (malformed frames, gaps, seq
resets, replays that start too late) where the simulated replica
(:mod:`cachecore.replica`) would only ever send well-formed traffic. Everything uses the
shared codec (:mod:`cachecore.kvevents`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from cachecore.kvevents import END_SEQ_BYTES, Encoding, EventBatch, encode_batch, seq_to_bytes
from cachecore.tasks import wait_to_end


class EventSource:
    """One engine's publisher: ``[topic, seq, payload]`` on PUB, a replay ROUTER answering
    ``[b"", start_seq]`` with every buffered batch ``>= start_seq`` then the ``-1`` marker.

    ``old_replay_format`` answers ``[b"", seq, payload]`` (older vLLM) instead of
    ``[b"", topic, seq, payload]``.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        old_replay_format: bool = False,
    ) -> None:
        self.ctx = ctx
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(pub_endpoint)
        self.router: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self.router = ctx.socket(zmq.ROUTER)
            # a whole replay must fit the send queue (the default 1,000 messages dropped
            # the rest of a 30,000-batch replay, which looked like a gap)
            self.router.setsockopt(zmq.SNDHWM, 0)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.old_replay_format = old_replay_format
        self.replay_requests: list[int] = []
        self.replay_enabled = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> EventSource:
        if self.router is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)

    # ---- publishing
    def next_payload(self, batch: EventBatch, encoding: Encoding = Encoding.MAP) -> bytes:
        return encode_batch(batch, encoding)

    async def publish(
        self, batch: EventBatch, encoding: Encoding = Encoding.MAP, *, send: bool = True
    ) -> int:
        """Publish one batch (``send=False``: buffer it for replay but lose it on the wire,
        a forced gap). Returns its seq."""
        return await self.publish_payload(encode_batch(batch, encoding), send=send)

    async def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq_to_bytes(seq), payload])
        return seq

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        """Anything at all on the wire (malformed-input tests); not buffered, no seq."""
        await self.pub.send_multipart(list(frames))

    def restart(self) -> None:
        """A new engine process: seq back to 0, replay buffer empty."""
        self.next_seq = 0
        self.buffer.clear()

    # ---- replay
    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            self.replay_requests.append(start)
            if not self.replay_enabled:
                continue  # a dead replay endpoint: the agent must time out
            for seq, payload in list(self.buffer):
                if seq >= start:
                    if self.old_replay_format:
                        msg = [ident, b"", seq_to_bytes(seq), payload]
                    else:
                        msg = [ident, b"", self.topic, seq_to_bytes(seq), payload]
                    await self.router.send_multipart(msg)
            end = [ident, b"", END_SEQ_BYTES, b""]
            if not self.old_replay_format:
                end = [ident, b"", self.topic, END_SEQ_BYTES, b""]
            await self.router.send_multipart(end)


class EngineStub:
    """The HTTP surface of an engine the agent reads: ``/metrics`` (vLLM names, facts §3)
    and ``/v1/models``. Fields are plain attributes; set ``up = False`` to answer 503."""

    def __init__(
        self,
        *,
        model: str = "stub-model",
        block_size: int = 16,
        num_gpu_blocks: int = 4096,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.start_time = time.time()
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.up = True
        self.scrapes = 0
        self.metrics_delay_s = 0.0  # a slow /metrics (the engine itself still serves)
        self.metrics_status = 200  # a broken /metrics (ditto)
        # > 0: /metrics answers at once but sends its text one line per this many seconds
        # (an engine or proxy that dribbles: each read is quick, the answer never ends)
        self.metrics_dribble_s = 0.0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/metrics")
        async def metrics() -> Response:
            self.scrapes += 1
            if not self.up:
                return PlainTextResponse("down", status_code=503)
            if self.metrics_delay_s > 0:
                await asyncio.sleep(self.metrics_delay_s)
            if self.metrics_status != 200:
                return PlainTextResponse("broken", status_code=self.metrics_status)
            if self.metrics_dribble_s > 0:
                return StreamingResponse(self._dribble(), media_type="text/plain")
            return PlainTextResponse(self.metrics_text())

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("", status_code=200 if self.up else 503)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            if not self.up:
                return JSONResponse({"error": "down"}, status_code=503)
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        config = uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def _dribble(self) -> AsyncIterator[bytes]:
        for line in self.metrics_text().splitlines(keepends=True) * 100:
            yield line.encode()
            await asyncio.sleep(self.metrics_dribble_s)

    def restart(self) -> None:
        self.start_time = time.time() + 0.5  # strictly later than the old process's

    def metrics_text(self) -> str:
        m = f'model_name="{self.model}"'
        return "\n".join(
            [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{m}}} {self.running}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{m}}} {self.waiting}",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{m}}} {self.kv_usage}",
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{self.block_size}",'
                f'num_gpu_blocks="{self.num_gpu_blocks}",enable_prefix_caching="True"}} 1.0',
                "# HELP process_start_time_seconds Start time of the process since unix epoch.",
                "# TYPE process_start_time_seconds gauge",
                f"process_start_time_seconds {self.start_time}",
                "",
            ]
        )

    async def start(self) -> EngineStub:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        for _ in range(500):
            if self._server.started:
                break
            await asyncio.sleep(0.01)
        return self

    async def close(self) -> None:
        """Stop the server (at most 5 s, then its task is cancelled) and close its socket.
        A cancellation of the caller is raised after that, not swallowed (the wait sat
        under ``suppress(CancelledError)``, and a cancelled test teardown went on)."""
        self._server.should_exit = True
        try:
            if self._task is not None:
                with contextlib.suppress(Exception):  # a stub: how it ended is no test's
                    await wait_to_end(self._task, 5.0, "engine stub stop")
        finally:
            self._sock.close()
