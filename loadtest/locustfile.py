"""Locust load test against any OpenAI-compatible URL (the kvgate gateway or a peer router).

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 2m \
        --host http://127.0.0.1:8000 --csv results/locust

Environment:
    KVGATE_LOCUST_MODEL     model name (default kvgate-sim-8b)
    KVGATE_LOCUST_KEYS      "tenant=key,tenant2=key2": API keys per tenant (default: no auth)
    KVGATE_LOCUST_STREAM    1 (default) to stream and record TTFT, 0 for plain JSON

Each user class is one traffic shape; pick some with Locust's class selection (``locust ...
SharedSystemPromptChat ShortUnique``) or run them all. Streamed requests report an
extra entry per class in the CSV: ``TTFT <class>``, the time to the first content chunk,
whose "response length" is the engine-reported cached prompt tokens (so the CSV's
"Average Content Size" of a TTFT row is the mean cached tokens per request).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from typing import Any

from locust import HttpUser, between, events, task

from loadtest.workloads import TextSource

MODEL = os.environ.get("KVGATE_LOCUST_MODEL", "kvgate-sim-8b")
STREAM = os.environ.get("KVGATE_LOCUST_STREAM", "1") != "0"


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
                    resp.failure(f"HTTP {resp.status_code}: {resp.text[:120]}")
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
                resp.failure(f"HTTP {resp.status_code}")
                return
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
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
        if ttft is not None:
            events.request.fire(  # type: ignore[no-untyped-call]
                request_type="TTFT",
                name=name,
                response_time=ttft * 1000,
                response_length=cached,
                exception=None,
                context={},
            )


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
