"""Agent settings (pydantic-settings, environment prefix ``KVGATE_AGENT_``; the CLI's flags
override the environment)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachecore.index.base import DEFAULT_REMOVAL_LOG
from cachecore.index.layout import DEFAULT_PREFIX, validate_replica_id
from cachecore.index.redis import RedisTimeouts, check_redis_url, redis_timeouts
from cachecore.urls import split_user_info, url_host

MAX_TTL_S = 86_400.0
# bind addresses an agent cannot connect to: ZMQ refuses a connect to "*" ("Invalid
# argument"), and one to IPv6's "::" reaches no engine bound on tcp://*:PORT (IPv4 only, as
# vLLM's is). 0.0.0.0 is not one: a connect to it reaches this host (an agent beside it)
BIND_ONLY_HOSTS = frozenset({"*", "::", "[::]"})


class StopRegistration(StrEnum):
    """What a clean stop does with the replica's registration
    (``KVGATE_AGENT_DEREGISTER_ON_STOP``, ``--deregister-on-stop``)."""

    AUTO = "auto"  # deregister if the engine does not answer /health, else hand over
    ALWAYS = "always"  # deregister: the replica leaves discovery now (a scale-down)
    NEVER = "never"  # hand over, whatever the engine says


def check_zmq_endpoint(endpoint: str) -> str:
    """``endpoint`` if an agent can connect to it (``tcp://HOST:PORT``, port 1-65535, or
    ``ipc://PATH``), else ValueError. Checked up front, not by ZMQ's connect: tcp://HOST
    without a port (or udp://) was a ZMQError traceback in a running agent that then never
    became ready, and a port past 65535 connected to nothing without a word."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "ipc" and rest:
        return endpoint
    # any other scheme, or none: no error below may quote a secret
    info = split_user_info(endpoint)
    if info is not None:  # ZMQ takes none; its DNS lookup of "user@host" just fails later
        raise ValueError(
            f"a ZMQ endpoint carries no user or password: {info.redacted!r} "
            "(expected tcp://HOST:PORT)"
        )
    host, colon, port = rest.rpartition(":")
    if not (sep and scheme == "tcp" and colon and host and port.isdigit()):
        raise ValueError(
            f"not a ZMQ endpoint: {endpoint!r} (expected tcp://HOST:PORT or ipc://PATH)"
        )
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"not a TCP port (1-65535) in {endpoint!r}")
    if host in BIND_ONLY_HOSTS:
        # the engine's side (vLLM's --kv-events-config binds tcp://*:PORT): "*" was a
        # ZMQError traceback in a running agent that never became ready, "::" no event ever
        raise ValueError(
            f"{endpoint!r} is a bind address (the engine's side); the agent connects: "
            f"give the engine's host, e.g. tcp://10.0.0.5:{port}"
        )
    return endpoint


def check_engine_root_url(url: str) -> str:
    """``url`` if it can be an engine's root URL, else ValueError: an OpenAI client's base
    URL (ending in /v1) is not, since kvgate adds /v1/..., /health and /metrics itself. The
    one rule for the gateway's replica URLs and the agent's --engine-url: the agent took
    http://HOST:PORT/v1 and waited for ever on "engine not reachable" (its /v1/metrics
    answered 404) where `kvgate serve --replica` refused it."""
    if urlsplit(url).path.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"{url!r} ends in /v1: give the engine's root URL, without /v1 "
            "(its /health and /v1/completions are found under it)"
        )
    return url


