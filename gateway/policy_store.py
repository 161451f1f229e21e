"""The live policy: load, validate, reload on file change, keep the old one on error."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from cachecore.tasks import cancel_and_wait
from gateway.filewatch import FileVersion, SettledChange, file_version
from policies.schema import Policy, PolicyError, load_policy, parse_policy_text

log = logging.getLogger(__name__)

RETRY_CAP_S = 30.0
"""The longest wait between the watcher's retries of a file reload refused for what lies
outside the policy file (an hf tokenizer still being copied, an engine's block size)."""


@dataclass
class _Retry:
    """A file reload refused for what may heal by waiting, retried while the file keeps
    the version refused: ``delay_s`` doubles from the poll interval up to the cap."""

    version: FileVersion | None
    gist: str  # the refusal's error, compared to tell a new refusal from the same one
    delay_s: float
    at: float  # the event loop's time of the next retry


def _gist(error: str) -> str:
    # a tokenizer.json still being copied fails at a later line at each retry: the same
    # refusal, not a new one to log and count again
    return re.sub(r"\d+", "#", error)


class PolicyStore:
    """Holds the current :class:`Policy`. ``on_change`` runs (on the event loop) after each
    successful reload; requests already in flight keep the objects they started with."""

    def __init__(self, path: Path | None, policy: Policy | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if policy is None:  # at start-up an invalid file is fatal
            policy = Policy() if self.path is None else load_policy(self.path)
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
        self.apply(policy)
        return policy

    async def reload(self, text: str | None = None, source: str = "POST /admin/policy") -> Policy:
        """Read ``text`` (None: the file), check it, await ``prepare``, apply it. Raises
        :class:`PolicyError` (and keeps the old policy)."""
        policy = await self._reload(text, source, retry=False)
        assert policy is not None  # only a retry returns None
        return policy

    async def _reload(self, text: str | None, source: str, *, retry: bool) -> Policy | None:
        """:meth:`reload`; a ``retry`` refused again as before returns None (not logged,
        not reported: the refusal in force goes on)."""
        async with self._lock:
            outside = False  # refused for what lies outside the text: may heal by waiting
            try:
                try:
                    policy = self._parse(text, source)
                except PolicyError as exc:
                    # a tokenizer_dir's files (missing, or still empty: being copied)
                    outside = any(f.endswith(".tokenizer_dir") for f in exc.fields)
                    raise
                outside = True  # the engines' block sizes, the tokenizers' loads
                name = source if text is not None else str(self.path)
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
            self._retry = None  # a policy applied (the file's or a POSTed one) supersedes it
            self.apply(policy)
            return policy

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
        A file refused for what lies outside it (an hf tokenizer not loadable yet, being
        copied or copied after the policy; the engines' block sizes) is read again while it
        keeps that version, after the poll interval, then twice as long each time up to
        :data:`RETRY_CAP_S`; a refusal of its text (YAML, the schema) waits for the file to
        change. False when nothing was read, or a retry was refused as before (reported
        once); raises :class:`PolicyError` on a refused reload."""
        now = self._stat()
        if self._watch.due(now):
            await self.reload()
            return True
        retry = self._retry
        if retry is None or now != retry.version or now != self._watch.read:
            return False  # changed since: due() reads it once it keeps still
        if asyncio.get_running_loop().time() < retry.at:
            return False
        return await self._reload(None, "", retry=True) is not None

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
