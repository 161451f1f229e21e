"""Settings of a simulated replica fleet (``kvgate replica``), env prefix ``KVGATE_REPLICA_``;
command-line flags override them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachecore.chatformat import ContentFormatOption
from cachecore.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_NUM_BLOCKS,
    EngineConfig,
    HashAlgo,
    WireHashFormat,
    get_profile,
)
from cachecore.kvevents import Encoding
from cachecore.tokenizer import ScoreTemplate, ServerChatDefaults, TokenizerError
from cachecore.urls import url_host

DEFAULT_MODEL = "kvgate-sim-8b"
DEFAULT_TOPIC = "kv-events"
EVENTS_PORT_OFFSET = 1000
REPLAY_PORT_OFFSET = 2000


def load_score_template(path: str) -> ScoreTemplate:
    """The ``score_template`` file's template; a ValueError saying why not."""
    try:
        return ScoreTemplate(Path(path).read_text())
    except (OSError, UnicodeDecodeError, TokenizerError) as exc:
        raise ValueError(f"cannot load the score template {path!r}: {exc}") from None


class ReplicaSettings(BaseSettings):
    """Everything the replicas of one fleet share."""

    # finite: --time-scale inf served requests that never finished (and a "ready" line
    # that was no JSON: Infinity)
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_REPLICA_", extra="ignore", allow_inf_nan=False
    )

    # an empty host (KVGATE_REPLICA_HOST= from an unset template variable) listened on
    # every interface, where the default is loopback; an empty events host failed in ZMQ's
    # bind ("No such device"): both refused, naming the explicit way
    host: str = "127.0.0.1"
    events_host: str = "127.0.0.1"
    model: str = DEFAULT_MODEL
    profile: str = "8b-h100"
    num_blocks: Annotated[int, Field(ge=1)] = DEFAULT_NUM_BLOCKS
    block_size: Annotated[int, Field(ge=1)] = DEFAULT_BLOCK_SIZE
    max_num_seqs: Annotated[int | None, Field(ge=1)] = None
    max_num_batched_tokens: Annotated[int | None, Field(ge=1)] = None
    max_model_len: Annotated[int, Field(ge=2)] = DEFAULT_MAX_MODEL_LEN
    time_scale: Annotated[float, Field(gt=0)] = 1.0
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: int | None = None
    event_hash_format: WireHashFormat = WireHashFormat.INT
    event_encoding: Encoding = Encoding.MIXED
    events_topic: str = DEFAULT_TOPIC
    publish_events: bool = True
    replay_buffer_steps: Annotated[int, Field(ge=1)] = 10000
    legacy_replay_reply: bool = False  # answer replay as [b"", seq, payload] (older vLLM)
    lora: list[str] = Field(default_factory=list)
    tokenizer_dir: str | None = None  # HF model dir (tokenizer.json + chat template)
    # vLLM's --chat-template-content-format: message contents handed to the chat template
    # as one string or as a list of parts (auto: detected from the template)
    chat_template_content_format: ContentFormatOption = "auto"
    access_log: bool = False  # uvicorn access log (debugging which endpoints peers call)
    # engine cores behind each replica's one HTTP port, each with its own KV cache and event
    # stream (vLLM's --data-parallel-size with its internal load balancing)
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    # behave as vLLM with EAGLE/EAGLE3/MTP speculative decoding: every prefix-cache hit
    # loses its last matched block (the gateway's models.<pool>.hit_drop_blocks: 1)
    drop_last_hit_block: bool = False
    # the Responses API's stored responses per replica, least recently used evicted past
    # it (D30; vLLM keeps its store in memory, unbounded)
    responses_store_max: Annotated[int, Field(ge=1)] = 1000
    # a file: the chat template each /score and /rerank pair is rendered with, as a vLLM
    # cross-encoder's --chat-template (Qwen3 rerankers); none: the tokenizer's pair template
    score_template: str | None = None
    # vLLM's --default-chat-template-kwargs (template variables under every chat's but a
    # pooling request's) and --reasoning-effort-map (a request's effort as the template
    # gets it): ServerChatDefaults
    default_chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort_map: dict[str, str] | None = None
    # vLLM's --exclude-tools-when-tool-choice-none: a chat completion's or Responses
    # request's tools not rendered under tool_choice "none" (/tokenize's are)
    exclude_tools_when_tool_choice_none: bool = False

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty: give 0.0.0.0 (or ::) to listen on every interface")
        # the replicas' URLs carry it bare (endpoints_for): a zone id it cannot be written
        # with there was a ValueError traceback out of the running fleet, exit 1
        url_host(v, zone="bare")
        return v

    @field_validator("events_host")
    @classmethod
    def _events_host(cls, v: str) -> str:
        if not v.strip():  # ZMQ's every interface; it binds no IPv6 (:: is "No such device")
            raise ValueError("empty: give * (or 0.0.0.0) to publish on every interface")
        return v

    @field_validator("tokenizer_dir")
    @classmethod
    def _dir_given(cls, v: str | None) -> str | None:
        # an empty one (a template's unset variable) served the built-in tokenizer without
        # a word, where a model's was asked for
        if v is not None and not v.strip():
            raise ValueError("empty: give a model directory, or unset it for the built-in one")
        return v

    @field_validator("score_template")
    @classmethod
    def _score_template_loads(cls, v: str | None) -> str | None:
        if v is not None:
            load_score_template(v)  # a file that does not read or compile: refused here
        return v

    @field_validator("default_chat_template_kwargs", "reasoning_effort_map")
    @classmethod
    def _chat_defaults_serve(cls, v: Any, info: ValidationInfo) -> Any:
        # what vLLM refuses at start-up, or on every chat: refused here
        ServerChatDefaults.check_field(str(info.field_name), v)
        return v

    def chat_defaults(self) -> ServerChatDefaults:
        """What this replica's server lays under every chat's template kwargs."""
        return ServerChatDefaults.of(
            self.default_chat_template_kwargs,
            self.reasoning_effort_map,
            self.exclude_tools_when_tool_choice_none,
        )

    @field_validator("model")
    @classmethod
    def _named_model(cls, v: str) -> str:
        # vLLM's served model names are never blank: clients and gateways route by them
        if not v.strip():
            raise ValueError("the served model name must not be blank")
        return v

    @field_validator("lora")
    @classmethod
    def _named_adapters(cls, v: list[str]) -> list[str]:
        if any(not name.strip() for name in v):
            raise ValueError("a LoRA adapter name must not be blank")
        if len(set(v)) != len(v):
            raise ValueError(f"a LoRA adapter name is given twice: {v}")
        return v

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        get_profile(v)
        return v

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            profile=get_profile(self.profile),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            wire_hash_format=self.event_hash_format,
            lora_names=tuple(self.lora),
            enable_events=self.publish_events,
            drop_last_hit_block=self.drop_last_hit_block,
        )


