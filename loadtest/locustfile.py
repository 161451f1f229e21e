"""Locust load test against any OpenAI-compatible URL (the kvgate gateway or a peer router).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 2m \
        --host http://127.0.0.1:8000 --csv results/locust

Environment:
    KVGATE_LOCUST_MODEL     model name (default kvgate-sim-8b)
    KVGATE_LOCUST_KEYS      "tenant=key,tenant2=key2": API keys per tenant (default: no auth)
    KVGATE_LOCUST_STREAM    1 (default) to stream and record TTFT, 0 for plain JSON

Each user class is one traffic shape; pick some with Locust's class selection (``locust ...
SharedSystemPromptChat ShortUnique``) or run them all (``EmbedSharedDocs`` needs a
replica serving ``/v1/embeddings`` for ``KVGATE_LOCUST_MODEL``: a pooling model on vLLM, or
the simulated replica; ``ResponsesAgentChain`` one serving ``/v1/responses`` with its store:
vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, or the simulated replica). Each request is
one row of Locust's statistics, named after its class (``ResponsesAgentChain``'s first
turns and follow-ups apart), timed to its last byte (a streamed request's whole
stream, not just its response head, which is where Locust's own clock stops).

Streamed requests' TTFT (to the first content chunk) and engine-reported cached prompt
tokens are kept apart from Locust's request statistics (an extra row per request there
would double the "Aggregated" count and rate): at the end of the run they are printed as a
table per class and, with ``--csv PREFIX``, written to ``PREFIX_ttft.csv``. One Locust
process (``--headless``, no workers): each worker would see only its own requests.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from locust import HttpUser, between, events, task
from locust.env import Environment
from requests import RequestException

from loadtest.workloads import TextSource

MODEL = os.environ.get("KVGATE_LOCUST_MODEL", "kvgate-sim-8b")


def _stream_flag(text: str) -> bool:
    """KVGATE_LOCUST_STREAM: "false" (or "no") streamed, as anything but "0" did."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    # Locust prints the message and exits 1 before any user starts
    raise SystemExit(f"KVGATE_LOCUST_STREAM must be 1 or 0 (true/false), got {text!r}")


STREAM = _stream_flag(os.environ.get("KVGATE_LOCUST_STREAM", "1"))
TTFT_KEY = "kvgate_ttft"  # in a request event's context: (TTFT ms, cached prompt tokens)


@dataclass
class TtftLog:
    """Per user class: (TTFT ms, cached prompt tokens) of each streamed request."""

    rows: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def add(self, name: str, ttft_ms: float, cached: int) -> None:
        self.rows.setdefault(name, []).append((ttft_ms, cached))

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for name, rows in sorted(self.rows.items()):
            ttfts = sorted(t for t, _ in rows)

            def pct(q: float, ttfts: list[float] = ttfts) -> float:
                return ttfts[min(len(ttfts) - 1, math.ceil(q * len(ttfts)) - 1)]

            out.append(
                {
                    "user class": name,
                    "requests": len(rows),
                    "TTFT p50 ms": pct(0.50),
                    "p90 ms": pct(0.90),
                    "p99 ms": pct(0.99),
                    "mean cached tokens": sum(c for _, c in rows) / len(rows),
                }
            )
        return out


def _failure(resp: Any) -> str:
    if resp.status_code == 0:  # no HTTP answer: the connection error itself
        return repr(getattr(resp, "error", None))
    return f"HTTP {resp.status_code}: {resp.text[:120]}"


def _keys() -> dict[str, str]:
    raw = os.environ.get("KVGATE_LOCUST_KEYS", "")
    pairs = (p.split("=", 1) for p in raw.split(",") if "=" in p)
    return {t.strip(): k.strip() for t, k in pairs}