class AgentSettings(BaseSettings):
    """Everything one agent (one engine replica) needs."""

    # every duration finite: an infinite TTL was an OverflowError traceback (int(inf * 1000))
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_AGENT_", extra="ignore", allow_inf_nan=False
    )

    replica_id: str
    engine_url: str
    events: str = Field(description="engine KV-event PUB endpoint, e.g. tcp://10.0.0.5:5557")
    replay: str | None = Field(default=None, description="engine replay ROUTER endpoint")
    topic: str = ""
    redis: str | None = None
    # the redis URL is a seed node of a Redis Cluster (the agent discovers the others)
    redis_cluster: bool = False
    # connect and read timeout of the agent's index, load and registration clients; None:
    # theirs (index writes 2 s to read, 1 s to connect; load records 0.5 s; registration
    # 1 s). Each failed write is retried (the index's within index_retry_max_s, load and
    # heartbeat at their next interval)
    redis_timeout_s: float | None = Field(default=None, gt=0)
    model: str | None = Field(default=None, description="override /v1/models")
    block_size: int | None = Field(default=None, gt=0, description="override cache_config_info")
    data_parallel_rank: int | None = Field(default=None, ge=0)
    attention_group: int | None = Field(
        default=None, ge=0, description="hybrid models: the full-attention group_idx to index"
    )

    # engine watch
    scrape_interval_s: float = Field(default=1.0, gt=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    unavailable_after_s: float = Field(default=5.0, gt=0)
    # an engine whose counters show blocks computed over this window while no live event
    # batch arrived publishes no events (cachecore.agent.silence): /health degraded; 0: off
    events_silence_window_s: float = Field(default=30.0, ge=0)

    # registration and load
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    # at most a day: Redis refuses a PX past its range ("value is not an integer or out of
    # range": every heartbeat failed), and a dead replica would linger that long anyway
    registration_ttl_s: float = Field(default=10.0, gt=0, le=MAX_TTL_S)
    load_ttl_s: float = Field(default=5.0, gt=0, le=MAX_TTL_S)
    # a clean stop: deregister, or leave the registration for the replica's next agent
    # (an agent restart or upgrade must not take a healthy engine out of discovery)
    deregister_on_stop: StopRegistration = StopRegistration.AUTO
    # how long a handed-over registration stays for the next agent to take over, from the
    # stop (its TTL is set to this); the gateways' removal grace (5 s) comes on top
    handover_window_s: float = Field(default=10.0, gt=0, le=MAX_TTL_S)

    # replay and ordering
    replay_timeout_s: float = Field(default=2.0, gt=0)
    replay_total_timeout_s: float = Field(default=60.0, gt=0)
    max_replay_batches: int = Field(default=1_000_000, gt=0)
    stale_probe_cooldown_s: float = Field(default=1.0, ge=0)
    queue_size: int = Field(default=10_000, gt=0)
    rcvhwm: int = Field(default=100_000, ge=0)

    # index writes
    max_coalesce_batches: int = Field(default=512, gt=0)
    max_coalesce_blocks: int = Field(default=20_000, gt=0)
    resync_chunk_blocks: int = Field(default=5_000, gt=0)
    index_check_interval_s: float = Field(default=2.0, gt=0)
    index_retry_max_s: float = Field(default=5.0, gt=0)
    # removals kept in the index's removal log for the gateways' claim checks; 0 keeps none
    # (their checks of an eviction stored again are then unverifiable: warned at start-up)
    removal_log: int = Field(default=DEFAULT_REMOVAL_LOG, ge=0)

    # bad input
    max_payload_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    max_tokens_per_event: int = Field(default=1024 * 1024, gt=0)

    # own HTTP and trace
    # an empty value (KVGATE_AGENT_HTTP_HOST= from an unset template variable) is refused:
    # it listened on every interface, where the default is loopback. Any address or name
    # (each address it resolves to is listened on, as the gateway does)
    http_host: str = "127.0.0.1"
    http_port: int | None = Field(default=None, ge=0, le=65535)
    key_prefix: str = Field(default=DEFAULT_PREFIX, min_length=1)  # Redis key namespace
    trace_out: Path | None = None

    @field_validator("replica_id")
    @classmethod
    def _valid_id(cls, v: str) -> str:
        return validate_replica_id(v)

    @field_validator("redis")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        # refused here, naming --redis: redis-py's "Port could not be cast to integer value
        # as 'abc'" out of the client built later read as an --http-port problem
        return check_redis_url(v) if v is not None else None

    @field_validator("http_host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty: give 0.0.0.0 to listen on every interface")
        # the agent writes it in its URL (cli.run): a zone id url_host refuses (an empty
        # one) was a ValueError traceback after start-up, exit 1
        url_host(v)
        return v

    @field_validator("trace_out", mode="before")
    @classmethod
    def _path_given(cls, v: object) -> object:
        # an empty value (a template's unset variable) was the path ".": "cannot open
        # --trace-out . (Is a directory)", as the gateway's empty paths were (126bba5)
        if isinstance(v, str) and not v.strip():
            raise ValueError("empty: give a file, or unset the variable")
        return v

    @field_validator("engine_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("engine_url must be an http(s) URL")
        if split_user_info(v) is not None:  # a Registration refuses it: no heartbeat could
            raise ValueError("engine_url must not carry user info (user:password@)")
        if "?" in v or "#" in v:  # so does it these, which no engine's root URL has either
            raise ValueError("engine_url must not carry a query or fragment")
        return check_engine_root_url(v.rstrip("/"))

    @field_validator("model")
    @classmethod
    def _named_model(cls, v: str | None) -> str | None:
        # as kvgate replica's --model (4581065): a blank name is a mistake, not a request
        # for the engine's; "" was taken as unset and fell back to /v1/models without a word
        if v is not None and not v.strip():
            raise ValueError(
                "the model name must not be blank (leave it unset to take the engine's /v1/models)"
            )
        return v

    @field_validator("events", "replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_zmq_endpoint(v)

    @model_validator(mode="after")
    def _ttls_outlive_refresh(self) -> AgentSettings:
        # a record that expires before its next write drops the replica (or its load) from
        # every gateway for part of each period
        pairs = (
            ("registration_ttl_s", "--registration-ttl", "heartbeat_interval_s"),
            ("load_ttl_s", "KVGATE_AGENT_LOAD_TTL_S", "scrape_interval_s"),
        )
        for ttl, where, refresh in pairs:
            if getattr(self, ttl) <= getattr(self, refresh):
                raise ValueError(
                    f"{ttl} ({where}, {getattr(self, ttl):g} s) must exceed {refresh} "
                    f"({getattr(self, refresh):g} s): the record would expire between writes"
                )
        return self


INDEX_WRITE_TIMEOUTS: RedisTimeouts = {"socket_timeout_s": 2.0, "connect_timeout_s": 1.0}
"""The agent's index client's timeouts unless ``KVGATE_AGENT_REDIS_TIMEOUT_S`` is set: its
writes are large and rare compared with gateway lookups, so longer than theirs."""


def index_timeouts(settings: AgentSettings) -> RedisTimeouts:
    """The timeouts of ``settings``' agent's index client, standalone or embedded in a
    gateway: ``redis_timeout_s`` to connect and to read, unset :data:`INDEX_WRITE_TIMEOUTS`."""
    return redis_timeouts(settings.redis_timeout_s) or INDEX_WRITE_TIMEOUTS


HANDOVER_WINDOW_WARN_RATIO = 10.0
"""A hand-over window more than this many registration TTLs long is warned about at the
start of ``kvgate agent``: up to a day is accepted (a slow upgrade may need minutes), but a
typo that long keeps a stopped engine discovered (and ``kvgate index forget`` refusing it)
for that long after a stop that handed over."""


def handover_window_warning(settings: AgentSettings) -> str | None:
    """The start-up WARNING for a ``handover_window_s`` far above ``registration_ttl_s``
    (more than :data:`HANDOVER_WINDOW_WARN_RATIO` times), else None."""
    window, ttl = settings.handover_window_s, settings.registration_ttl_s
    if window <= HANDOVER_WINDOW_WARN_RATIO * ttl:
        return None
    return (
        f"KVGATE_AGENT_HANDOVER_WINDOW_S (--handover-window) is {window:g} s, more than "
        f"{HANDOVER_WINDOW_WARN_RATIO:g} x the registration TTL ({ttl:g} s): a stop that hands "
        f"the registration over keeps the replica discovered, and `kvgate index forget` "
        f"refusing it, for {window:g} s if no agent follows; give the time a restart takes"
    )
