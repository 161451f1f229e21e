"""CORS (the Fetch standard's cross-origin rules) for browser apps on other origins.

Off unless ``KVGATE_CORS_ALLOWED_ORIGINS`` names origins (or ``*``). One
:class:`CorsPolicy` decides for both serving paths: the completion endpoints' own
HTTP/1.1 code (:mod:`gateway.hotpath`) adds :meth:`CorsPolicy.actual`'s headers to its
answers, and :class:`CorsMiddleware` wraps the FastAPI app, answering preflights
(``OPTIONS``, which never take the hot path) and adding the same headers to the rest.
Starlette's ``CORSMiddleware`` decides inside its own ``send``, so the hot path could
not share it, and it adds the expose and credentials headers to answers for origins it
refuses.

Answers, by the Fetch standard (s4.8-4.10, CORS check and CORS-preflight fetch):

- a preflight from an allowed origin asking for an allowed method and headers: ``204``
  with ``Access-Control-Allow-Origin`` (the origin, or ``*``), ``-Methods``,
  ``-Headers`` (those asked for), ``-Max-Age`` and, with credentials, ``-Credentials``;
- any other preflight: ``403`` with an OpenAI error object and no CORS headers. The
  browser fails the request either way (no ok status, no allow headers); the 403 says
  why to whoever reads the network panel or a curl;
- every other answer (200, errors, SSE streams) to an allowed origin carries
  ``Access-Control-Allow-Origin`` and ``Access-Control-Expose-Headers`` (x-request-id,
  Retry-After and the x-kvgate-* headers: not CORS-safelisted, a script cannot read them
  otherwise); with a list of origins also ``Vary: Origin`` (the answer depends on it: a
  shared cache must not hand one origin's answer to another).

Chromium's Private Network Access: a preflight from a public page to a gateway on a
private address carries ``Access-Control-Request-Private-Network: true`` and fails
without ``Access-Control-Allow-Private-Network: true`` in the 204, which is answered when
``KVGATE_CORS_ALLOW_PRIVATE_NETWORK`` is set. Unset, the header is ignored, not refused:
a Chromium in PNA's warning-only mode then still gets the plain 204 it proceeds on.

``/admin`` and ``/metrics`` get none of this: they take the admin key, an operator's
credential used from curl, ``kvgate`` and Prometheus, never from a page. Allowing them
would let any script on an allowed origin (an XSS in the chat UI) drive the admin API
with a key a browser holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings

# the methods kvgate's client endpoints take (GET, HEAD: models, health; POST: completions)
DEFAULT_METHODS = ("GET", "HEAD", "POST")
# request headers kvgate reads from clients (gateway/core.py, gateway/app.py), and those
# the OpenAI SDKs send (the JS SDK in a browser: X-Stainless-OS, -Retry-Count, ... a set
# that grows by release, hence the prefix). A browser asks before sending any header that
# is not CORS-safelisted (Content-Type: application/json is not): one not allowed here
# fails the request
DEFAULT_HEADERS = (
    "authorization",
    "content-type",
    "x-request-id",
    "x-session-id",
    "x-kvgate-session",
    "x-kvgate-sensitive",
    "x-stainless-*",
    "openai-organization",
    "openai-project",
)
# CORS-safelisted request headers (Fetch s2.2.2): a browser still lists one in a preflight
# when its value is not safelisted (Content-Type: application/json), so they are always
# allowed: a custom list without content-type refused every JSON POST
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
# answer headers a client reads (gateway/proxy.py, gateway/errors.py)
EXPOSE_HEADERS = b"x-request-id, retry-after, x-kvgate-replica, x-kvgate-predicted-cached-tokens"
EXEMPT_PREFIXES = ("/admin/", "/metrics")  # admin-key routes: no CORS (module docstring)
# RFC 9110 s5.6.2 token characters: method and header names
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

Pairs = list[tuple[bytes, bytes]]


def exempt(path: str) -> bool:
    """A path that answers no CORS (``/admin``, ``/metrics``: module docstring); ``path``
    percent-decoded, as an ASGI scope's."""
    return path.startswith(EXEMPT_PREFIXES)


