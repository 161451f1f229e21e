"""The routing policy file: a pydantic schema for ``policies/*.yaml``.

Every section forbids unknown fields, so a typo is an error naming the field, not a silent
default. :func:`load_policy` raises :class:`PolicyError` whose message lists each failing
field as a dotted path (``routing.temperature: Input should be greater than or equal to 0``);
the gateway keeps its previous policy when that happens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cachecore.argtypes import validation_message
from cachecore.chatformat import ContentFormatOption
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients
from cachecore.tokenizer import ScoreTemplate, ServerChatDefaults, TokenizerError
from gateway.routing import MissTieBreak, RoutingParams, Strategy


class FieldValueError(ValueError):
    """A model validator's refusal naming the field it is about, relative to the model it
    validates: pydantic places a model validator's error at the model itself (at the root
    for :class:`Policy`), so without it :class:`PolicyError` could not name the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _takes(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field of ``annotation`` takes a value of one of ``kinds`` (a Literal's
    values by their type: ``version: Literal[1]`` takes an int)."""
    if annotation in kinds or type(annotation) in kinds:
        return True
    return any(_takes(a, kinds) for a in get_args(annotation))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        # YAML's true/false are bools, which pydantic's lax mode takes as 1 and 0 in a
        # number field: `overhead_ms: true` was 1 ms, `k: true` 1, accepted without a word
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if (
                    isinstance(value, bool)
                    and field is not None
                    and _takes(field.annotation, (int, float))
                    and not _takes(field.annotation, (bool,))
                ):
                    raise FieldValueError(name, f"a number, not {str(value).lower()}")
        return data


# ``allow_inf_nan=False``: YAML reads ``.inf``, ``.nan`` and ``1e400`` (inf) as floats, and
# a non-finite value here turns routing costs or timers into NaN at request time
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
UnitFloat = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]

# Upper bounds on the cost model, so its arithmetic stays finite: a cost multiplies these by
# token and request counts (far below 1e12) and, through the fit, by at most ``fit.bound``
# (<= 1e3), which keeps every term below 1e30, nowhere near float overflow (1e308). Real
# engines sit orders of magnitude inside them: tens of ms of overhead, under 1 ms per token.
MAX_COST_MS = 1e6  # a fixed term (overhead, saturation): about 17 minutes
MAX_COST_MS_PER_UNIT = 1e4  # per token or running request: 10 s each
MAX_FIT_BOUND = 1e3
MAX_TIER_LOAD_FACTOR = 1e4
CostMs = Annotated[float, Field(ge=0, le=MAX_COST_MS, allow_inf_nan=False)]
CostMsPerUnit = Annotated[float, Field(ge=0, le=MAX_COST_MS_PER_UNIT, allow_inf_nan=False)]
TierFactor = Annotated[float, Field(gt=0, le=MAX_TIER_LOAD_FACTOR, allow_inf_nan=False)]
# A tenant's refill rate, per second. The limiter's wait is a shortfall (at most a request,
# or a prompt's token count) over the rate: with 1e-320 it overflowed to inf, and the 429's
# Retry-After (int(inf)) raised OverflowError, so every rate-limited request was a 500.
# 1e-6 (one per 11.6 days) keeps any wait far below float overflow.
MIN_RATE_PER_S = 1e-6
RatePerS = Annotated[float, Field(ge=MIN_RATE_PER_S, allow_inf_nan=False)]


class PrefixAffinityPolicy(_Section):
    cache_threshold: UnitFloat = 0.3
    balance_abs_threshold: Annotated[int, Field(ge=0)] = 64
    balance_rel_threshold: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.5


class StickyPolicy(_Section):
    slack: NonNegFloat = 0.25
    slack_ms: NonNegFloat = 50.0


class RoutingPolicy(_Section):
    strategy: Strategy = Strategy.EXPECTED_LATENCY
    temperature: NonNegFloat = 0.0
    tie_epsilon_ms: NonNegFloat = 0.5
    tie_fraction: UnitFloat = 0.1
    spill_queue_ms: PositiveFloat | None = None
    cold_fraction: UnitFloat = 0.1
    miss_tie_break: MissTieBreak = MissTieBreak.SCOPE_TREE
    # a streamed request still without its first token this long after its predicted
    # TTFT makes its replica overdue by the excess, added to that replica's queue wait
    # (a wedged engine whose HTTP answers); None: off
    overdue_grace_ms: PositiveFloat | None = 2000.0
    prefix_affinity: PrefixAffinityPolicy = PrefixAffinityPolicy()
    sensitive_sticky: StickyPolicy = StickyPolicy()

    def params(self) -> RoutingParams:
        pa, st = self.prefix_affinity, self.sensitive_sticky
        return RoutingParams(
            strategy=self.strategy,
            temperature=self.temperature,
            tie_epsilon_ms=self.tie_epsilon_ms,
            tie_fraction=self.tie_fraction,
            spill_queue_ms=self.spill_queue_ms,
            cache_threshold=pa.cache_threshold,
            balance_abs_threshold=pa.balance_abs_threshold,
            balance_rel_threshold=pa.balance_rel_threshold,
            sticky_slack=st.slack,
            sticky_slack_ms=st.slack_ms,
            cold_fraction=self.cold_fraction,
            miss_tie_break=self.miss_tie_break,
        )


class FitPolicy(_Section):
    enabled: bool = True
    bound: Annotated[float, Field(ge=1, le=MAX_FIT_BOUND, allow_inf_nan=False)] = 4.0
    forgetting: Annotated[float, Field(gt=0.5, le=1, allow_inf_nan=False)] = 0.995
    min_samples: Annotated[int, Field(ge=1)] = 20


class TierLoadFactor(_Section):
    cpu: TierFactor = 1.0
    disk: TierFactor = 4.0
    remote: TierFactor = 10.0


class CostPolicy(_Section):
    overhead_ms: CostMs = 30.0
    prefill_ms_per_token: CostMsPerUnit = 0.25
    load_ms_per_token: CostMsPerUnit = 0.01
    decode_ms_per_running: CostMsPerUnit = 0.5
    saturation_ms: CostMs = 200.0
    pending_weight: UnitFloat = 0.8
    stall_weight: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 0.15
    recompute_weight: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 1.0
    tier_load_factor: TierLoadFactor = TierLoadFactor()
    fit: FitPolicy = FitPolicy()

    def coefficients(self) -> Coefficients:
        t = self.tier_load_factor
        return Coefficients(
            overhead_ms=self.overhead_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            load_ms_per_token=self.load_ms_per_token,
            decode_ms_per_running=self.decode_ms_per_running,
            saturation_ms=self.saturation_ms,
            pending_weight=self.pending_weight,
            stall_weight=self.stall_weight,
            recompute_weight=self.recompute_weight,
            tier_load_factor={Tier.CPU: t.cpu, Tier.DISK: t.disk, Tier.REMOTE: t.remote},
        )


class IndexPolicy(_Section):
    lookup_timeout_ms: PositiveFloat = 5.0
    pending_ttl_ms: Annotated[int, Field(gt=0)] = 2000
    max_prompt_blocks: Annotated[int, Field(gt=0)] = 8192


TokenizerKind = Literal["builtin", "hf", "engine_render", "engine_tokenize"]


def hf_dir_problem(directory: Path) -> str | None:
    """Why :meth:`cachecore.tokenizer.HFTokenizer.from_dir` would fail on ``directory``
    (None if its files are there), for every reader of a policy (the gateway at start-up
    and at each reload, ``kvgate simulate --policy``). Files are checked, not parsed:
    ``tokenizer.json`` can be large, and parsing runs on the event loop; only its first
    bytes are read, which must open a JSON object (a Git LFS pointer, a clone made without
    git-lfs, an HTML error page saved by a download). A file cut short passes this: the
    gateway refuses it when it loads the policy's tokenizers, before applying it
    (gateway.tokenization ``TokenizerPools.load_hf``)."""
    if not directory.is_dir():
        return f"{str(directory)!r} is not a directory"
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        return f"no tokenizer.json in {str(directory)!r}"
    try:
        with tok_file.open("rb") as fh:
            head = fh.read(256).removeprefix(b"\xef\xbb\xbf").lstrip()
    except OSError as exc:
        return f"unreadable {str(tok_file)!r}: {exc.strerror or exc}"
    if head.startswith(b"version https://git-lfs"):
        return f"{str(tok_file)!r} is a Git LFS pointer, not the file (run git lfs pull)"
    if not head.startswith(b"{"):
        return f"{str(tok_file)!r} is not a tokenizer.json (no JSON object)"
    cfg_file = directory / "tokenizer_config.json"
    cfg: Any = {}
    if cfg_file.is_file():  # from_dir reads it for the special tokens even beside a .jinja
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"unreadable {str(cfg_file)!r}: {exc}"
    if (directory / "chat_template.jinja").is_file():
        return None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("chat_template"), str):
        return (
            f"no chat template in {str(directory)!r} (chat_template.jinja, or a string"
            " chat_template in tokenizer_config.json)"
        )
    return None


class ModelPool(_Section):
    """How the gateway tokenizes one model's prompts (must equal the engine's tokens)."""

    tokenizer: TokenizerKind = "builtin"
    tokenizer_dir: str | None = None
    # the engine's --chat-template-content-format: how a local tokenizer hands message
    # contents to its chat template (auto: detected from the template, as vLLM does)
    chat_template_content_format: ContentFormatOption = "auto"
    block_size: Annotated[int, Field(gt=0)] = 16
    max_num_seqs: Annotated[int, Field(gt=0)] = 256  # the engine's concurrent sequences
    alignment_check: bool = True
    # prompt tokens counted per media part (image, audio, video) of a chat, which the gateway
    # cannot tokenize: for the routing cost and the tenant's uncached-token budget
    media_part_tokens: Annotated[int, Field(ge=0)] = 1024
    # blocks the engine drops off every prefix-cache hit: 1 for vLLM with EAGLE, EAGLE3 or
    # MTP speculative decoding (it recomputes the last matched block for the drafter);
    # predictions and claim checks are that much lower than the index's match
    hit_drop_blocks: Annotated[int, Field(ge=0)] = 0
    # the text of the chat template the engine's cross-encoder renders each /score and
    # /rerank pair with (its --chat-template, or the one its Sentence Transformers config
    # names: Qwen3 rerankers); none: the pair is sized by the tokenizer's pair template
    score_template: str | None = None
    # the engine's --default-chat-template-kwargs and --reasoning-effort-map (vLLM's
    # JSON, here YAML): template variables under every chat request's own (not a pooling
    # request's), and a request's reasoning effort rewritten before the template gets it
    default_chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort_map: dict[str, str] | None = None
    # the engine's --exclude-tools-when-tool-choice-none: a chat completion's or Responses
    # request's tools not rendered when its tool_choice is "none" (/tokenize's are)
    exclude_tools_when_tool_choice_none: bool = False

    @field_validator("default_chat_template_kwargs", "reasoning_effort_map")
    @classmethod
    def _vllm_serves_chat_defaults(cls, v: Any, info: ValidationInfo) -> Any:
        # what vLLM refuses at start-up, or on every chat request
        ServerChatDefaults.check_field(str(info.field_name), v)
        return v

    @cached_property
    def chat_defaults(self) -> ServerChatDefaults:
        """What this pool's engines lay under every chat's template kwargs, and whether
        they exclude tools under tool_choice "none", built once."""
        return ServerChatDefaults.of(
            self.default_chat_template_kwargs,
            self.reasoning_effort_map,
            self.exclude_tools_when_tool_choice_none,
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        copied = super().model_copy(update=update, deep=deep)
        if update:  # pydantic copies the cached chat_defaults with the fields: built anew
            copied.__dict__.pop("chat_defaults", None)
        return copied

    @field_validator("score_template")
    @classmethod
    def _score_template_compiles(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty: give the template's text, or leave it unset")
        if v is not None:
            try:
                ScoreTemplate(v)
            except TokenizerError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("tokenizer_dir")
    @classmethod
    def _hf_dir_loads(cls, v: str | None, info: ValidationInfo) -> str | None:
        # a field validator (not the model's) so the error names models.<pool>.tokenizer_dir
        if v and info.data.get("tokenizer") == "hf":
            problem = hf_dir_problem(Path(v))
            if problem is not None:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _dir_for_hf(self) -> ModelPool:
        if self.tokenizer == "hf" and not self.tokenizer_dir:
            raise FieldValueError("tokenizer_dir", "tokenizer 'hf' needs tokenizer_dir")
        if self.tokenizer != "hf" and self.tokenizer_dir is not None:
            # read by no other tokenizer: the operator's directory would never be looked at
            raise FieldValueError(
                "tokenizer_dir",
                f"only with tokenizer 'hf' (tokenizer {self.tokenizer!r} reads none)",
            )
        if self.tokenizer.startswith("engine_") and self.chat_template_content_format != "auto":
            # the engine renders these pools' chats in its own format: never read
            raise FieldValueError(
                "chat_template_content_format",
                f"only with a local tokenizer ({self.tokenizer!r} renders on the engine)",
            )
        if self.tokenizer.startswith("engine_") and self.default_chat_template_kwargs:
            # the engine lays its own under the chats it renders or tokenizes: never read
            raise FieldValueError(
                "default_chat_template_kwargs",
                f"only with a local tokenizer ({self.tokenizer!r} applies the engine's own)",
            )
        if self.tokenizer == "engine_render" and self.reasoning_effort_map:
            raise FieldValueError(
                "reasoning_effort_map",
                "not with tokenizer 'engine_render' (the engine maps the efforts it renders)",
            )
        return self


class ModelsPolicy(_Section):
    default: ModelPool = ModelPool()
    pools: dict[str, ModelPool] = Field(default_factory=dict)

    def pool(self, model: str) -> ModelPool:
        return self.pools.get(model, self.default)


SensitiveKind = Literal["none", "session", "request"]


class SensitivePolicy(_Section):
    default: SensitiveKind = "none"
    allow_header: bool = False  # may clients ask via x-kvgate-sensitive: session|request
    # requests to these (and to their LoRA adapters) are always sensitive
    models: list[str] = Field(default_factory=list)
    models_kind: Literal["session", "request"] = "session"


def bucket_burst(rate: float, burst: float | None) -> float:
    """What a rate limit's token bucket holds: ``burst`` as given, else one second of the
    rate (at least 1, so a rate below 1/s still admits one request or token)."""
    return burst if burst is not None else max(rate, 1.0)


class TenantLimits(_Section):
    requests_per_s: RatePerS | None = None
    requests_burst: PositiveFloat | None = None
    max_concurrency: Annotated[int, Field(gt=0)] | None = None
    uncached_tokens_per_s: RatePerS | None = None
    uncached_tokens_burst: PositiveFloat | None = None
    cold_replica_count: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> TenantLimits:
        # a bucket exists only with its rate: a burst alone would be accepted and limit
        # nothing, while the operator believes the tenant limited
        if self.requests_burst is not None and self.requests_per_s is None:
            raise FieldValueError(
                "requests_burst", "needs requests_per_s (alone it limits nothing)"
            )
        if self.uncached_tokens_burst is not None and self.uncached_tokens_per_s is None:
            raise FieldValueError(
                "uncached_tokens_burst", "needs uncached_tokens_per_s (alone it limits nothing)"
            )
        return self


PriorityMode = Literal["passthrough", "strip", "fixed", "clamp"]
EngineInt = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class PriorityPolicy(_Section):
    """The engine scheduling ``priority`` a tenant's requests carry upstream. vLLM and SGLang
    honour it when the engine runs ``--scheduling-policy priority`` (vLLM runs lower values
    first; SGLang higher ones, unless ``--schedule-low-priority-values-first``), so a
    client's own value lets a tenant schedule itself ahead of the others.

    ``strip`` (the default): the field is removed, every request gets the engine's default
    (0); ``passthrough``: the client's value as sent (the behaviour before this rule);
    ``fixed``: every request gets ``value``, whatever the client sent; ``clamp``: the
    client's value (0 when it sent none, vLLM's default) kept within ``[min, max]`` (either
    bound may be left out). A client's priority that is no integer is a 400 in every mode,
    as vLLM answers it."""

    mode: PriorityMode = "strip"
    value: EngineInt | None = None
    min: EngineInt | None = None
    max: EngineInt | None = None

    @model_validator(mode="after")
    def _fields_of_mode(self) -> PriorityPolicy:
        if self.mode == "fixed":
            if self.value is None:
                raise FieldValueError("value", "required with mode fixed")
        elif self.value is not None:
            raise FieldValueError("value", "only with mode fixed")
        if self.mode == "clamp":
            if self.min is None and self.max is None:
                raise FieldValueError("min", "mode clamp needs min, max or both")
            if self.min is not None and self.max is not None and self.min > self.max:
                raise FieldValueError("min", "must be <= max")
        elif self.min is not None or self.max is not None:
            raise FieldValueError("min" if self.min is not None else "max", "only with mode clamp")
        return self

    def upstream(self, sent: int | None) -> int | None:
        """The value to send for a client's ``sent`` (None: it sent none), or None to send
        no field (``strip``, or ``passthrough`` of nothing)."""
        if self.mode == "passthrough":
            return sent
        if self.mode == "strip":
            return None
        if self.mode == "fixed":
            return self.value
        got = 0 if sent is None else sent
        if self.min is not None and got < self.min:
            got = self.min
        if self.max is not None and got > self.max:
            got = self.max
        return got


class TenantPolicy(_Section):
    trust_group: str | None = None
    sensitive: SensitivePolicy = SensitivePolicy()
    limits: TenantLimits = TenantLimits()
    priority: PriorityPolicy = PriorityPolicy()


class QuarantinePolicy(_Section):
    enabled: bool = True
    missing_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.5  # X
    k: Annotated[int, Field(gt=0)] = 3
    m: Annotated[int, Field(gt=0)] = 5
    min_claimed_blocks: Annotated[int, Field(gt=0)] = 2
    recover_after: Annotated[int, Field(gt=0)] = 3
    # a repeat offender proves itself longer: each quarantine it earns doubles the agreeing
    # checks its next one needs (recover_after, 2x, 4x, ...) up to recover_after_max, and
    # forgive_after checked requests in service without a bad one forget one (D22)
    recover_after_max: Annotated[int, Field(gt=0, le=1_000_000)] = 1000
    forgive_after: Annotated[int, Field(gt=0, le=1_000_000)] = 1000
    # a disagreement waits this long for the agent to report the eviction behind it before
    # it counts as a false claim: an agent that lags (a starved CPU) is not a liar
    settle_s: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = 3.0
    # agents stamp removals with their own clocks: a removal this much before the lookup
    # still counts as "after" it (lenient: it only excuses a miss)
    clock_skew_ms: Annotated[int, Field(ge=0, le=60_000)] = 250
    # an agent-written time (a removal's, the removal log's floor) later than the gateway's
    # clock (or the agent's own latest write) by more than this is a lie: it accuses
    # (tampered), so it is generous; an honest agent's clock is never this far ahead
    tamper_margin_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 10_000
    # a disagreement whose removal log no longer reaches back to the lookup cannot be judged;
    # this many among the replica's last unverifiable_window checked requests quarantine it
    # all the same (D22): a rogue agent raises its log's floor for that, and an honest log
    # trimmed so fast is too short for its churn. A rogue's unjudged lies stay below
    # max_unverifiable / unverifiable_window of its checked requests. 0: the track is off
    max_unverifiable: Annotated[int, Field(ge=0)] = 6
    unverifiable_window: Annotated[int, Field(gt=0, le=1_000_000)] = 1000

    @model_validator(mode="after")
    def _k_le_m(self) -> QuarantinePolicy:
        if self.k > self.m:
            raise FieldValueError("k", "must be <= quarantine.m")
        if self.max_unverifiable > self.unverifiable_window:
            raise FieldValueError("max_unverifiable", "must be <= quarantine.unverifiable_window")
        return self


class HealthPolicy(_Section):
    interval_s: PositiveFloat = 0.5
    timeout_s: PositiveFloat = 0.5
    unhealthy_after: Annotated[int, Field(gt=0)] = 1
    healthy_after: Annotated[int, Field(gt=0)] = 1
    eject_after_failures: Annotated[int, Field(gt=0)] = 3
    eject_s: PositiveFloat = 5.0
    models_refresh_s: PositiveFloat = 10.0


class PrecisionPolicy(_Section):
    warn_error_fraction: UnitFloat = 0.05
    warn_interval_s: PositiveFloat = 30.0


# a tenant name, as API keys (file or Redis hash) must give it: gateway.auth checks keys'
# tenants with this one
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")


def not_a_tenant_name(name: str) -> str:
    """The refusal's words for a name :data:`TENANT_NAME` does not match (policy and admin)."""
    return f"{name!r} is not a tenant name ([A-Za-z0-9._-]{{1,64}})"


