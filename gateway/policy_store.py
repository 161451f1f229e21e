"""The live policy: load, validate, reload on file change, keep the old one on error."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from cachecore.tasks import cancel_and_wait
from gateway.filewatch import FileVersion, SettledChange, file_version
from policies.schema import (
    Policy,
    PolicyError,
    PriorityPolicy,
    SensitiveKind,
    SensitivePolicy,
    TenantLimits,
    TenantPolicy,
    bucket_burst,
    load_policy,
    parse_policy_text,
)

log = logging.getLogger(__name__)

RETRY_CAP_S = 30.0
"""The longest wait between the watcher's retries of a file reload refused for what lies
outside the policy file (an hf tokenizer still being copied, an engine's block size)."""

WEAKEN_SETTLE_S = 5.0
"""How long a policy file must keep still before a reload of it that weakens isolation is
applied (``KVGATE_POLICY_WEAKEN_SETTLE_S``; at least the poll interval)."""

_KIND_RANK: dict[str, int] = {"none": 0, "session": 1, "request": 2}
# quarantine thresholds that let more false claims pass when raised / when lowered
_QUARANTINE_LOOSER_UP = (
    "missing_fraction",
    "min_claimed_blocks",
    "settle_s",
    "clock_skew_ms",
    "tamper_margin_ms",
)
_QUARANTINE_LOOSER_DOWN = ("recover_after", "recover_after_max", "forgive_after")
# (count, window) pairs: quarantined at `count` among the last `window` checks
_QUARANTINE_RATES = (("k", "m"), ("max_unverifiable", "unverifiable_window"))


def isolation_weakenings(old: Policy, new: Policy) -> list[str]:
    """What ``new`` loosens of the isolation ``old`` gives, one line each
    (``default_tenant.sensitive.default: session -> none``); empty when nothing. A file
    reload that weakens is applied only once the file has kept still for
    ``KVGATE_POLICY_WEAKEN_SETTLE_S``: every section is optional, so a file caught half
    written is a valid policy whose missing sections are the loose defaults.

    For the default tenant (every unlisted tenant) and each tenant named in either policy,
    as it applies to that tenant (one dropped from or added to ``tenants`` is compared with
    the default tenant's settings it leaves or had):

    * ``sensitive.default`` lowered (none < session < request);
    * a model of the old ``sensitive.models`` whose requests get a lower kind: dropped from
      the list or ``models_kind`` lowered (unless ``default`` still gives the old kind);
    * ``limits``: any limit removed (null) or raised: ``requests_per_s``,
      ``uncached_tokens_per_s``, their bursts (as the limiter applies them: ``max(rate,
      1)`` when null), ``max_concurrency``, ``cold_replica_count`` (cold confinement);
    * ``priority``: more of the client's own value let through (``passthrough`` from
      another mode, ``clamp`` from ``strip`` or ``fixed``, a clamp's bound widened or
      dropped): a tenant could schedule itself ahead of the others;
    * its trust group: a tenant whose cache scope is now shared with a tenant it did not
      share with (it joins a group, moves to another, or its group gains a member); a
      group's scope is its name, so a tenant given a group name that others held before
      reads their cache too (the old members count as sharing with it).

    And ``models.<pool>.media_part_tokens`` lowered (the default pool's or a named one's):
    what each media part is charged against every tenant's uncached-token budget.

    And ``quarantine`` (every replica's claims): ``enabled`` turned off;
    ``missing_fraction``, ``min_claimed_blocks``, ``settle_s``, ``clock_skew_ms`` or
    ``tamper_margin_ms`` raised, ``recover_after``, ``recover_after_max`` or
    ``forgive_after`` lowered; ``k`` of the last ``m``, and
    ``max_unverifiable`` of the last ``unverifiable_window``: the count raised (a longer
    run of false claims passes) or the count over the window raised (the rate of them a
    replica can keep up), or the unverifiable track turned off (``max_unverifiable`` 0).

    Not counted: ``sensitive.allow_header`` (the header can only make a request's scope
    stricter), and the sections that shape performance, not isolation (routing, cost,
    index, the rest of models, health, precision). The policy has no debug or unsafe flag
    (``KVGATE_DEBUG_UNSAFE_SHARED_SCOPE`` is a process setting, never reloaded); a field
    added to the sections above must be placed here (tests/test_h25_policy_partial.py
    lists the fields it has placed)."""
    out = _tenant_weakenings("default_tenant", old.default_tenant, new.default_tenant)
    for name in sorted(old.tenants.keys() | new.tenants.keys()):
        out += _tenant_weakenings(f"tenants.{name}", old.tenant(name), new.tenant(name))
    for name in sorted(new.tenants):
        group = new.tenants[name].trust_group
        if group is None:
            continue
        # the group's scope is its name: its members now and before share it
        joined = (_members(new, group) | _members(old, group)) - _peers(old, name)
        if joined:
            out.append(
                f"tenants.{name}.trust_group: {group!r} shares its scope with "
                f"{', '.join(sorted(joined))}"
            )
    pools = [("default", old.models.default, new.models.default)] + [
        (f"pools.{name}", old.models.pool(name), new.models.pool(name))
        for name in sorted(old.models.pools.keys() | new.models.pools.keys())
    ]
    for where, was, now in pools:
        if now.media_part_tokens < was.media_part_tokens:
            out.append(
                f"models.{where}.media_part_tokens: "
                f"{was.media_part_tokens} -> {now.media_part_tokens}"
            )
    oq, nq = old.quarantine, new.quarantine
    if oq.enabled and not nq.enabled:
        out.append("quarantine.enabled: true -> false")
    for count, window in _QUARANTINE_RATES:
        was_n, was_w = getattr(oq, count), getattr(oq, window)
        now_n, now_w = getattr(nq, count), getattr(nq, window)
        if was_n and (not now_n or now_n > was_n or now_n * was_w > was_n * now_w):
            out.append(f"quarantine.{count}/{window}: {was_n}/{was_w} -> {now_n}/{now_w}")
    for field in _QUARANTINE_LOOSER_UP:
        if getattr(nq, field) > getattr(oq, field):
            out.append(f"quarantine.{field}: {getattr(oq, field)} -> {getattr(nq, field)}")
    for field in _QUARANTINE_LOOSER_DOWN:
        if getattr(nq, field) < getattr(oq, field):
            out.append(f"quarantine.{field}: {getattr(oq, field)} -> {getattr(nq, field)}")
    return out


def _members(policy: Policy, group: str) -> set[str]:
    return {t for t, tp in policy.tenants.items() if tp.trust_group == group}


def _peers(policy: Policy, tenant: str) -> set[str]:
    """The tenants whose requests share ``tenant``'s cache scope (itself included)."""
    group = policy.tenant(tenant).trust_group
    return _members(policy, group) if group is not None else {tenant}


def _model_kind(s: SensitivePolicy, model: str) -> SensitiveKind:
    listed = s.models_kind if model in s.models else "none"
    return s.default if _KIND_RANK[s.default] >= _KIND_RANK[listed] else listed


def _tenant_weakenings(where: str, old: TenantPolicy, new: TenantPolicy) -> list[str]:
    out = []
    o, n = old.sensitive, new.sensitive
    if _KIND_RANK[n.default] < _KIND_RANK[o.default]:
        out.append(f"{where}.sensitive.default: {o.default} -> {n.default}")
    for model in dict.fromkeys(o.models):
        was, now = _model_kind(o, model), _model_kind(n, model)
        if _KIND_RANK[now] < _KIND_RANK[was]:
            out.append(f"{where}.sensitive.models: {model!r} {was} -> {now}")
    out += _limit_weakenings(f"{where}.limits", old.limits, new.limits)
    was_range, now_range = _client_priorities(old.priority), _client_priorities(new.priority)
    if now_range is not None and (
        was_range is None or now_range[0] < was_range[0] or now_range[1] > was_range[1]
    ):
        out.append(f"{where}.priority: {_rule(old.priority)} -> {_rule(new.priority)}")
    return out


def _limit_weakenings(where: str, old: TenantLimits, new: TenantLimits) -> list[str]:
    out = []

    def looser(field: str, was: float | None, now: float | None) -> None:
        if was is not None and (now is None or now > was):
            out.append(f"{where}.{field}: {was} -> {'null' if now is None else now}")

    for rate, burst in (
        ("requests_per_s", "requests_burst"),
        ("uncached_tokens_per_s", "uncached_tokens_burst"),
    ):
        was_rate, now_rate = getattr(old, rate), getattr(new, rate)
        looser(rate, was_rate, now_rate)
        if was_rate is not None and now_rate is not None:  # the burst the limiter applies
            was_b, now_b = getattr(old, burst), getattr(new, burst)
            looser(burst, bucket_burst(was_rate, was_b), bucket_burst(now_rate, now_b))
    looser("max_concurrency", old.max_concurrency, new.max_concurrency)
    looser("cold_replica_count", old.cold_replica_count, new.cold_replica_count)
    return out


def _client_priorities(p: PriorityPolicy) -> tuple[float, float] | None:
    """The range of a client's own priority values the rule lets through (None: none)."""
    if p.mode == "passthrough":
        return (-math.inf, math.inf)
    if p.mode == "clamp":
        return (
            -math.inf if p.min is None else p.min,
            math.inf if p.max is None else p.max,
        )
    return None


def _rule(p: PriorityPolicy) -> str:
    if p.mode == "clamp":
        return f"clamp [{p.min}, {p.max}]"
    return f"fixed {p.value}" if p.mode == "fixed" else p.mode


@dataclass
class _Retry:
    """A file reload refused for what may heal by waiting, retried while the file keeps
    the version refused: ``delay_s`` doubles from the poll interval up to the cap."""

    version: FileVersion | None
    gist: str  # the refusal's error, compared to tell a new refusal from the same one
    delay_s: float
    at: float  # the event loop's time of the next retry


@dataclass
class _Held:
    """A file reload held back because it weakens isolation (:meth:`PolicyStore._hold`):
    the file's version, what it weakens, and the wall-clock times (Unix seconds) a look
    first found that version and it may apply (the first poll after, if it keeps still and
    passes its checks)."""

    version: FileVersion | None
    weakens: list[str]
    since: float
    applies_at: float


def _gist(error: str) -> str:
    # a tokenizer.json still being copied fails at a later line at each retry: the same
    # refusal, not a new one to log and count again
    return re.sub(r"\d+", "#", error)


class PolicyStore:
    """Holds the current :class:`Policy`. ``on_change`` runs (on the event loop) after each
    successful reload; requests already in flight keep the objects they started with."""

    def __init__(
        self,
        path: Path | None,
        policy: Policy | None = None,
        weaken_settle_s: float = WEAKEN_SETTLE_S,
    ) -> None:
        self.path = Path(path) if path is not None else None
        if policy is None:  # at start-up an invalid file is fatal
            # an empty one too, as at a reload: a file read mid-rewrite (or a template
            # that rendered empty) would otherwise serve the built-in defaults unsaid
            policy = Policy() if self.path is None else load_policy(self.path, allow_empty=False)
        self.policy = policy
        self._watch = SettledChange(self._stat())
        self.on_change: Callable[[Policy], None] | None = None
        # what the schema cannot know (the engines' block sizes): (field, problem) pairs
        # that refuse a reload, checked before it is applied
        self.check: Callable[[Policy], list[tuple[str, str]]] | None = None
        # what must be loaded before a policy can serve (its hf pools' tokenizers), awaited
        # off the event loop as a reload's last check: its (field, problem) pairs refuse it
        self.prepare: Callable[[Policy], Awaitable[list[tuple[str, str]]]] | None = None
        # one reload at a time: the watcher's and POST /admin/policy's would otherwise
        # interleave at prepare's await, and the older one could be applied last
        self._lock = asyncio.Lock()
        self.last_error: str | None = None
        self.reloads = 0
        self._task: asyncio.Task[None] | None = None
        self._interval_s = 2.0  # the watcher's poll interval: the first retry's delay
        self._retry: _Retry | None = None
        # a file reload that weakens isolation waits until the file has kept still this
        # long (isolation_weakenings; at least the poll interval)
        self.weaken_settle_s = weaken_settle_s
        self._held: _Held | None = None  # the file's version so held, if any

    def _stat(self) -> FileVersion | None:
        return file_version(self.path)

    def apply(self, policy: Policy) -> None:
        self.policy = policy
        self.reloads += 1
        self.last_error = None
        if self.on_change is not None:
            self.on_change(policy)

    def reload_file(self) -> Policy:
        """Re-read the file. Raises :class:`PolicyError` (and keeps the old policy). Only
        for a store with no ``prepare`` step (the gateway's reloads are :meth:`reload`)."""
        return self._reload_now(None, "")

    def reload_text(self, text: str, source: str = "POST /admin/policy") -> Policy:
        return self._reload_now(text, source)

    def _reload_now(self, text: str | None, source: str) -> Policy:
        if self.prepare is not None:  # skipping it would apply an hf pool that cannot load
            raise RuntimeError("this policy store prepares its reloads: await reload()")
        try:
            policy = self._read(text, source)
        except PolicyError as exc:
            self._refused(exc)
            raise
        self._apply_weakening(policy, source if text is not None else str(self.path))
        return policy

    async def reload(self, text: str | None = None, source: str = "POST /admin/policy") -> Policy:
        """Read ``text`` (None: the file), check it, await ``prepare``, apply it. Raises
        :class:`PolicyError` (and keeps the old policy)."""
        policy = await self._reload(text, source, retry=False)
        assert policy is not None  # only a retry returns None
        return policy

    async def _reload(
        self, text: str | None, source: str, *, retry: bool, settle: bool = False
    ) -> Policy | None:
        """:meth:`reload`; a ``retry`` refused again as before returns None (not logged,
        not reported: the refusal in force goes on), and so does a ``settle`` (the
        watcher's) read of a file that weakens isolation and has not kept still for
        ``weaken_settle_s`` yet (logged once: :meth:`_hold`)."""
        async with self._lock:
            outside = False  # refused for what lies outside the text: may heal by waiting
            try:
                try:
                    policy = self._parse(text, source)
                except PolicyError as exc:
                    # a tokenizer_dir's files (missing, or still empty: being copied)
                    outside = any(f.endswith(".tokenizer_dir") for f in exc.fields)
                    raise
                name = source if text is not None else str(self.path)
                if settle and self._hold(policy):
                    return None
                outside = True  # the engines' block sizes, the tokenizers' loads
                self._check(policy, name)
                if self.prepare is not None:
                    problems = await self.prepare(policy)
                    if problems:
                        raise PolicyError(name, problems)
            except PolicyError as exc:
                again = self._retry_later(exc, outside, retry) if text is None else False
                armed = self._retry if text is None else None
                self._refused(exc, again, armed.delay_s if armed is not None else None)
                if again:
                    return None
                raise
            # a policy applied (the file's or a POSTed one) supersedes a pending retry or
            # a held weakening: the file is read again once it changes
            self._retry = self._held = None
            self._apply_weakening(policy, name)
            return policy

    def _hold(self, policy: Policy) -> bool:
        """Whether to hold back the file's ``policy`` (just read): True when it weakens
        isolation (:func:`isolation_weakenings`) and the file has not kept still for
        ``weaken_settle_s`` (at least one poll) since a look first found its version: a
        writer that pauses longer than a poll leaves a part that parses, and the sections
        it lacks are the loose defaults. Logged at WARNING once per version held."""
        settle_s = max(self.weaken_settle_s, self._interval_s)
        still_s = self._watch.still_s()
        if still_s >= settle_s:
            self._held = None
            return False
        weakens = isolation_weakenings(self.policy, policy)
        if not weakens:
            return False
        version = self._watch.read
        if self._held is None or self._held.version != version:
            # wall clock, for GET /admin/policy: when the file took this version, at least
            since = time.time() - still_s
            self._held = _Held(version, weakens, since, since + settle_s)
            log.warning(
                "policy file weakens isolation: applied once it has kept still longer",
                extra={
                    "path": str(self.path),
                    "weakens": weakens,
                    "apply_in_s": round(settle_s - still_s, 3),
                },
            )
        return True

    def pending(self) -> dict[str, object] | None:
        """The file reload held back because it weakens isolation, for GET /admin/policy
        (None when none is): ``file``, ``weakens`` (one line each), ``since`` and
        ``applies_at`` (Unix seconds: when a look first found the file's version, and the
        earliest time it applies, at the next poll, if the file keeps still and passes its
        checks). A change of the file or an applied policy drops it."""
        held = self._held
        if held is None:
            return None
        return {
            "file": str(self.path),
            "weakens": list(held.weakens),
            "since": round(held.since, 3),
            "applies_at": round(held.applies_at, 3),
        }

    def _apply_weakening(self, policy: Policy, source: str) -> None:
        """:meth:`apply`, logging at WARNING what ``policy`` weakens (an operator's POST is
        applied at once, a file once it has kept still: either is worth a line)."""
        weakens = isolation_weakenings(self.policy, policy)
        if weakens:
            log.warning(
                "policy reload weakens isolation", extra={"source": source, "weakens": weakens}
            )
        self.apply(policy)

    def _retry_later(self, exc: PolicyError, outside: bool, retry: bool) -> bool:
        """Arm (or drop) the retry of a refused file reload; True when ``retry`` was
        refused as the previous look was."""
        prev, version = self._retry, self._watch.read
        if not outside or version is None:
            # the text itself is wrong (or the file is gone): only a change of the file,
            # which the watcher sees, can fix it; retrying would read the same refusal
            self._retry = None
            return False
        same_file = retry and prev is not None and prev.version == version
        cap = max(RETRY_CAP_S, self._interval_s)
        delay = min(prev.delay_s * 2, cap) if same_file and prev is not None else self._interval_s
        gist = _gist(str(exc))
        loop = asyncio.get_running_loop()
        self._retry = _Retry(version, gist, delay, loop.time() + delay)
        return same_file and prev is not None and prev.gist == gist

    def _read(self, text: str | None, source: str) -> Policy:
        """The policy in ``text`` (None: the file), checked; raises :class:`PolicyError`."""
        policy = self._parse(text, source)
        self._check(policy, source if text is not None else str(self.path))
        return policy

    def _parse(self, text: str | None, source: str) -> Policy:
        """The policy in ``text`` (None: the file), as the schema reads it."""
        if text is not None:
            return parse_policy_text(text, source, allow_empty=False)
        if self.path is None:
            raise PolicyError("<none>", [("", "the gateway was started without a policy file")])
        self._watch.reading(self._stat())
        # an empty file is one caught between its truncation and its rewrite
        return load_policy(self.path, allow_empty=False)

    def _refused(
        self, exc: PolicyError, again: bool = False, retry_in_s: float | None = None
    ) -> None:
        # logged here, for the file watcher and POST /admin/policy alike: a refused POST
        # was only the caller's 400, nothing in the log an operator audits
        self.last_error = str(exc)
        if again:  # a retry refused as before: logged once, when it first came
            log.debug("policy reload retried, still refused", extra={"error": str(exc)})
            return
        extra: dict[str, object] = {"error": str(exc)}
        if retry_in_s is not None:  # the watcher reads the file again then
            extra["retry_in_s"] = round(retry_in_s, 3)
        log.error("policy reload failed; keeping the old policy", extra=extra)

    def _check(self, policy: Policy, source: str) -> None:
        problems = self.check(policy) if self.check is not None else []
        if problems:
            raise PolicyError(source, problems)

    def changed_on_disk(self) -> bool:
        m = self._stat()
        return m is not None and m != self._watch.read

    async def poll_file(self) -> bool:
        """One look at the file: reload it (the prepared reload, :meth:`reload`) once it
        has changed and then kept still since the previous look, so a file written in parts
        (an editor's or `cat`'s save, a copy) is not read half-written: a part that parses
        would be applied (an isolation-strict file cut before its limits ran with none), one
        that does not would log an error. A file gone for a whole interval (deleted, not
        replaced) is reported once, as a reload that cannot read it: the policy in force
        stays, but a restart would fail.
        Kept still for one poll is not enough when the file weakens isolation
        (:func:`isolation_weakenings`): a writer that pauses longer than a poll (`cat` from
        a pipe, a slow mount) leaves a part that parses, whose missing sections are the
        loose defaults. Such a file is held, and applied (logged at WARNING, as at its
        hold) once it has kept still for ``weaken_settle_s``; a change drops the hold.
        A file refused for what lies outside it (an hf tokenizer not loadable yet, being
        copied or copied after the policy; the engines' block sizes) is read again while it
        keeps that version, after the poll interval, then twice as long each time up to
        :data:`RETRY_CAP_S`; a refusal of its text (YAML, the schema) waits for the file to
        change. False when nothing was read, or a retry was refused as before (reported
        once); raises :class:`PolicyError` on a refused reload."""
        now = self._stat()
        if self._watch.due(now):
            return await self._reload(None, "", retry=False, settle=True) is not None
        held = self._held
        if held is not None:
            if now != held.version:  # changed: due() reads the new version once it keeps still
                self._held = None
                return False
            if self._watch.still_s() < max(self.weaken_settle_s, self._interval_s):
                return False
            return await self._reload(None, "", retry=False, settle=True) is not None
        retry = self._retry
        if retry is None or now != retry.version or now != self._watch.read:
            return False  # changed since: due() reads it once it keeps still
        if asyncio.get_running_loop().time() < retry.at:
            return False
        return await self._reload(None, "", retry=True, settle=True) is not None

    async def watch(self, interval_s: float, on_result: Callable[[bool, str], None]) -> None:
        self._interval_s = interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                if not await self.poll_file():
                    continue
                log.info("policy reloaded", extra={"path": str(self.path)})
                on_result(True, "")
            except PolicyError as exc:  # logged by _refused
                on_result(False, str(exc))
            except Exception as exc:  # a bug of ours: logged, and the watcher lives on
                log.exception("policy reload failed; keeping the old policy")
                on_result(False, repr(exc))

    def start(self, interval_s: float, on_result: Callable[[bool, str], None]) -> None:
        if self._task is None and self.path is not None:
            self._task = asyncio.get_running_loop().create_task(self.watch(interval_s, on_result))

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
