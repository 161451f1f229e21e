"""The live policy: load, validate, reload on file change, keep the old one on error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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
        """Re-read the file. Raises :class:`PolicyError` (and keeps the old policy)."""
        if self.path is None:
            raise PolicyError("<none>", [("", "the gateway was started without a policy file")])
        self._watch.reading(self._stat())
        try:
            # an empty file is one caught between its truncation and its rewrite
            policy = load_policy(self.path, allow_empty=False)
            self._check(policy, str(self.path))
        except PolicyError as exc:
            self._refused(exc)
            raise
        self.apply(policy)
        return policy

    def reload_text(self, text: str, source: str = "POST /admin/policy") -> Policy:
        try:
            policy = parse_policy_text(text, source, allow_empty=False)
            self._check(policy, source)
        except PolicyError as exc:
            self._refused(exc)
            raise
        self.apply(policy)
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

    def poll_file(self) -> bool:
        """One look at the file: reload it once it has changed and then kept still since the
        previous look, so a file written in parts (an editor's or `cat`'s save, a copy) is
        not read half-written: a part that parses would be applied (an isolation-strict
        file cut before its limits ran with none), one that does not would log an error.
        A file gone for a whole interval (deleted, not replaced) is reported once, as a
        reload that cannot read it: the policy in force stays, but a restart would fail.
        False when nothing was read; raises :class:`PolicyError` on a refused reload."""
        if not self._watch.due(self._stat()):
            return False
        self.reload_file()
        return True

    async def watch(self, interval_s: float, on_result: Callable[[bool, str], None]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if not self.poll_file():
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