class Policy(_Section):
    version: Literal[1] = 1
    routing: RoutingPolicy = RoutingPolicy()
    cost: CostPolicy = CostPolicy()
    index: IndexPolicy = IndexPolicy()
    models: ModelsPolicy = ModelsPolicy()
    default_tenant: TenantPolicy = TenantPolicy()
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    trust_groups: dict[str, list[str]] = Field(default_factory=dict)
    quarantine: QuarantinePolicy = QuarantinePolicy()
    health: HealthPolicy = HealthPolicy()
    precision: PrecisionPolicy = PrecisionPolicy()

    @model_validator(mode="after")
    def _groups_declared(self) -> Policy:
        for name in self.tenants:
            # no request can carry another name (gateway.auth refuses it for a key's
            # tenant): the entry's limits and scope would silently never apply
            if not TENANT_NAME.match(name):
                raise FieldValueError(
                    f"tenants.{name}",
                    f"{not_a_tenant_name(name)}: no API key's tenant can have it, so "
                    "these settings would never apply",
                )
        for name, t in self.tenants.items():
            g = t.trust_group
            if g is None:
                continue
            if g not in self.trust_groups:
                raise FieldValueError(
                    f"tenants.{name}.trust_group", f"undeclared trust group {g!r}"
                )
            if name not in self.trust_groups[g]:
                raise FieldValueError(
                    f"tenants.{name}.trust_group", f"{name!r} is not a member of {g!r}"
                )
        if self.default_tenant.trust_group is not None:
            raise FieldValueError(
                "default_tenant.trust_group", "the default tenant cannot join a group"
            )
        # the scope comes from the tenant's own trust_group alone: a member listed here
        # that does not name the group would share nothing, the operator's intended
        # sharing silently not happening (and a typo never reported)
        for g, members in self.trust_groups.items():
            for i, name in enumerate(members):
                if not TENANT_NAME.match(name):
                    why = not_a_tenant_name(name)
                elif name not in self.tenants:
                    why = f"{name!r} is not in tenants: declare it with trust_group: {g}"
                elif self.tenants[name].trust_group != g:
                    why = f"{name!r} does not set trust_group: {g} (both sides are needed)"
                else:
                    continue
                raise FieldValueError(f"trust_groups.{g}.{i}", why)
        return self

    def tenant(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.default_tenant)


