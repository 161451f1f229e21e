"""OpenAI-style error objects: every failure the gateway returns has this shape."""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.responses import Response

# OpenAI's own types: a bad key, an unknown model or URL and a wrong method are all
# invalid_request_error there (the code tells them apart); 429s are typed by what ran out
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "requests",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error the client sees as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.type = type_
        self.extra = extra

    def body(self) -> dict[str, Any]:
        body = error_body(self.status, self.message, self.code, self.param, self.type)
        if self.extra:
            body["error"].update(self.extra)
        return body

    def header_pairs(self, request_id: str | None = None) -> list[tuple[bytes, bytes]]:
        """The answer's headers other than its length, as raw pairs."""
        pairs = [(b"content-type", b"application/json")]
        for name, value in self.headers.items():
            pairs.append((name.lower().encode("latin-1"), value.encode("latin-1")))
        if request_id:
            pairs.append((b"x-request-id", request_id.encode("latin-1")))
        return pairs

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


def error_body(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    type_: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_
            or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def engine_error_body(parsed: object, status: int) -> dict[str, Any] | None:
    """An engine's error answer in OpenAI's shape, keeping its words; None when it has none.
    OpenAI's ``{"error": {...}}`` (vLLM) is returned as it is; the flat object SGLang (and
    vLLM before its envelope) answer with, ``{"object": "error", "message", "type",
    "param", "code"}``, a bare ``{"error": "..."}`` and a FastAPI ``{"detail": ...}`` (a
    string, or its validation errors) are put into it."""
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    if isinstance(error, dict):
        return parsed
    if isinstance(error, str) and error:  # {"error": "...", "error_type": ...} (TGI, proxies)
        kind = parsed.get("error_type")
        return error_body(status, error, type_=kind if isinstance(kind, str) and kind else None)
    message = parsed.get("message")
    if isinstance(message, str) and message:
        kind, param = parsed.get("type"), parsed.get("param")
        return error_body(
            status,
            message,
            code=parsed.get("code") if isinstance(parsed.get("code"), (str, int)) else None,
            param=param if isinstance(param, str) else None,
            type_=kind if isinstance(kind, str) and kind else None,
        )
    detail = parsed.get("detail")
    if isinstance(detail, str) and detail:
        return error_body(status, detail)
    if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
        parts = []
        for d in detail:
            where = d.get("loc")  # FastAPI's is a list; anything else is named whole
            loc = (
                ".".join(map(str, where)) if isinstance(where, (list, tuple)) else str(where or "")
            )
            msg = str(d.get("msg", ""))
            parts.append(f"{loc}: {msg}" if loc else msg)
        return error_body(status, "; ".join(parts))
    return None


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An SSE event carrying an error object, then the stream terminator."""
    return b"data: " + orjson.dumps(error_body(status, message, code)) + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def unsupported_media_type() -> GatewayError:
    """A completion request whose Content-Type is not JSON: vLLM's OpenAI server refuses it
    (its ``validate_json_request`` dependency, answered by its validation handler as a 400
    with this sentence)."""
    return bad_request(
        "Unsupported Media Type: Only 'application/json' is allowed",
        code="unsupported_media_type",
    )


def invalid_api_key() -> GatewayError:
    return GatewayError(401, "Incorrect or missing API key.", code="invalid_api_key")


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes", code="body_too_large")


_MAX_RETRY_AFTER_S = 86_400.0


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value for a wait of ``seconds``: whole seconds, rounded up (within a
    millisecond), at least 1 (0 tells a client to retry at once, in a loop), at most a day.
    A wait no clock can give (inf, NaN, a rate near zero) is a day, not an OverflowError
    that makes the answer a 500; the settings bound the rates, this bounds every caller."""
    wait = seconds if math.isfinite(seconds) else _MAX_RETRY_AFTER_S
    return str(max(1, int(min(wait, _MAX_RETRY_AFTER_S) + 0.999)))


def rate_limited(message: str, retry_after_s: float, limit: str) -> GatewayError:
    """OpenAI's 429 (code ``rate_limit_exceeded``, type ``requests`` or ``tokens``) with the
    tenant limit that ran out in ``limit``: concurrency, rate or uncached_tokens."""
    return GatewayError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": retry_after(retry_after_s)},
        type_="tokens" if limit == "uncached_tokens" else "requests",
        extra={"limit": limit},
    )


NO_REPLICA_RETRY_S = 1.0
"""The ``Retry-After`` of a 503 ``no_replica`` made without a policy at hand (the engine
tokenizer's, which no request meets); the gateway's are its health-check interval
(``ReplicaPool.no_replica_error``), 1 s at the default 0.5 s."""
NO_REPLICA_RETRY_MAX_S = 10.0
"""The most a 503 ``no_replica`` asks a client to wait, whatever the health-check interval:
a sparse check is no reason to hold clients longer (an uncordon or a registration ends it
without a check), and the OpenAI SDKs do not retry at all past 120 s."""


def no_replica(
    message: str, retry_after_s: float = NO_REPLICA_RETRY_S, param: str | None = None
) -> GatewayError:
    """The 503 ``no_replica``: no replica can serve the request now (none healthy, every one
    cordoned or draining, their model lists not read yet). It passes: a replica comes back
    at a health check, an uncordon, a registration, so it says when to ask again
    (``Retry-After``, :func:`retry_after` of ``retry_after_s``), as the gateway's other
    retryable refusals do, where clients fell back on their own backoff."""
    return GatewayError(
        503,
        message,
        code="no_replica",
        param=param,
        headers={"Retry-After": retry_after(retry_after_s)},
    )