def check_origin(value: str) -> str:
    """``*`` or a serialized origin, ``scheme://host[:port]``, lower-cased as browsers send
    it. Anything else could never equal an ``Origin`` header, a silent refusal: a path or
    trailing slash (``https://chat.example.com/``), a missing scheme. ``null`` (sandboxed
    iframes, ``file:``, redirects) is refused: any page can send it."""
    if value == "*":
        return value
    if value.lower() == "null":
        raise ValueError("'null' is the origin of sandboxed and file: pages: any page can send it")
    url = urlsplit(value)
    if (
        url.scheme not in ("http", "https")
        or not url.hostname
        or url.path
        or url.query
        or url.fragment
        or url.username is not None
        or url.password is not None
    ):
        raise ValueError(
            f"{value!r} is not an origin: give scheme://host[:port], no path or trailing slash"
        )
    try:
        url.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ValueError(f"{value!r}: bad port") from None
    return value.lower()


def check_token(value: str, what: str) -> str:
    """A method or header name: an RFC 9110 token, ``*`` (any) or, for a header, a prefix
    ending in ``*`` (``x-stainless-*``)."""
    name = value[:-1] if what == "header" and value.endswith("*") and value != "*" else value
    if value != "*" and (not name or not set(name) <= _TCHAR or "*" in name):
        raise ValueError(f"{value!r} is not an HTTP {what} name")
    return value