class OpenAIUser(HttpUser):
    """Base: sends one chat or completion request and records TTFT and cached tokens."""

    abstract = True
    wait_time = between(0.5, 2.0)
    tenant = "default"
    _text: TextSource | None = None
    _ids = itertools.count()
    ttft = TtftLog()  # one per Locust process (see the module docstring)

    @classmethod
    def text(cls) -> TextSource:
        if OpenAIUser._text is None:
            OpenAIUser._text = TextSource()
        return OpenAIUser._text

    def headers(self, tenant: str, session: str | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        key = _keys().get(tenant)
        if key:
            h["authorization"] = f"Bearer {key}"
        if session:
            h["x-session-id"] = session
        return h

    def send(
        self, body: dict[str, Any], chat: bool, tenant: str, session: str | None = None
    ) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        name = type(self).__name__
        body = {"model": MODEL, **body}
        if not STREAM:
            with self.client.post(
                path,
                json=body,
                headers=self.headers(tenant, session),
                name=name,
                catch_response=True,
            ) as resp:
                if resp.status_code != 200:
                    resp.failure(_failure(resp))
            return
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        ttft: float | None = None
        cached = 0
        with self.client.post(
            path,
            json=body,
            headers=self.headers(tenant, session),
            name=name,
            stream=True,
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(_failure(resp))
                return
            received = 0
            done = False
            try:
                for raw in resp.iter_lines():
                    received += len(raw) + 1
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        resp.failure(str(obj["error"])[:120])
                        return
                    choices = obj.get("choices") or []
                    if ttft is None and any(
                        (c.get("delta") or {}).get("content") or c.get("text") for c in choices
                    ):
                        ttft = time.perf_counter() - t0
                    usage = obj.get("usage") or {}
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens") or cached)
            except (RequestException, ValueError, TypeError, AttributeError) as exc:
                # a stream cut mid-way (ChunkedEncodingError) or a chunk that is no JSON
                # object: a failed request in the statistics, not an exception Locust logs
                # apart while the request is never counted
                resp.failure(f"broken stream: {type(exc).__name__}: {str(exc)[:100]}")
                return
            if not done:  # every OpenAI-compatible stream ends so; without it, it was cut
                resp.failure("stream ended without data: [DONE]")
                return
            # Locust timed the response head: the request's time is its whole stream
            meta = resp.request_meta
            meta["response_time"] = (time.perf_counter() - t0) * 1000
            meta["response_length"] = received
            if ttft is not None:  # reaches the TTFT log with the request's own event
                meta["context"] = {**(meta.get("context") or {}), TTFT_KEY: (ttft * 1000, cached)}


def _log_ttft(name: str, context: Any = None, exception: Any = None, **_: Any) -> None:
    got = (context or {}).get(TTFT_KEY) if exception is None else None
    if got is not None:
        OpenAIUser.ttft.add(name, *got)


def _report_ttft(environment: Environment, **_: Any) -> None:
    rows = OpenAIUser.ttft.summary()
    if not rows:
        return
    cols = list(rows[0])
    print("\nstreamed requests: TTFT and engine-reported cached prompt tokens")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{v:,.1f}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_ttft.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)


class SharedSystemPromptChat(OpenAIUser):
    """Many users of one assistant: a 2,048-token system prompt from a few variants."""

    @task
    def ask(self) -> None:
        n = next(self._ids)
        system = self.text().block(f"loc-sys-{n % 4}", 2048)
        question = self.text().block(f"loc-q-{n}-{random.random()}", 96)
        self.send(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 64,
            },
            chat=True,
            tenant=self.tenant,
        )


class MultiTurnSession(OpenAIUser):
    """A chat session that resends its whole history every turn."""

    def on_start(self) -> None:
        self.session = f"loc-s-{next(self._ids)}"
        self.history: list[dict[str, str]] = [
            {"role": "system", "content": self.text().block("loc-mt-sys", 512)}
        ]

    @task
    def turn(self) -> None:
        k = len(self.history)
        self.history.append(
            {"role": "user", "content": self.text().block(f"{self.session}-u{k}", 80)}
        )
        self.send(
            {"messages": list(self.history), "max_tokens": 48},
            chat=True,
            tenant=self.tenant,
            session=self.session,
        )
        self.history.append(
            {"role": "assistant", "content": self.text().block(f"{self.session}-a{k}", 48)}
        )
        if len(self.history) > 16:
            self.on_start()


class RagOverSharedDocs(OpenAIUser):
    """Questions over a small pool of shared documents (Zipf-popular)."""

    @task
    def ask(self) -> None:
        docs = sorted({min(int(random.paretovariate(1.2)) - 1, 19) for _ in range(2)})
        context = "".join(self.text().block(f"loc-doc-{d}", 1024) for d in docs)
        q = self.text().block(f"loc-rq-{next(self._ids)}-{random.random()}", 48)
        self.send(
            {
                "messages": [
                    {"role": "system", "content": context},
                    {"role": "user", "content": q},
                ],
                "max_tokens": 48,
            },
            chat=True,
            tenant=self.tenant,
        )


class TenantMix(OpenAIUser):
    """Users of several tenants, some sending a prompt identical across tenants."""

    tenants = ("acme", "globex", "initech")

    @task
    def ask(self) -> None:
        tenant = random.choice(self.tenants)
        key = "common" if random.random() < 0.3 else f"{tenant}-{random.randrange(3)}"
        system = self.text().block(f"loc-tm-{key}", 1536)
        q = self.text().block(f"loc-tq-{next(self._ids)}-{random.random()}", 64)
        self.send(
            {
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": 32,
            },
            chat=True,
            tenant=tenant,
        )


class ShortUnique(OpenAIUser):
    """Short prompts that never repeat: the case that must not get worse."""

    @task
    def ask(self) -> None:
        n = random.randint(32, 256)
        prompt = self.text().block(f"loc-su-{next(self._ids)}-{random.random()}", n)
        self.send({"prompt": prompt, "max_tokens": 24}, chat=False, tenant=self.tenant)


