"""The HTTP surface: OpenAI endpoints, health, metrics, and the admin API.

Handlers take the raw :class:`Request` and return responses directly (no pydantic models on
the hot path: the body is parsed once with orjson and forwarded with its unknown fields).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import KeyCheckError, KeyFileError, KeyLookupRefused, KeyReload, check_admin
from gateway.core import (
    ENDPOINT_PATHS,
    RESPONSE_CANCEL,
    RESPONSE_GET,
    Gateway,
    request_id_from,
    streamed_retrieval,
)
from gateway.cors import CorsMiddleware, CorsPolicy
from gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
    invalid_api_key,
    rate_limited,
    unsupported_media_type,
)
from gateway.proxy import UpstreamExchange
from gateway.routing import Strategy
from policies.schema import TENANT_NAME, PolicyError, not_a_tenant_name

log = logging.getLogger(__name__)

# the 401s of a gateway started without an admin key: no key opens these, so none is asked for
ADMIN_DISABLED = "the admin API is disabled: no admin key is configured (KVGATE_ADMIN_KEY)"
METRICS_DISABLED = (
    "/metrics needs the admin key and none is configured (set KVGATE_ADMIN_KEY, or "
    "KVGATE_METRICS_PUBLIC=true on a trusted network)"
)


def key_check_error(gw: Gateway, exc: KeyCheckError) -> GatewayError:
    """A key the store did not resolve. Its address out of unknown-key lookups: a 429
    (``limit`` ``unknown_keys``). A key that cannot be checked: 503 (OpenAI clients retry
    it), not the 401 that would tell a client with a valid key that its key is wrong."""
    if exc.reason is not None:
        gw.metrics.api_key_lookups_refused.labels(exc.reason).inc()
    if isinstance(exc, KeyLookupRefused):
        return rate_limited(str(exc), exc.retry_after_s, "unknown_keys")
    return GatewayError(
        503, str(exc), code="api_key_store_unavailable", headers={"retry-after": "1"}
    )


def _peer(request: Request) -> str:
    """The peer's address ("" on a socket without one): X-Forwarded-For is not read, any
    client could write it."""
    return request.client.host if request.client is not None else ""


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_content_type(value: str | None) -> bool:
    """Whether a completion request's Content-Type lets its body be read as JSON: vLLM's
    OpenAI server takes ``application/json`` alone (parameters such as a charset aside) and
    refuses the rest with a 400 (:func:`unsupported_media_type`), ``text/plain`` included,
    which a browser may send cross-origin without a preflight. A request without one is
    taken as JSON, where vLLM refuses it too: it claims no other type, and raw clients (and
    the gateway's own tests) leave it out; the engine gets the gateway's
    ``application/json`` either way."""
    if value is None:
        return True
    return value.split(";", 1)[0].strip().lower() == "application/json"


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


class RequestIdMiddleware:
    """Every answer carries ``x-request-id``: the client's when it is valid, else a new one
    (the completion endpoints set their own, which this leaves alone). Plain ASGI: it only
    touches the response start, never the body, so streams pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    client = {
                        k.decode("latin-1"): v.decode("latin-1")
                        for k, v in scope.get("headers") or []
                        if k.lower() == b"x-request-id"
                    }
                    rid = request_id_from(client)
                    headers.append((b"x-request-id", rid.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class InternalErrorMiddleware:
    """An unhandled error in a route, before its answer began: an OpenAI 500 error object,
    inside the CORS and request-id middlewares so it carries their headers. Starlette's own
    500 (``ServerErrorMiddleware``) is outermost, text/plain and without CORS: a browser
    reported it as a CORS failure, not a 500. The connection closes after it, as the hot
    path's 500 does. An error after the answer began goes on to uvicorn, which cuts the
    connection (a cut answer must not look complete)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            err = GatewayError(500, "internal gateway error", headers={"connection": "close"})
            await err.response()(scope, receive, send)  # x-request-id: RequestIdMiddleware


class ExpectContinueMiddleware:
    """A request with ``Expect: 100-continue`` answered before its route asked for the body
    (an admin POST's 401: uvicorn writes ``100 Continue`` at the first ``receive``) says
    ``connection: close``, and uvicorn closes after it, as the hot path does
    (``HotCycle._head``). The client never sent the body: one that sent its next request
    instead would have it read as this body and wait (RFC 9110 s10.1.1: a server answering
    before the content SHOULD say whether it closes)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        expects = body = False
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"expect":
                    expects = value.lower() == b"100-continue"
                elif name == b"content-length":
                    body = body or value != b"0"
                elif name == b"transfer-encoding":
                    body = True
        if not (expects and body):
            await self.app(scope, receive, send)
            return
        asked = False

        async def receive_asked() -> Any:
            nonlocal asked
            asked = True
            return await receive()

        async def send_closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not asked:
                closing = [*(message.get("headers") or []), (b"connection", b"close")]
                message = {**message, "headers": closing}
            await send(message)

        await self.app(scope, receive_asked, send_closing)


Refusal = tuple[GatewayError, str]
"""An answer the gateway gives itself instead of going upstream, with the request id."""


class Completions:
    """The proxied endpoints (the two completion endpoints, and those routed by load:
    embeddings, /tokenize, /detokenize, D28; /pooling, /classify, /score, /rerank, D29),
    independent of the HTTP server that carries them: :func:`create_app`'s FastAPI routes
    and the gateway's own protocol (:mod:`gateway.hotpath`) both call :meth:`handle`."""

    ENDPOINTS: ClassVar[dict[str, str]] = {path: name for name, path in ENDPOINT_PATHS.items()}

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        # None: CORS off. The FastAPI app's CorsMiddleware uses this same policy
        self.cors = CorsPolicy.from_settings(gw.settings)

    async def handle(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        read_body: Callable[[int], Awaitable[bytes]],
        client: str | None = None,
        gone: Callable[[], bool] | None = None,
        response_id: str | None = None,
        query: Mapping[str, str] | None = None,
    ) -> UpstreamExchange | Refusal:
        """Authenticate, parse, admit and route one request. Returns the exchange to run
        (which owns the admission from then on) or the error to answer with.
        ``read_body(limit)`` returns the whole body or raises a 413 :class:`GatewayError`.
        ``client``: the peer's address, whose budget an unknown API key's lookup spends.
        ``gone``: whether the client has left, for a server that cancels the request's
        task when it does (the hot path): such a cancellation counts 499 in
        kvgate_requests, any other (the drain timeout's cut) 503. ``response_id``: ``GET
        /v1/responses/{id}``'s id (endpoint :data:`~gateway.core.RESPONSE_GET`; no body) or
        ``POST /v1/responses/{id}/cancel``'s (:data:`~gateway.core.RESPONSE_CANCEL`, its
        body not read, as vLLM reads none); ``query``: a retrieval's query string."""
        try:
            return await self._handle(endpoint, headers, read_body, client, response_id, query)
        except asyncio.CancelledError:
            if gone is not None:  # else who cut it is unknown: not counted
                self.gw.metrics.requests.labels(endpoint, "499" if gone() else "503").inc()
            raise

    async def _handle(
        self,
        endpoint: str,
        headers: Mapping[str, str],
        read_body: Callable[[int], Awaitable[bytes]],
        client: str | None,
        response_id: str | None = None,
        query: Mapping[str, str] | None = None,
    ) -> UpstreamExchange | Refusal:
        gw = self.gw
        t_start = time.perf_counter()
        rid = request_id_from(headers)
        m = gw.metrics
        if gw.draining:
            m.requests.labels(endpoint, "503").inc()
            return GatewayError(503, "the gateway is shutting down", code="draining"), rid
        try:
            tenant = await gw.key_store.tenant_for(headers.get("authorization"), client)
        except KeyCheckError as exc:
            err = key_check_error(gw, exc)
            m.requests.labels(endpoint, str(err.status)).inc()
            return err, rid
        if tenant is None:
            m.requests.labels(endpoint, "401").inc()
            return invalid_api_key(), rid
        if response_id is None and not json_content_type(headers.get("content-type")):
            # before the body, as vLLM (its check runs whatever the body holds)
            m.requests.labels(endpoint, "400").inc()
            return unsupported_media_type(), rid
        try:
            if response_id is not None:  # a retrieval, a cancel: the id (and query) is all
                raw, body = b"", {"response_id": response_id, "query": dict(query or {})}
            else:
                raw = await read_body(gw.settings.max_body_bytes)
                c0 = time.perf_counter_ns()
                body = parse_json_object(raw)
                gw.stages.add("parse", time.perf_counter_ns() - c0)
        except GatewayError as exc:
            m.requests.labels(endpoint, str(exc.status)).inc()
            return exc, rid
        except Exception:
            # the body never came whole: the client left (the hot path's ClientGone,
            # starlette's ClientDisconnect); no answer, its outcome a 499
            m.requests.labels(endpoint, "499").inc()
            raise
        limits = gw.policy.tenant(tenant).limits
        # a background response holds its slot until it ends (D33): its retrieval and
        # cancel, no engine work, are not refused for it; a streamed retrieval, which holds
        # its connection as long as the run, is bounded among the tenant's replays
        replay = endpoint == RESPONSE_GET and streamed_retrieval(query)
        rej = gw.limiter.admit(tenant, limits, time.monotonic(), response_id is None, replay)
        if rej is not None:
            m.rate_limited.labels(tenant, rej.limit).inc()
            m.requests.labels(endpoint, "429").inc()
            wait = rej.retry_after_s
            if rej.limit == "concurrency" and not replay:
                wait = gw.slot_retry_s(tenant, limits.max_concurrency)
            return rate_limited(rej.message, wait, rej.limit), rid
        gw.begin()
        span = gw.tracer.start_span("kvgate.request") if gw.tracer is not None else None
        try:
            d = await gw.prepare(endpoint, tenant, body, headers, rid)
        except GatewayError as err:  # the router's NoCandidateError too: prepare's 503
            gw.limiter.release(tenant, replay)
            gw.end()
            m.requests.labels(endpoint, str(err.status)).inc()
            if span is not None:
                span.set_attribute("http.status_code", err.status)
                span.end()
            return err, rid
        except BaseException as exc:
            gw.limiter.release(tenant, replay)
            gw.end()
            if isinstance(exc, Exception):  # a bug, which both servers answer 500
                m.requests.labels(endpoint, "500").inc()
            if span is not None:
                span.end()
            raise
        d.t_start = t_start
        d.raw_body = raw
        d.replay = replay
        exchange: UpstreamExchange

        def on_done() -> None:
            gw.release_admission(d)  # the tenant's slot: a watched response's until it ends
            gw.end()
            # the outcome's status (_finish ran before this): a stream that broke or
            # lost its client after its 200 head counts 502 or 499, as its trace says
            m.requests.labels(endpoint, str(exchange.status)).inc()
            if span is not None:
                dec = d.decision
                span.set_attributes({
                    "kvgate.request_id": d.request_id,
                    "kvgate.tenant": d.tenant,
                    "kvgate.model": d.model,
                    "kvgate.scope_kind": d.scope.kind.value,
                    "kvgate.strategy": dec.strategy.value,
                    "kvgate.reason": dec.reason,
                    "kvgate.replica": dec.replica,
                    "kvgate.prompt_tokens": d.prompt_tokens,
                    "kvgate.predicted_cached_tokens": dec.predicted_cached_tokens,
                    "kvgate.index_source": d.index_source,
                    "kvgate.attempts": d.attempts + 1,
                    "http.status_code": exchange.status,
                })  # fmt: skip
                span.end()

        exchange = UpstreamExchange(gw, d, on_done)
        return exchange


_EXPLAINED = (*ENDPOINT_PATHS, RESPONSE_GET)
"""The endpoints ``/admin/route/explain`` explains: every one the gateway routes, by its
name in :data:`~gateway.core.ENDPOINT_PATHS` (``GET /v1/responses/{id}``: ``response_get``)."""


def create_app(gw: Gateway) -> FastAPI:
    keys = gw.key_store

    def on_key_reload(result: KeyReload | None, error: str) -> None:
        gw.metrics.api_key_reloads.labels("ok" if result is not None else "invalid").inc()
        gw.metrics.api_keys.set(keys.file_keys)

    async def stop_all(cancelled: bool = False) -> None:
        """The key file poller, then the gateway, even when the first raised or was
        cancelled (gw.stop runs its steps to their end under cancellation); a failure is
        logged with its traceback, and the first one raised once both ran. A stop that is
        cancelled (``cancelled``: the lifespan was, before it) does not drain: the
        cancellation, held until the gateway has stopped, cuts its drain as one during the
        drain does (it waited up to the drain timeout with requests in flight)."""
        failed: BaseException | None = None
        if cancelled:
            gw.cut_drain()
        for what, step in (("api key poller", keys.stop), ("gateway", gw.stop)):
            try:
                await step()
            except asyncio.CancelledError as exc:  # not a failure: raised at the end
                failed = failed or exc
                gw.cut_drain()
            except Exception as exc:
                log.error("shutdown: a step failed", exc_info=True, extra={"step": what})
                failed = failed or exc
        if failed is not None:
            raise failed

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()  # one that raises has stopped what it started
        try:
            # inside: whatever fails from here on, the gateway is stopped
            gw.metrics.api_keys.set(keys.file_keys)
            keys.start(gw.settings.api_keys_poll_s, on_key_reload)
            yield
        except BaseException as exc:
            # the error (a start-up step's, a cancellation) is what the caller sees: a
            # failure of the stop after it replaced it, and the operator read the wrong
            # cause. Logged (stop_all) and noted on it instead.
            try:
                await stop_all(cancelled=isinstance(exc, asyncio.CancelledError))
            except asyncio.CancelledError:
                log.warning("cancelled again while stopping the gateway after an error")
            except Exception as stop_exc:
                exc.add_note(f"stopping the gateway after this failed too: {stop_exc!r}")
            raise
        await stop_all()

    # redirect_slashes off: a 307 to the path without its trailing slash was the only answer
    # that was no OpenAI error (and its Location names this hop's scheme and host, wrong
    # behind a TLS proxy); OpenAI's API answers such a path 404 "Invalid URL", as we now do
    app = FastAPI(
        title="kvgate",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.state.gateway = gw

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # an unknown path or a wrong method, in OpenAI's words; a 405 keeps its Allow header
        detail = str(exc.detail)
        if exc.status_code == 404:
            detail = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            detail = f"Method {request.method} is not allowed for {request.url.path}"
        return GatewayError(exc.status_code, detail, headers=dict(exc.headers or {})).response(
            request_id_from(request.headers)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(str(exc)).response()

    completions_core = Completions(gw)

    async def completion(
        request: Request, endpoint: str, response_id: str | None = None
    ) -> Response:
        try:
            out = await completions_core.handle(
                endpoint,
                request.headers,
                lambda limit: read_body(request, limit),
                _peer(request),
                response_id=response_id,
                query=request.query_params if endpoint == RESPONSE_GET else None,
            )
        except Exception:
            log.exception("unhandled error on the completion path")
            return GatewayError(500, "internal gateway error").response()
        if isinstance(out, UpstreamExchange):
            return out
        err, rid = out
        return err.response(rid)

    def proxied(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
        # the endpoint closed over, not a parameter: FastAPI reads a handler's parameters
        # from the request (a default one from the query string)
        async def route(request: Request) -> Response:
            return await completion(request, endpoint)

        return route

    for path, endpoint in Completions.ENDPOINTS.items():
        app.add_api_route(path, proxied(endpoint), methods=["POST"], name=endpoint)

    async def retrieve_response(request: Request, rid: str) -> Response:
        # the Responses API's retrieval (D30): sent to the replica the sealed id names, on
        # both servers through this route (the hot path takes POSTs only)
        return await completion(request, RESPONSE_GET, rid)

    app.add_api_route("/v1/responses/{rid}", retrieve_response, methods=["GET"], name=RESPONSE_GET)

    async def cancel_response(request: Request, rid: str) -> Response:
        # a background response's cancel (D33): pinned as a retrieval is
        return await completion(request, RESPONSE_CANCEL, rid)

    app.add_api_route(
        "/v1/responses/{rid}/cancel", cancel_response, methods=["POST"], name=RESPONSE_CANCEL
    )

    app.state.completions = completions_core

    async def key_refused(request: Request) -> Response | None:
        """The 401 for a request without a valid API key (503 when it cannot be checked,
        429 when its address is out of unknown-key lookups), else None."""
        try:
            tenant = await gw.key_store.tenant_for(
                request.headers.get("authorization"), _peer(request)
            )
        except KeyCheckError as exc:
            return key_check_error(gw, exc).response()
        return invalid_api_key().response() if tenant is None else None

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        if (refused := await key_refused(request)) is not None:
            return refused
        assert gw.pool is not None
        return _json({"object": "list", "data": gw.pool.model_cards()})

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request) -> Response:
        if (refused := await key_refused(request)) is not None:
            return refused
        assert gw.pool is not None
        mid = request.path_params["model_id"]
        for card in gw.pool.model_cards():
            if card["id"] == mid:
                return _json(card)
        return GatewayError(
            404, f"The model `{mid}` does not exist.", code="model_not_found", param="model"
        ).response()

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> Response:
        if gw.draining:
            return _json({"status": "draining"}, 503)
        # liveness only: the gateway-wide in-flight count is every tenant's traffic request
        # by request (when each starts and ends: a hit's short prefill shows), and /health
        # answers anyone; admins read it from /admin/replicas and /metrics
        return _json({"status": "ok"})

    # ------------------------------------------------------------------ admin
    def admin(request: Request, unconfigured: str = ADMIN_DISABLED) -> None:
        key = gw.settings.admin_key.get_secret_value() if gw.settings.admin_key else None
        if not key:  # no key can open it: say so rather than ask for one
            raise GatewayError(401, unconfigured, code="invalid_admin_key")
        provided = request.headers.get("x-admin-key") or request.headers.get("authorization")
        if not check_admin(provided, key):
            raise GatewayError(401, "admin key required", code="invalid_admin_key")

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request) -> Response:
        s = gw.settings
        if not (s.metrics_public or s.open_access):
            try:  # Prometheus: `authorization: {credentials: <admin key>}` in the job
                admin(request, METRICS_DISABLED)
            except GatewayError as exc:
                return exc.response()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def guarded(fn: Any) -> Any:
        async def wrapper(request: Request) -> Response:
            try:
                admin(request)
                result = await fn(request)
            except GatewayError as exc:
                return exc.response()
            return result if isinstance(result, Response) else _json(result)

        wrapper.__name__ = fn.__name__
        return wrapper

    async def admin_replicas(request: Request) -> Any:
        return {"in_flight": gw.in_flight, "replicas": gw.replicas_state()}

    async def admin_replica_op(request: Request) -> Any:
        rid = request.path_params["rid"]
        op = request.path_params["op"]
        assert gw.pool is not None
        gw.replica(rid)
        if op == "cordon":
            rep = gw.pool.cordon(rid, True)
        elif op == "uncordon":
            rep = gw.pool.cordon(rid, False)
        elif op == "drain":
            rep = gw.pool.drain(rid)
        else:
            raise GatewayError(
                404,
                f"unknown operation {op!r} (cordon, uncordon or drain)",
                code="unknown_operation",
            )
        return rep.state(time.monotonic())

    async def admin_quarantine(request: Request) -> Any:
        return {
            "quarantined": gw.quarantine.quarantined(),
            "policy": gw.policy.quarantine.model_dump(),
        }

    async def admin_policy_get(request: Request) -> Any:
        return {
            "path": str(gw.policies.path) if gw.policies.path else None,
            "reloads": gw.policies.reloads,
            "last_error": gw.policies.last_error,
            # a file reload held back because it weakens isolation: the policy below is
            # still the old one
            "pending": gw.policies.pending(),
            "policy": gw.policy.model_dump(mode="json"),
            **_in_effect(),
        }

    def _in_effect() -> dict[str, Any]:
        # `kvgate serve --strategy` or KVGATE_STRATEGY wins over the policy's: say so where
        # the policy is shown
        over = gw.strategy_override
        return {"strategy_in_effect": (over or gw.policy.routing.strategy).value} | (
            {"strategy_override": over.value} if over is not None else {}
        )

    async def admin_policy_post(request: Request) -> Any:
        raw = await read_body(request, 1 << 20)
        try:
            # an empty body: the file again
            pol = await gw.policies.reload(raw.decode("utf-8", "replace") if raw.strip() else None)
        except PolicyError as exc:
            gw.metrics.policy_reloads.labels("invalid").inc()
            err = GatewayError(400, str(exc), code="invalid_policy")
            body = err.body()
            body["error"]["fields"] = exc.fields
            return _json(body, 400)
        return {"status": "reloaded", "strategy": pol.routing.strategy.value, **_in_effect()}

    async def admin_keys_get(request: Request) -> Any:
        return {
            "path": str(keys.key_file) if keys.key_file is not None else None,
            "keys": keys.file_keys,
            "reloads": keys.reloads,
            "last_error": keys.last_error,
        }

    async def admin_keys_reload(request: Request) -> Any:
        """Re-read the key file now (an operator who just revoked a key need not wait for
        the watcher); 400 with the reason, the old keys kept, when the file is refused."""
        if keys.key_file is None:  # a mistaken call, not a refused file: no ERROR, no count
            raise GatewayError(
                400,
                "the gateway was started without an API key file (--api-keys)",
                code="invalid_api_keys",
            )
        try:
            result = keys.reload_file()
        except KeyFileError as exc:  # logged by reload_file
            on_key_reload(None, str(exc))
            raise GatewayError(400, str(exc), code="invalid_api_keys") from None
        on_key_reload(result, "")
        return {"status": "reloaded", **result.as_dict()}

    def _stalled_ms(rid: str) -> float:
        sl = gw.refresher.snapshot().get(rid) if gw.refresher is not None else None
        return sl.stalled_ms if sl is not None else 0.0

    def _tenant_known(tenant: str) -> bool | None:
        """Whether a tenant named to explain is one the gateway's configuration knows: a
        key of the key file maps to it, the policy names it, or ``anonymous`` under open
        access. None where keys are in Redis (they cannot be listed)."""
        if (
            gw.key_store.has_tenant(tenant)
            or tenant in gw.policy.tenants
            or (tenant == "anonymous" and gw.settings.open_access)
        ):
            return True
        return None if gw.settings.api_keys_redis else False

    async def admin_explain(request: Request) -> Any:
        raw = await read_body(request, gw.settings.max_body_bytes)
        body = parse_json_object(raw)
        endpoint = request.query_params.get("endpoint") or (
            "chat" if "messages" in body else "completion"
        )
        if endpoint not in _EXPLAINED:
            raise bad_request(
                f"endpoint must be one of {', '.join(_EXPLAINED)}",
                param="endpoint",
                code="invalid_endpoint",
            )
        if endpoint == RESPONSE_GET:
            # a retrieval's body is its id alone (the real request's, read off its path)
            rid = body.get("response_id")
            if not isinstance(rid, str) or not rid:
                raise bad_request(
                    'a response_get explain needs the body {"response_id": <the id>}',
                    param="response_id",
                )
            body = {"response_id": rid}
        tenant = request.query_params.get("tenant") or request.headers.get("x-kvgate-tenant")
        if tenant and not TENANT_NAME.match(tenant):
            # no API key can carry it: explained, it would read as a cold tenant's routing
            raise bad_request(
                f"{not_a_tenant_name(tenant)}: no request is ever routed as it",
                param="tenant",
                code="invalid_tenant",
            )
        auth = request.headers.get("authorization")
        known: bool | None = True  # a key's tenant is
        if not tenant and auth and request.headers.get("x-admin-key"):
            # the admin key in its own header: Authorization is a client's API key, and the
            # request is explained as that client's tenant (as it would be routed)
            try:
                tenant = await gw.key_store.tenant_for(auth)
            except KeyCheckError as exc:  # no address: the admin's is not budgeted
                raise key_check_error(gw, exc) from None
            if tenant is None:
                raise invalid_api_key()
        else:
            tenant = tenant or "anonymous"
            known = _tenant_known(tenant)
        strategy = request.query_params.get("strategy")
        try:
            strat = Strategy(strategy) if strategy else None
        except ValueError:
            raise bad_request(
                f"unknown strategy {strategy!r} ({', '.join(s.value for s in Strategy)})",
                param="strategy",
                code="invalid_strategy",
            ) from None
        # a GatewayError is the answer (the router's NoCandidateError: prepare's 503; a
        # sealed id that does not open under this tenant and scope: the real request's 404).
        # Explain-only: decided under the router's preview, nothing charged, committed,
        # made pending or sent (an engine-tokenized pool's tokens are asked of a replica's
        # /tokenize, as the real request's are)
        d = await gw.prepare(endpoint, tenant, body, request.headers, "explain", True, strat)
        why = d.load_only_why()
        answer: dict[str, Any] = {
            "tenant": tenant,
            # false: a typo's answer (every replica matched_blocks 0) looks like a cold
            # tenant's; null: keys in Redis, which cannot be listed
            "tenant_known": known,
            "scope_kind": d.scope.kind.value,
            "model": d.model,
            "prompt_tokens": d.prompt_tokens,
            "block_size": d.block_size,
            "index_source": d.index_source,
            "salt_index": d.salt_index,
            "coefficients": gw.fit.coefficients().as_vector(),
            "decision": d.decision.to_dict(),
            # already in each score's queue_ms: the larger of a late stream's excess (D16)
            # and an engine stall's (D17), and the stall as the replica's agent last saw it
            "overdue_ms": {c.replica: round(c.load.overdue_ms, 3) for c in d.candidates},
            "stalled_ms": {c.replica: _stalled_ms(c.replica) for c in d.candidates},
            "endpoint": endpoint,
            # what admitting it would charge the tenant's uncached-token budget
            "charge_uncached_tokens": d.uncached_tokens,
            "load_only": None if why is None else {"why": why[0], "detail": why[1]},
            "pinned": None,
        }
        if why is not None and why[0] == "pinned":
            # the replica the sealed id names (opened under this tenant and scope), and
            # the engine's id for the response there
            engine_id = d.previous[0] if d.previous is not None else d.response_id
            answer["pinned"] = {"replica": d.replica, "engine_response_id": engine_id}
        if known is False:
            answer["note"] = (
                f"no API key of the key file maps to tenant {tenant!r} and the policy names no "
                "such tenant: explained as a tenant with nothing cached (check the name)"
            )
        return answer

    async def admin_stages(request: Request) -> Any:
        # a POST answers with the counters it resets (read and reset with no await between:
        # nothing is lost to requests in between, and what it drops can still be read)
        snapshot = gw.stages.snapshot()
        if request.method == "POST":
            gw.stages.reset()
        return {"stages": snapshot}

    async def admin_fit(request: Request) -> Any:
        f = gw.fit
        return {
            "samples": f.samples,
            "skipped": f.skipped,
            "prior": f.prior.as_vector(),
            "coefficients": f.coefficients().as_vector(),
        }

    async def admin_index(request: Request) -> Any:
        assert gw.index is not None
        abs_err, prompt = gw.metrics.precision
        return {
            "fallbacks": gw.index.fallbacks,
            "dropped_writes": gw.index.dropped_writes,
            "precision": {
                "abs_error_tokens": abs_err,
                "prompt_tokens": prompt,
                "error_fraction": abs_err / prompt if prompt else None,
            },
            "alignment_problems": gw.alignment_problems,
        }

    app.add_api_route("/admin/replicas", guarded(admin_replicas), methods=["GET"])
    app.add_api_route("/admin/replicas/{rid}/{op}", guarded(admin_replica_op), methods=["POST"])
    app.add_api_route("/admin/quarantine", guarded(admin_quarantine), methods=["GET"])
    app.add_api_route("/admin/policy", guarded(admin_policy_get), methods=["GET"])
    app.add_api_route("/admin/policy", guarded(admin_policy_post), methods=["POST"])
    app.add_api_route("/admin/keys", guarded(admin_keys_get), methods=["GET"])
    app.add_api_route("/admin/keys/reload", guarded(admin_keys_reload), methods=["POST"])
    app.add_api_route("/admin/route/explain", guarded(admin_explain), methods=["POST"])
    app.add_api_route("/admin/stages", guarded(admin_stages), methods=["GET", "POST"])
    app.add_api_route("/admin/fit", guarded(admin_fit), methods=["GET"])
    app.add_api_route("/admin/index", guarded(admin_index), methods=["GET"])
    app.add_middleware(InternalErrorMiddleware)  # inside both: its 500 gets their headers
    app.add_middleware(ExpectContinueMiddleware)
    app.add_middleware(RequestIdMiddleware)
    if completions_core.cors is not None:  # outermost: preflights answered before routing
        app.add_middleware(CorsMiddleware, policy=completions_core.cors)
    return app