class PolicyError(ValueError):
    """An invalid policy file; ``fields`` lists the failing dotted paths (a problem with no
    field, such as YAML that does not parse, adds none)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.fields = list(dict.fromkeys(f for f, _ in problems if f))  # each once
        lines = "; ".join(f"{f}: {m}" if f else m for f, m in problems)
        super().__init__(f"invalid policy {source}: {lines}")


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        error = err.get("ctx", {}).get("error")
        if isinstance(error, FieldValueError):  # a model validator's: it names its field
            loc.append(error.field)
        out.append((".".join(loc), validation_message(err)))
    return out


def parse_policy(data: Any, source: str = "<policy>") -> Policy:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(source, [("", "the policy must be a mapping")])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, _problems(exc)) from None


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping repeats a key (``line``, ``column`` and ``first_line`` count from 1)."""

    def __init__(self, key: Any, line: int, first_line: int, column: int) -> None:
        super().__init__(problem=f"duplicate key {key!r}")
        self.key, self.line, self.first_line, self.column = key, line, first_line, column


class _UniqueKeyLoader(yaml.SafeLoader):
    """``safe_load`` that refuses a repeated mapping key: PyYAML keeps the last one, so a
    second ``routing:`` block appended to a file would silently drop the first's settings.
    Merge keys (``<<: *anchor``) still work: keys they bring in may be overridden."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # ids of the mapping nodes checked (all live)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # construct_mapping flattens every mapping (and, recursively, the mappings merged
        # into it) before reading it, and flattening rewrites ``node.value`` in place: so
        # check here, once per node, while the node still holds only the keys written
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        column = key_node.start_mark.column + 1
                        raise DuplicateKeyError(key, line, seen[key], column)
                    seen[key] = line
                except TypeError:  # an unhashable key: construct_mapping reports it
                    continue
        super().flatten_mapping(node)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects


def _key_path(text: str, key: Any, line: int, column: int) -> str:
    """The dotted path of the mapping key ``key`` written at ``line`` and ``column``
    (from 1) of ``text`` (``routing.strategy``; a sequence item is its index), or
    "" if it is not found. The column tells apart two keys of one name on one line (flow
    style: ``{a: {x: 1}, b: {x: 1, x: 2}}``)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: no duplicate check
    except yaml.YAMLError:
        return ""
    seen: set[int] = set()  # an aliased node is walked once, where its anchor is

    def walk(node: yaml.Node | None, path: list[str]) -> list[str] | None:
        if node is None or id(node) in seen:
            return None
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                mark = key_node.start_mark
                if mark.line + 1 == line and mark.column + 1 == column and name == str(key):
                    return [*path, name]
                found = walk(value, [*path, name])
                if found is not None:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                found = walk(item, [*path, str(i)])
                if found is not None:
                    return found
        return None

    return ".".join(walk(root, []) or [])


