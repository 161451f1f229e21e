"""The lifespan's clean-up after a failed start-up step (review of 60cb3b6).

When a step after ``gw.start()`` failed (``keys.start()``), the lifespan stopped the key
poller and the gateway in a ``finally``: a failure of ``keys.stop()`` or ``gw.stop()`` was
raised in place of the start-up error, so the operator read the wrong cause (and a failing
``keys.stop()`` was logged nowhere). Now the start-up error is raised, the stop's failure
logged with its traceback and noted on it (``add_note``); at a normal shutdown a failing
stop is still raised.

Real pieces and helpers from tests/test_h29_start_failure_cleanup (a redis-server of the
test's own, a raw HTTP engine on loopback, the leak check). Faults injected by fakes named
as such: key stores whose poller does not start and whose stop or close raises."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from cachecore.testing import RedisServer
from gateway.app import create_app
from gateway.core import Gateway
from gateway.serve import build_gateway
from tests.test_h29_start_failure_cleanup import (
    _PollerFails,
    assert_nothing_left,
    engine,
    settings,
    stop_at_end,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


class _StartAndCloseFail(_PollerFails):
    """A fake for fault injection: its poller does not start (the start-up error), and its
    close, one of ``Gateway.stop``'s steps, raises after it closed (the clean-up's)."""

    async def close(self) -> None:
        await super().close()
        raise RuntimeError("injected fault: the key store did not close")


class _StartAndStopFail(_PollerFails):
    """A fake for fault injection: its poller does not start, and ``keys.stop()`` raises."""

    async def stop(self) -> None:
        await super().stop()
        raise RuntimeError("injected fault: the key poller did not stop")


@pytest.mark.parametrize(
    ("keys", "step"),
    [(_StartAndCloseFail, "gateway"), (_StartAndStopFail, "api key poller")],
    ids=["gw.stop raises", "keys.stop raises"],
)
async def test_the_start_up_error_is_raised_over_a_failing_clean_up(
    redis_own: RedisServer,
    stop_at_end: list[Gateway],  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    keys: type[_PollerFails],
    step: str,
) -> None:
    caplog.set_level(logging.ERROR, logger="gateway.app")
    url = redis_own.url
    async with engine() as e:
        gs = settings(url, [e.url], tmp_path).model_copy(update={"api_keys_redis": False})
        gw = build_gateway(gs, key_store=keys(open_access=True))
        stop_at_end.append(gw)
        app = create_app(gw)
        before = asyncio.all_tasks()
        with pytest.raises(OSError, match="did not start") as exc:
            async with app.router.lifespan_context(app):
                pytest.fail("the start-up succeeded")
        # the clean-up's failure: logged with its traceback, and noted on the error
        assert any("injected fault" in n for n in getattr(exc.value, "__notes__", [])), exc.value
        logged = [r for r in caplog.records if r.getMessage() == "shutdown: a step failed"]
        assert [getattr(r, "step", None) for r in logged] == [step]
        assert logged[0].exc_info is not None
        assert "injected fault" in str(logged[0].exc_info[1])
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)


class _CloseFails(_StartAndCloseFail):
    """A fake for fault injection: it starts (no key file to poll); its close raises."""

    def start(self, *args: Any, **kw: Any) -> None:
        pass


async def test_a_failing_stop_at_a_normal_shutdown_is_still_raised(
    redis_own: RedisServer,
    stop_at_end: list[Gateway],  # noqa: F811
    tmp_path: Path,
) -> None:
    async with engine() as e:
        gs = settings(redis_own.url, [e.url], tmp_path).model_copy(update={"api_keys_redis": False})
        gw = build_gateway(gs, key_store=_CloseFails(open_access=True))
        stop_at_end.append(gw)
        app = create_app(gw)
        with pytest.raises(RuntimeError, match="did not close"):
            async with app.router.lifespan_context(app):
                pass
        assert gw.client is not None and gw.client.is_closed
