"""The live policy: load, validate, reload on file change, keep the old one on error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from cachecore.tasks import cancel_and_wait
from gateway.filewatch import FileVersion, SettledChange, file_version
from policies.schema import Policy, PolicyError, load_policy, parse_policy_text

log = logging.getLogger(__name__)


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
        async with self._lock:
            try:
                policy = self._read(text, source)
                if self.prepare is not None:
                    problems = await self.prepare(policy)
                    if problems:
                        raise PolicyError(source if text is not None else str(self.path), problems)
            except PolicyError as exc:
                self._refused(exc)
                raise
            self.apply(policy)
            return policy

    def _read(self, text: str | None, source: str) -> Policy:
        """The policy in ``text`` (None: the file), checked; raises :class:`PolicyError`."""
        if text is not None:
            policy = parse_policy_text(text, source, allow_empty=False)
            self._check(policy, source)
            return policy
        if self.path is None:
            raise PolicyError("<none>", [("", "the gateway was started without a policy file")])
        self._watch.reading(self._stat())
        # an empty file is one caught between its truncation and its rewrite
        policy = load_policy(self.path, allow_empty=False)
        self._check(policy, str(self.path))
        return policy

    def _refused(self, exc: PolicyError) -> None:
        # logged here, for the file watcher and POST /admin/policy alike: a refused POST
        # was only the caller's 400, nothing in the log an operator audits
        self.last_error = str(exc)
        log.error("policy reload failed; keeping the old policy", extra={"error": str(exc)})

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
        stays, but a restart would fail. False when nothing was read; raises
        :class:`PolicyError` on a refused reload."""
        if not self._watch.due(self._stat()):
            return False
        await self.reload()
        return True

    async def watch(self, interval_s: float, on_result: Callable[[bool, str], None]) -> None:
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
