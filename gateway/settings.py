"""Process settings of the gateway (environment ``KVGATE_*``, overridden by CLI flags).

Routing behaviour lives in the policy file (reloadable); what is here is fixed for the life
of the process: where to listen, what to trust, how long to wait.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from cachecore.index.layout import DEFAULT_PREFIX, KeyLayout
from cachecore.index.redis import check_redis_url
from cachecore.loadstate import validate_gateway_id
from cachecore.registry import ReplicaAllowlist
from cachecore.tokenizer import OFFLOAD_CHARS, SEGMENT_CACHE_TOKENS
from gateway.cors import DEFAULT_HEADERS as CORS_HEADERS
from gateway.cors import DEFAULT_METHODS as CORS_METHODS
from gateway.cors import CorsPolicy, check_origin, check_token
from gateway.policy_store import WEAKEN_SETTLE_S
from gateway.replicas import AGENT_ENDPOINT_SCHEMES
from gateway.routing import Strategy
from policies.schema import MIN_RATE_PER_S, builtin_policy_path


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


class GatewaySettings(BaseSettings):
    """``KVGATE_SALT_SECRETS`` and ``KVGATE_REPLICAS`` take comma-separated values (the
    first salt secret is primary; a second one is still looked up, for rotation)."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    # an empty value (KVGATE_HOST= from an unset template variable) is refused: it listened
    # on every interface, where the default is loopback; 0.0.0.0 / :: say so explicitly
    host: str = "127.0.0.1"
    # a port past 65535 would be truncated to 16 bits by the socket layer (99999 -> 34463)
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    policy: Path = Field(default_factory=lambda: builtin_policy_path("default"))
    # finite, as api_keys_poll_s: inf slept forever, a watcher that never looked again
    policy_poll_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2.0
    # a file reload that weakens isolation (policy_store.isolation_weakenings) waits until
    # the file has kept still this long (at least one poll): a half-written file is a valid
    # policy whose later sections (default_tenant, quarantine) are the loose defaults
    policy_weaken_settle_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = WEAKEN_SETTLE_S
    redis_url: str | None = None
    # redis_url is a seed node of a Redis Cluster: the index, load store, registry and API
    # key hash all go through a cluster client (which discovers the other nodes)
    redis_cluster: bool = False
    # connect and read timeout of the index, load store and discovery clients on
    # redis_url; None: theirs (index 0.25 s to read, 0.5 s to connect; load store 0.5 s;
    # discovery 1 s). None of them holds up a request: lookups are cut at the policy's
    # index.lookup_timeout_ms, pending writes and load refreshes run beside them (the API
    # key client, which requests do wait on, has api_keys_redis_timeout_s). Finite: with
    # inf a write on a partitioned Redis held its connection for ever
    redis_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # the Redis key namespace: the agents' KVGATE_AGENT_KEY_PREFIX (the API key hash too,
    # <prefix>:apikeys); gateways and agents of one deployment share it
    key_prefix: str = Field(default=DEFAULT_PREFIX, min_length=1)
    api_keys_file: Path | None = None
    # how often the key file is checked for changes (a change is applied once the file has
    # kept still for one interval; POST /admin/keys/reload applies it at once)
    api_keys_poll_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2.0
    api_keys_redis: bool = False  # look API key hashes up in Redis hash <prefix>:apikeys
    # a Redis key lookup's answer is kept this long (a key deleted from the hash is refused
    # within it)
    api_keys_cache_ttl_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 5.0
    # while Redis cannot be asked, Redis' last answer for a key stands in for at most this
    # long after Redis gave it (at least the TTL above); past it the key fails closed (503)
    api_keys_stale_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 60.0
    # Redis lookups that Redis answered "no such key", per client address (an IPv6
    # client's /64): refilled at this rate per second up to the burst; an address past it
    # gets 429s for keys Redis has not confirmed, without a lookup (0: no budget). A valid
    # key's lookup spends nothing
    api_keys_miss_rate: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 10.0
    api_keys_miss_burst: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 100.0
    # the same, all client addresses together: the rate of refused lookups a flood from
    # many addresses can cost Redis (0: no global budget)
    api_keys_miss_rate_global: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1000.0
    api_keys_miss_burst_global: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1000.0
    # Redis key lookups in flight at once, all clients together (one per key however many
    # requests carry it); past it a lookup waits up to 1 s for a slot, then gets a 503
    api_keys_lookups_max: Annotated[int, Field(ge=1)] = 64
    # a Redis key lookup's connect and read timeout. It runs on the event loop's clock: an
    # answer Redis sent in time but read after a backlog this long counts as Redis down (a
    # key never seen gets a 503, and the next second's lookups are skipped), so it sits well
    # above a loaded loop's lag (0.25 s failed healthy lookups in request bursts). On a
    # partitioned Redis a failed lookup answers the next second's requests at once (the
    # key's last answer, or a 503): only requests that arrive while a lookup is in flight
    # wait, at most this long (with 1 s, about half of those whose key's answer is older
    # than the TTL). Finite: with inf a lookup never gave up on a partitioned Redis
    api_keys_redis_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    open_access: bool = False  # no API keys: every request is tenant "anonymous"
    admin_key: SecretStr | None = None
    # /metrics without the admin key. Off: its per-replica token counters move request by
    # request and its limit counters name tenants, so any client could watch the others'
    # traffic. (With open_access there is one tenant and /metrics is open.)
    metrics_public: bool = False
    upstream_api_key: SecretStr | None = None  # sent to replicas (the client's key never is)
    salt_secrets: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    discover: bool = False  # add replicas that agents register (allowlisted URLs only)
    replica_allowlist: Annotated[list[str], NoDecode] = Field(default_factory=list)
    gateway_id: str | None = None
    # upstream timeouts are finite: inf is no "no timeout" (the docs promise none), it left
    # a request on a wedged engine waiting for ever, never 504 and never ejecting it
    connect_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2.0
    # a streamed answer's head and first chunk: they come after the queue and the prefill
    first_byte_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 300.0
    # a non-streamed answer's head, which comes after the whole generation: a long one is
    # not a sick engine (a 16k-token reasoning answer at 50 tokens/s takes 320 s)
    response_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1800.0
    # between two chunks of a response
    read_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 300.0
    max_body_bytes: Annotated[int, Field(ge=1)] = 8 * 1024 * 1024
    # one upstream SSE event (the bytes buffered until its blank line): past it the stream
    # ends with the mid-stream error event. Unbounded, a replica sending an event without
    # its blank line grew the gateway's memory without limit. 64 MiB: far above any real
    # vLLM event (a Responses response.completed carries the whole output, docs/gateway.md)
    max_upstream_event_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024
    # one whole upstream answer read before it is relayed (a non-streamed completion, an
    # embedding, a stored response; error bodies are read to at most 1 MiB of it): past it
    # the client gets a 502 and the upstream connection is closed. Unbounded, a replica
    # (or anything on its port) sending an endless body grew the gateway's memory without
    # limit. 512 MiB: about 3 times the largest real answer, an embeddings batch of 2,048
    # inputs of 4,096 floats as JSON (~21 bytes a float: ~176 MB); prompt_logprobs of a
    # 128k-token prompt at 20 alternatives are of the same order (docs/gateway.md)
    max_upstream_body_bytes: Annotated[int, Field(ge=4096)] = 512 * 1024 * 1024
    # the Responses API's background mode (D33): the replica's in-flight ticket stays open
    # until the engine's stored response is terminal, which a watcher per response polls
    # for this often, for at most this long, and for at most this many responses at once,
    # of which one tenant at most this fraction (at least one); a background request past
    # either is refused before any work (429 the tenant's share, 503 the cap), never
    # served unwatched: its replica's load would forget it
    background_poll_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    background_watch_max_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 3600.0
    # how long a watched run's engine must report no request before the run is taken for
    # dead (gateway.load.IdleEngine): longer than one engine step, which its idle gauges hide
    background_idle_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 300.0
    background_watch_max: Annotated[int, Field(ge=0)] = 1024
    background_watch_tenant_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    # prompt text the tokenizer cache does not hold, past which its BPE runs in a thread
    tokenize_offload_chars: Annotated[int, Field(ge=0)] = OFFLOAD_CHARS
    # prompts in one /v1/completions batch, 400 beyond: vLLM has no cap, and each prompt
    # is an engine request (OpenAI caps its embeddings input arrays at 2,048)
    max_prompt_batch: Annotated[int, Field(ge=1)] = 2048
    # extra replicas tried when a connection fails before the first byte
    retries: Annotated[int, Field(ge=0)] = 2
    # of those, how many may follow an exchange the replica broke after the request was
    # sent (closed or reset with no byte of answer): a request that crashes its engine (a
    # query of death) takes down at most this many more replicas
    drop_retries: Annotated[int, Field(ge=0)] = 1
    # a client that reads nothing of its answer for this long (each wait for the socket
    # to take more bytes) is cut off and its upstream request cancelled: unbounded, one that
    # kept its connection open and read nothing held its stream, concurrency slot, upstream
    # connection and engine sequence for ever. 60 s is nginx's send_timeout
    client_write_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0
    # finite: with inf one stalled stream kept a SIGTERM'd gateway running until killed
    drain_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 30.0
    # SIGTERM: answer 503 (health, new requests) this long before closing the listener
    # (finite: with inf a SIGTERM never stopped the gateway)
    drain_grace_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    # upstream connections per replica host: 0 would make every request a pool timeout
    max_connections: Annotated[int, Field(ge=1)] = 1024
    otel_endpoint: str | None = None  # OTLP/HTTP traces endpoint; None = tracing off
    # JSON lines, one per answered request (gateway/requesttrace.py): `kvgate trace analyze`
    trace_out: Path | None = None
    otel_service_name: str = "kvgate-gateway"
    log_level: str = "INFO"
    log_json: bool = True
    seed: int | None = None  # routing RNG seed (tests, benchmarks)
    # the routing strategy for the life of the process, over the policy's routing.strategy
    # (which a policy reload then does not move); None: the policy's. An explain's
    # ?strategy= still wins for its one call. kvgate serve --strategy sets it too
    strategy: Strategy | None = None
    # `kvgate serve`: after start-up, move the start-up heap into the GC's permanent
    # generation (gc.freeze) so full collections scan only what requests allocate
    gc_freeze: bool = True
    # x-kvgate-replica (which replica served) and x-kvgate-predicted-cached-tokens headers
    expose_replica: bool = True
    # bound of each local tokenizer's segment cache (system prompts, documents, chat turns
    # per scope), in token ids: ~40 bytes each with their text, so 1,000,000 is ~40 MB
    tokenizer_cache_tokens: Annotated[int, Field(gt=0)] = SEGMENT_CACHE_TOKENS
    # CORS for browser apps on other origins (gateway/cors.py, docs/gateway.md "CORS"):
    # comma-separated; no origin (the default) is CORS off, "*" any origin
    cors_allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    cors_allowed_methods: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(CORS_METHODS)
    )
    cors_allowed_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(CORS_HEADERS)
    )
    # cookies or HTTP auth from the browser: only with a list of origins (not "*")
    cors_allow_credentials: bool = False
    # how long a browser keeps a preflight's answer (Chromium caps it at 7200 s)
    cors_max_age_s: Annotated[int, Field(ge=0, le=86400)] = 600
    # Chromium's Private Network Access: a public page may call a gateway on a private
    # address (Access-Control-Allow-Private-Network in the preflight's answer)
    cors_allow_private_network: bool = False
    # DEBUG ONLY, never in production: every tenant (and trust group) shares ONE cache scope,
    # so tenants hit each other's prefixes. It exists for the attack suite's positive
    # controls (``kvgate attack``), which must show that their probes detect a shared cache.
    debug_unsafe_shared_scope: bool = False

    @field_validator("salt_secrets", mode="before")
    @classmethod
    def _salt_secrets_given(cls, value: object) -> object:
        # an empty one (a template's unset variable, a secret that failed to render) was
        # "no secret": a random per-process salt, so no two gateways (nor one restarted)
        # shared a cached prefix, under a warning that the variable was absent
        parts = _split_csv(value)
        if isinstance(value, str) and not parts:
            raise ValueError(
                "empty: give one or two secrets (comma-separated, the first primary), or "
                "unset the variable for a random per-process one"
            )
        return parts

    @field_validator(
        "replica_allowlist",
        "cors_allowed_origins",
        "cors_allowed_methods",
        "cors_allowed_headers",
        mode="before",
    )
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)

    @field_validator("admin_key", "upstream_api_key", mode="after")
    @classmethod
    def _header_secret(cls, value: SecretStr | None) -> SecretStr | None:
        """Keys that travel in HTTP headers: a secret file's final newline is trimmed (no
        header can carry it, so that admin key could never be sent); a control character
        left inside is refused, as no header can carry it either."""
        if value is None:
            return None
        text = value.get_secret_value().strip()
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            raise ValueError("contains a control character, which no HTTP header carries")
        return SecretStr(text)

    @field_validator("admin_key", mode="after")
    @classmethod
    def _admin_key_given(cls, value: SecretStr | None) -> SecretStr | None:
        # an empty one (a template's unset variable) disabled the admin API and /metrics
        # (every call 401) without a word at start-up
        if value is not None and not value.get_secret_value():
            raise ValueError("empty: give a key, or unset the variable to disable the admin API")
        return value

    @field_validator("upstream_api_key", mode="after")
    @classmethod
    def _upstream_key_given(cls, value: SecretStr | None) -> SecretStr | None:
        # an empty one (a secret file mounted empty) was sent as "Bearer " to every
        # replica: an engine started with --api-key refused every request (401)
        if value is not None and not value.get_secret_value():
            raise ValueError("empty (a secret mounted empty?): unset it to send no key")
        return value

    @field_validator("policy", "api_keys_file", "trace_out", mode="before")
    @classmethod
    def _path_given(cls, value: object) -> object:
        # an empty value (a template's unset variable) was the path ".": "invalid policy .:
        # Is a directory", or "--open and API keys exclude each other" for no key file
        if isinstance(value, str) and not value.strip():
            raise ValueError("empty: give a file, or unset the variable")
        return value

    @field_validator("redis_url", mode="before")
    @classmethod
    def _redis_url_given(cls, value: object) -> object:
        # an empty one (a template's unset variable) ran the gateway on its embedded index
        # without a word: no shared index, load or in-flight records with the others
        if isinstance(value, str) and not value.strip():
            raise ValueError("empty: give a redis:// URL, or unset it for the embedded index")
        return check_redis_url(value) if isinstance(value, str) else value

    @field_validator("gateway_id")
    @classmethod
    def _gateway_id(cls, value: str | None) -> str | None:
        # the load store refuses it at every write: the gateway served, and its in-flight
        # records never reached Redis (a warning every refresh)
        if value:
            validate_gateway_id(value)
        return value

    @field_validator("otel_endpoint")
    @classmethod
    def _otel_endpoint(cls, value: str | None) -> str | None:
        # else accepted, and every span batch failed to export (an ERROR each batch)
        if value:
            url = urlsplit(value)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError("not an http(s) URL with a host (the OTLP/HTTP traces endpoint)")
        return value

    @field_validator("api_keys_miss_rate", "api_keys_miss_rate_global")
    @classmethod
    def _miss_rate(cls, value: float) -> float:
        # a refused lookup's wait is its shortfall over the rate: with 1e-320 it overflowed
        # to inf, and the 429's Retry-After (int(inf)) raised OverflowError, a 500 for every
        # unknown key past the burst; the tenant limits' floor (policies.schema)
        if 0 < value < MIN_RATE_PER_S:
            raise ValueError(f"0 (no budget) or at least {MIN_RATE_PER_S:g} per second")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty: give 0.0.0.0 (or ::) to listen on every interface")
        return value

    @field_validator("replica_allowlist", mode="after")
    @classmethod
    def _allowlist(cls, value: list[str]) -> list[str]:
        # checked here, not where discovery builds it inside the app's start-up, where a
        # bad entry was a traceback and uvicorn's exit 3
        try:
            ReplicaAllowlist(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (--allow takes [ID=]URL)") from None
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        KeyLayout(value)  # raises on a prefix Redis keys cannot carry
        return value

    @field_validator("replicas", mode="before")
    @classmethod
    def _replica_specs(cls, value: object) -> object:
        """Comma-separated specs, where a spec with embedded agents (``URL=EVENTS,REPLAY``)
        holds a comma itself: a part that is a ZMQ endpoint continues the spec before it."""
        parts = _split_csv(value)
        if not isinstance(parts, list):
            return parts
        specs: list[object] = []
        for part in parts:
            if specs and isinstance(part, str) and part.startswith(AGENT_ENDPOINT_SCHEMES):
                specs[-1] = f"{specs[-1]},{part}"
            else:
                specs.append(part)
        return specs

    @field_validator("cors_allowed_origins", mode="after")
    @classmethod
    def _cors_origins(cls, value: list[str]) -> list[str]:
        return [check_origin(v) for v in value]

    @field_validator("cors_allowed_methods", mode="after")
    @classmethod
    def _cors_methods(cls, value: list[str]) -> list[str]:
        return [check_token(v, "method").upper() for v in value]

    @field_validator("cors_allowed_headers", mode="after")
    @classmethod
    def _cors_headers(cls, value: list[str]) -> list[str]:
        return [check_token(v, "header").lower() for v in value]

    @model_validator(mode="after")
    def _cors(self) -> GatewaySettings:
        CorsPolicy.from_settings(self)  # refuses "*" with credentials, which browsers refuse
        return self

    @model_validator(mode="after")
    def _one_way_in(self) -> GatewaySettings:
        # open access ignores every key: beside a key source it is a deployment left open
        # by a flag (or an environment variable left over from a test)
        if self.open_access and (self.api_keys_file is not None or self.api_keys_redis):
            raise ValueError(
                "open access (--open, KVGATE_OPEN_ACCESS) and API keys (--api-keys, "
                "--api-keys-redis) exclude each other: with open access every request is "
                "tenant anonymous and no key is checked; pass one of them"
            )
        return self
