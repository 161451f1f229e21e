"""A data-parallel simulated replica: several engine cores (:class:`SimReplica`, each with
its own KV cache, driver and event stream) behind one HTTP port, as vLLM serves
``--data-parallel-size N`` with its internal load balancing.

What the front does, as vLLM's API server does it:

* a completion request naming a rank in ``X-data-parallel-rank`` runs on that core (a
  header that is not a rank of this server is a 400); without one, on the core with the
  fewest queued requests (waiting count four times, running once; ties in turn);
* ``/metrics`` is one exposition holding every core's engine series, labelled
  ``engine="N"`` (``process_start_time_seconds`` once: the newest core's, so a restarted
  core reads as a restarted server to every agent, which resyncs);
* ``/get_load`` lists every core (SGLang's shape, ``dp_rank`` set); ``/flush_cache`` and
  ``/reset_prefix_cache`` reset every core;
* everything else (``/health``, ``/v1/models``, tokenization, the debug endpoints) is core
  0's, or the named core's when the header names one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cachecore.replica.app import create_app
from cachecore.replica.protocol import error_body
from cachecore.replica.server import SimReplica

RANK_HEADER = b"x-data-parallel-rank"
START_TIME = "process_start_time_seconds"
_FAN_OUT = ("/flush_cache", "/reset_prefix_cache")


class RankLabelledCollector(Collector):
    """Every core's registry as one, each sample labelled with its core (``engine``)."""

    def __init__(self, ranks: Sequence[SimReplica]) -> None:
        self._ranks = ranks

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        start: Sample | None = None
        for rank, rep in enumerate(self._ranks):
            for fam in rep.metrics.registry.collect():
                if fam.name == START_TIME:
                    newest = max(fam.samples, key=lambda s: s.value, default=None)
                    if newest is not None and (start is None or newest.value > start.value):
                        start = newest
                    continue
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    labels = {**s.labels, "engine": str(rank)}
                    out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
        yield from merged.values()
        if start is not None:
            fam = Metric(START_TIME, "Start time of the (simulated) engine process.", "gauge")
            fam.samples.append(start)
            yield fam


class DataParallelFront:
    """The ASGI app of one data-parallel replica: routes each request to a core's app."""

    def __init__(self, ranks: Sequence[SimReplica]) -> None:
        if len(ranks) < 2:
            raise ValueError("a data-parallel replica has two or more cores")
        self.ranks = list(ranks)
        self.apps: list[ASGIApp] = [create_app(r) for r in self.ranks]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RankLabelledCollector(self.ranks))
        self._turn = itertools.cycle(range(len(self.ranks)))
        self.requests_by_rank = [0] * len(self.ranks)  # completions routed to each core

    def least_loaded(self) -> int:
        """vLLM's balancing score, waiting x 4 + running; ties in turn."""
        first = next(self._turn)
        n = len(self.ranks)
        order = [(first + i) % n for i in range(n)]

        def score(r: int) -> int:
            core = self.ranks[r].core
            return 4 * len(core.waiting) + len(core.running)

        return min(order, key=score)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.apps[0](scope, receive, send)
            return
        path: str = scope["path"]
        named = next((v for k, v in scope["headers"] if k.lower() == RANK_HEADER), None)
        rank: int | None = None
        if named is not None:
            try:
                rank = int(named)
            except ValueError:
                rank = -1
            if not 0 <= rank < len(self.ranks):
                got = named.decode("latin-1")  # header bytes: the repr said b'2'
                msg = f"X-data-parallel-rank must be 0 to {len(self.ranks) - 1}, got {got!r}"
                await _json(400, error_body(msg, 400, "BadRequestError"))(scope, receive, send)
                return
        if path == "/metrics":
            body = generate_latest(self.registry)
            await Response(body, 200, media_type=CONTENT_TYPE_LATEST)(scope, receive, send)
        elif path == "/get_load":
            await _json(200, [rep.load() for rep in self.ranks])(scope, receive, send)
        elif path in _FAN_OUT and rank is None:
            await self._fan_out(scope, send)
        else:
            if rank is None:
                generates = scope["method"] == "POST" and path.endswith("completions")
                rank = self.least_loaded() if generates else 0
            if path.endswith("completions"):
                self.requests_by_rank[rank] += 1
            await self.apps[rank](scope, receive, send)

    async def _fan_out(self, scope: Scope, send: Send) -> None:
        """Every core's answer to a body-less request; the first that failed, else core 0's."""
        answers: list[tuple[int, list[Message]]] = []
        for app in self.apps:
            got: list[Message] = []

            async def receive() -> Message:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def collect(message: Message, got: list[Message] = got) -> None:
                got.append(message)

            await app(dict(scope), receive, collect)
            status = next((m["status"] for m in got if m["type"] == "http.response.start"), 500)
            answers.append((status, got))
        status, messages = next((a for a in answers if a[0] >= 400), answers[0])
        for m in messages:
            await send(m)


def _json(status: int, data: Any) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")