@dataclass(frozen=True, slots=True)
class ReplicaPorts:
    http: int
    events: int
    replay: int

    @classmethod
    def from_base(cls, base_port: int, index: int) -> ReplicaPorts:
        return cls(
            http=base_port + index,
            events=base_port + EVENTS_PORT_OFFSET + index,
            replay=base_port + REPLAY_PORT_OFFSET + index,
        )


@dataclass(frozen=True, slots=True)
class ReplicaEndpoints:
    """Where one replica listens: what agents, gateways and benchmarks connect to."""

    index: int
    url: str
    events_endpoint: str
    replay_endpoint: str
    model: str
    http_port: int
    events_port: int
    replay_port: int
    dp_rank: int | None = None  # the engine core, when several serve one URL

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "index": self.index,
            "url": self.url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "model": self.model,
        }
        if self.dp_rank is not None:
            out["dp_rank"] = self.dp_rank
        return out


def endpoints_for(
    settings: ReplicaSettings, index: int, ports: ReplicaPorts, dp_rank: int | None = None
) -> ReplicaEndpoints:
    ev_host = "127.0.0.1" if settings.events_host in ("0.0.0.0", "*") else settings.events_host
    http_host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return ReplicaEndpoints(
        index=index,
        # fetched with httpx (the fleet's readiness wait, the gateway): a zone id bare
        url=f"http://{url_host(http_host, zone='bare')}:{ports.http}",
        events_endpoint=f"tcp://{ev_host}:{ports.events}",
        replay_endpoint=f"tcp://{ev_host}:{ports.replay}",
        model=settings.model,
        http_port=ports.http,
        events_port=ports.events,
        replay_port=ports.replay,
        dp_rank=dp_rank,
    )