EMPTY_POLICY = "the policy is empty (no YAML mapping); write {} for the built-in defaults"


def parse_policy_text(text: str, source: str = "<policy>", allow_empty: bool = True) -> Policy:
    """``allow_empty=False`` (a reload) refuses an empty document: a file read between its
    truncation and its rewrite is one, and applied it would be the built-in defaults."""
    try:
        data = _load_yaml(text)
    except DuplicateKeyError as exc:
        where = f"line {exc.line} (first at line {exc.first_line})"
        field = _key_path(text, exc.key, exc.line, exc.column)
        raise PolicyError(source, [(field, f"duplicate key {exc.key!r} at {where}")]) from None
    except yaml.YAMLError as exc:
        raise PolicyError(source, [("", f"not valid YAML: {exc}")]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise PolicyError(source, [("", "not a policy: nested too deeply")]) from None
    if data is None and not allow_empty:
        raise PolicyError(source, [("", EMPTY_POLICY)])
    return parse_policy(data, source)


def load_policy(path: Path | str, allow_empty: bool = True) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    # ValueError: UnicodeDecodeError, a file that is no text (a binary file, a torn write)
    except (OSError, ValueError) as exc:
        raise PolicyError(str(p), [("", f"cannot read: {exc}")]) from None
    return parse_policy_text(text, str(p), allow_empty)


def builtin_policy_path(name: str = "default") -> Path:
    return Path(__file__).with_name(f"{name}.yaml")