class CorsPolicy:
    """Who may call the gateway from a browser, and the headers that say so. Built once
    (:meth:`from_settings`); :meth:`actual` is a dict lookup on the hot path."""

    __slots__ = (
        "_actual",
        "_any_headers",
        "_any_method",
        "_any_origin",
        "_headers",
        "_methods",
        "_prefixes",
        "_preflight",
        "_preflight_vary",
        "_private_network",
        "_vary_only",
    )

    def __init__(
        self,
        origins: Iterable[str],
        methods: Iterable[str] = DEFAULT_METHODS,
        headers: Iterable[str] = DEFAULT_HEADERS,
        credentials: bool = False,
        max_age_s: int = 600,
        private_network: bool = False,
    ) -> None:
        origins = [check_origin(o) for o in origins]
        self._any_origin = "*" in origins
        if self._any_origin and credentials:
            raise ValueError(
                "CORS: allowed origins '*' with credentials (KVGATE_CORS_ALLOW_CREDENTIALS): "
                "browsers refuse Access-Control-Allow-Origin: * on a request with "
                "credentials; list the origins (KVGATE_CORS_ALLOWED_ORIGINS)"
            )
        self._methods = frozenset(check_token(m, "method").upper() for m in methods)
        self._any_method = "*" in self._methods
        self._headers = SAFELISTED_HEADERS.union(check_token(h, "header").lower() for h in headers)
        self._any_headers = "*" in self._headers
        self._prefixes = tuple(h[:-1] for h in self._headers if h.endswith("*") and h != "*")
        common: Pairs = [(b"access-control-expose-headers", EXPOSE_HEADERS)]
        shared: Pairs = [(b"access-control-max-age", str(max_age_s).encode())]
        if credentials:
            common.append((b"access-control-allow-credentials", b"true"))
            shared.append((b"access-control-allow-credentials", b"true"))
        if not self._any_method:
            listed = ", ".join(sorted(self._methods)).encode()
            shared.append((b"access-control-allow-methods", listed))
        # by origin: the answer's headers, and the preflight's before its per-request ones
        self._actual: dict[str, Pairs] = {}
        self._preflight: dict[str, Pairs] = {}
        for origin in origins:
            acao = (b"access-control-allow-origin", origin.encode())
            vary = [] if self._any_origin else [(b"vary", b"Origin")]
            self._actual[origin] = [acao, *common, *vary]
            self._preflight[origin] = [acao, *shared]
        # Chromium's Private Network Access (module docstring): answered only when set
        self._private_network = private_network
        varies = b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
        if private_network:  # the answer then depends on that request header too
            varies += b", Access-Control-Request-Private-Network"
        self._preflight_vary = (b"vary", varies)
        # a list of origins: an answer to any other (or none) varies by Origin too
        self._vary_only: Pairs = [] if self._any_origin else [(b"vary", b"Origin")]

    @classmethod
    def from_settings(cls, s: GatewaySettings) -> CorsPolicy | None:
        """None (CORS off) when no origin is configured."""
        if not s.cors_allowed_origins:
            return None
        return cls(
            s.cors_allowed_origins,
            s.cors_allowed_methods,
            s.cors_allowed_headers,
            s.cors_allow_credentials,
            s.cors_max_age_s,
            s.cors_allow_private_network,
        )

    def actual(self, origin: str | None) -> Pairs:
        """The CORS headers of an answer (not a preflight) to a request from ``origin``."""
        if self._any_origin:
            return self._actual["*"]
        pairs = self._actual.get(origin) if origin is not None else None
        return self._vary_only if pairs is None else pairs

    def _header_ok(self, name: str) -> bool:
        return name in self._headers or (bool(self._prefixes) and name.startswith(self._prefixes))

    def preflight(
        self, origin: str, method: str, asked: str | None, private_network: bool = False
    ) -> tuple[int, Pairs, bytes]:
        """The answer to a preflight: status, headers, body. ``asked``: its
        Access-Control-Request-Headers (comma-separated names); ``private_network``: it
        carries ``Access-Control-Request-Private-Network: true``."""
        base = self._preflight.get("*" if self._any_origin else origin)
        names = [n.strip().lower() for n in asked.split(",")] if asked else []
        names = [n for n in names if n]
        why = None
        if base is None:
            why = f"origin {origin} is not allowed"
        elif not (self._any_method or method in self._methods):
            why = f"method {method} is not allowed"
        elif not self._any_headers and (bad := [n for n in names if not self._header_ok(n)]):
            why = f"request header(s) {', '.join(bad)} not allowed"
        vary = self._preflight_vary
        if base is None or why is not None:
            err = GatewayError(403, f"CORS preflight refused: {why}", code="cors_refused")
            return 403, [(b"content-type", b"application/json"), vary], orjson.dumps(err.body())
        pairs = [*base, vary]
        if self._any_method:
            pairs.append((b"access-control-allow-methods", method.encode("latin-1")))
        if names:
            pairs.append((b"access-control-allow-headers", ", ".join(names).encode("latin-1")))
        if private_network and self._private_network:
            pairs.append((b"access-control-allow-private-network", b"true"))
        return 204, pairs, b""


class CorsMiddleware:
    """The policy on the ASGI side: preflights answered here, the other answers' heads
    given :meth:`CorsPolicy.actual`'s headers. Plain ASGI, as ``RequestIdMiddleware``:
    only the response start is touched, so streams pass through."""

    def __init__(self, app: Any, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        origin = method = asked = None
        private_network = False
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = origin or value.decode("latin-1")
            elif name == b"access-control-request-method":
                method = method or value.decode("latin-1")
            elif name == b"access-control-request-headers":
                text = value.decode("latin-1")  # a repeated header: one list (RFC 9110 s5.3)
                asked = text if asked is None else f"{asked},{text}"
            elif name == b"access-control-request-private-network":
                private_network = value.strip().lower() == b"true"
        if scope["method"] == "OPTIONS" and origin is not None and method is not None:
            status, headers, body = self.policy.preflight(origin, method, asked, private_network)
            if body:
                headers = [*headers, (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        extra = self.policy.actual(origin)

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*(message.get("headers") or []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