class EmbedSharedDocs(OpenAIUser):
    """RAG ingestion and retrieval: ``/v1/embeddings`` of a batch of Zipf-popular shared
    document chunks and one unique query (routed by load alone, D28; not streamed, so no
    TTFT row). A response is a failure unless it is a list with one embedding per input,
    in order."""

    @task
    def embed(self) -> None:
        chunks = sorted({min(int(random.paretovariate(1.2)) - 1, 49) for _ in range(3)})
        inputs = [self.text().block(f"loc-chunk-{c}", 256) for c in chunks]
        inputs.append(self.text().block(f"loc-eq-{next(self._ids)}-{random.random()}", 32))
        with self.client.post(
            "/v1/embeddings",
            json={"model": MODEL, "input": inputs},
            headers=self.headers(self.tenant),
            name=type(self).__name__,
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(_failure(resp))
                return
            try:
                data = resp.json()["data"]
                ok = [d["index"] for d in data] == list(range(len(inputs))) and all(
                    isinstance(d["embedding"], list) and d["embedding"] for d in data
                )
            except (ValueError, KeyError, TypeError) as exc:
                resp.failure(f"not an embeddings list: {type(exc).__name__}")
                return
            if not ok:
                resp.failure(f"{len(data)} embeddings for {len(inputs)} inputs, or out of order")


class ResponsesAgentChain(OpenAIUser):
    """An agent running its tools itself on the Responses API (D30, D31), one turn per task:
    turn 1 sends shared instructions (one of a few ~1,000-token agent prompts) with a
    ``function`` tool and a question; each follow-up names the last response's id as
    ``previous_response_id`` and sends the tool's call and its output (the simulated
    replica emits no calls, so the client makes the ``function_call`` as its loop would
    have received it) and a user message; a chain ends after ``FOLLOW_UPS`` follow-ups or
    at its first failure. Not streamed, so no TTFT row. Rows ``... turn 1`` and ``...
    follow-up``; a response is a failure unless it is a 200 with an ``output`` message and
    its ``id``, and a follow-up's 404 (what a router without affinity gives: the replica it
    reached never stored the previous response) is a failure saying so."""

    AGENTS = 3  # agent prompts shared across users
    FOLLOW_UPS = 3

    @staticmethod
    def tool() -> dict[str, Any]:
        return {
            "type": "function",
            "name": "search_docs",
            "description": "Search the product documentation and return the best passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                "required": ["query"],
            },
        }

    def on_start(self) -> None:
        self.chain = ""
        self.agent = 0
        self.prev: str | None = None
        self.turns = 0

    @task
    def turn(self) -> None:
        if self.prev is None:
            n = next(self._ids)
            self.chain, self.agent, self.turns = f"loc-rc-{n}", n % self.AGENTS, 0
            items: Any = self.text().once(f"{self.chain}-q", 64)
        else:
            call_id = f"call_{self.chain}_{self.turns}"
            args = json.dumps({"query": self.text().once(f"{self.chain}-a{self.turns}", 8)})
            items = [
                {"type": "function_call", "call_id": call_id, "name": "search_docs",
                 "arguments": args},
                {"type": "function_call_output", "call_id": call_id,
                 "output": self.text().once(f"{self.chain}-o{self.turns}", 160)},
                {"role": "user", "content": self.text().once(f"{self.chain}-u{self.turns}", 32)},
            ]  # fmt: skip
        body: dict[str, Any] = {
            "model": MODEL,
            # sent every turn: vLLM does not carry a stored turn's instructions or tools over
            "instructions": self.text().block(f"loc-agent-{self.agent}", 1000),
            "tools": [self.tool()],
            "input": items,
            "max_output_tokens": 32,
            "store": True,
        }
        follow_up = self.prev is not None
        if follow_up:
            body["previous_response_id"] = self.prev
        self.prev = None  # set again only by a good answer: a failure ends the chain
        name = f"{type(self).__name__} {'follow-up' if follow_up else 'turn 1'}"
        with self.client.post(
            "/v1/responses",
            json=body,
            headers=self.headers(self.tenant),
            name=name,
            catch_response=True,
        ) as resp:
            if follow_up and resp.status_code == 404:
                resp.failure("follow-up 404: previous response not on the replica reached")
                return
            if resp.status_code != 200:
                resp.failure(_failure(resp))
                return
            try:
                got = resp.json()
                rid, output = got["id"], got["output"]
                ok = isinstance(rid, str) and bool(rid)
                ok = ok and any(item.get("type") == "message" for item in output)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                resp.failure(f"not a response object: {type(exc).__name__}")
                return
            if not ok:
                resp.failure("no id or no output message")
                return
        self.turns += 1
        self.prev = rid if self.turns <= self.FOLLOW_UPS else None


events.request.add_listener(_log_ttft)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_report_ttft)  # type: ignore[no-untyped-call]
