"""A force-quit of ``kvgate serve`` (a Ctrl-C once the stop is under way) still runs the
gateway's stop.

uvicorn's ``Server.shutdown`` (0.55) skips the lifespan shutdown when ``force_exit`` is set,
which its ``handle_exit`` does on a SIGINT after the first signal: with a request in flight
(the gateway waiting for it), SIGTERM then Ctrl-C exited by the re-raised SIGTERM with no
stop at all (the in-flight request's trace record and the buffered ones lost, this gateway's
in-flight counts left in Redis for other gateways to route around, the stream cut without
its error event); Ctrl-C twice ran the stop only by accident, as asyncio.run's teardown
cancelled the lifespan task, every task cancelled at once and an ERROR traceback logged, no
"Application shutdown complete.". Now a force-quit cuts the in-flight requests (as the
drain timeout does) and the lifespan shutdown runs, every step; a Ctrl-C after that exits
at once, a SIGTERM never.

Real pieces: ``kvgate serve`` as a subprocess (JSON logs to a file) with an embedded agent
following a simulated replica (``kvgate replica``), a redis-server of the test's own (the
index, the load store: its in-flight hash shows the counts a stop drops), a request trace
file, real signals. The in-process test drives ``_DrainingServer.handle_exit`` directly,
with ``os._exit`` replaced by a fake that raises."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from cachecore.replica.fleet import launch_fleet
from cachecore.testing import RedisServer, free_port
from gateway import serve
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

GATEWAY_ID = "gw-forced"
WAITING = "Waiting for connections to close. (CTRL+C to force quit)"


@contextlib.contextmanager
def gateway_process(
    args: list[str], log_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``kvgate serve ARGS`` on a free port, its output to ``log_path``, once /health
    answers (bounded); killed in the end if still running."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", *args, "--port", str(port)]
    env = {
        **os.environ,
        "KVGATE_SALT_SECRETS": SECRET,
        "KVGATE_DRAIN_GRACE_S": "0.5",
        "KVGATE_DRAIN_TIMEOUT_S": "30",
    }
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30.0
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the gateway did not become healthy"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def log_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def wait_for_log(path: Path, message: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("message") == message for r in log_records(path)):
            return True
        time.sleep(0.05)
    return False


def gateway_counts(url: str) -> dict[str, str]:
    """This gateway's fields in the replicas' in-flight hashes (the load store)."""
    out: dict[str, str] = {}
    with redis.Redis.from_url(url, decode_responses=True) as r:
        for key in r.scan_iter("*inflight*"):
            for name, value in r.hgetall(key).items():
                if name.startswith(GATEWAY_ID + ":"):
                    out[f"{key} {name}"] = value
    return out


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)],
    ids=["ctrl-c-twice", "sigterm-then-ctrl-c"],
)
def test_a_force_quit_cuts_the_stream_and_still_runs_the_stop(
    first: signal.Signals, second: signal.Signals, tmp_path: Path, redis_own: RedisServer
) -> None:
    trace, log_path = tmp_path / "requests.jsonl", tmp_path / "gateway.log"
    with launch_fleet(1, ["--time-scale", "1"]) as fleet:
        ep = fleet.endpoints[0]
        spec = f"r0={ep.url}={ep.events_endpoint},{ep.replay_endpoint}"  # an embedded agent
        args = ["--open", "--replica", spec, "--redis", redis_own.url, "--trace-out", str(trace),
                "--gateway-id", GATEWAY_ID]  # fmt: skip
        with (
            gateway_process(args, log_path) as (proc, url),
            httpx.Client(base_url=url, timeout=20) as client,
        ):
            body = {"model": ep.model, "prompt": "hello there", "max_tokens": 2}
            for _ in range(2):  # records the trace buffers for up to a second
                assert client.post("/v1/completions", json=body).status_code == 200
            deadline = time.monotonic() + 10.0
            while not gateway_counts(redis_own.url) and time.monotonic() < deadline:
                time.sleep(0.05)  # the load refresher's first heartbeat
            assert gateway_counts(redis_own.url), "no in-flight counts written"
            got, error, t_forced = b"", "", 0.0
            stream = {**body, "max_tokens": 4000, "stream": True}  # ~a minute at time scale 1
            try:
                with client.stream("POST", "/v1/completions", json=stream) as resp:
                    assert resp.status_code == 200
                    for chunk in resp.iter_bytes():
                        if not got:
                            proc.send_signal(first)
                            # past the grace: the listener closed, the stream waited for
                            assert wait_for_log(log_path, WAITING), log_path.read_text()
                            t_forced = time.monotonic()
                            proc.send_signal(second)  # uvicorn's force-quit
                        got += chunk
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            rc = proc.wait(timeout=30)
            took_s = time.monotonic() - t_forced
    events = [e for e in got.split(b"\n\n") if e.strip()]
    records = log_records(log_path)
    messages = [r.get("message") for r in records]
    observed = {
        # the stream cut as the drain timeout cuts one: an error event, then [DONE]
        "stream error": error,
        "stream end": events[-1:],
        "stream cut as draining": len(events) > 1 and b'"code":"draining"' in events[-2],
        # every record, the cut request's (a 503) and those still buffered, written out
        "trace statuses": [json.loads(line)["status"] for line in trace.read_text().splitlines()],
        # the load refresher's step dropped this gateway's counts
        "counts left": gateway_counts(redis_own.url),
        "lifespan shutdown ran": "Application shutdown complete." in messages,
        "errors logged": [str(r.get("message"))[:200] for r in records if r["level"] == "ERROR"],
        "cut logged": [
            r.get("requests") for r in records if str(r.get("message")).startswith("forced to quit")
        ],
    }
    assert observed == {
        "stream error": "",
        "stream end": [b"data: [DONE]"],
        "stream cut as draining": True,
        "trace statuses": [200, 200, 503],
        "counts left": {},
        "lifespan shutdown ran": True,
        "errors logged": [],
        "cut logged": [1],
    }, log_path.read_text()[-3000:]
    # uvicorn re-raises the signals it caught once it has stopped: SIGTERM ends the process
    # by its default action, the Ctrl-C is kvgate's "interrupted"
    assert rc == (130 if first == signal.SIGINT else -signal.SIGTERM)
    assert took_s < 10.0  # not the drain timeout (30 s): the force-quit skipped the wait


class Exited(Exception):
    """Raised by the fake ``os._exit``: the process would have ended here."""


async def test_a_ctrl_c_after_the_force_quit_exits_at_once_a_sigterm_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stop a force-quit runs is bounded, but by up to a minute with embedded agents: a
    further Ctrl-C exits at once, for an operator at a terminal; a SIGTERM (what a
    supervisor sends, again) never cuts the stop short."""
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    settings = GatewaySettings(
        replicas=["r0=http://127.0.0.1:9"],
        open_access=True,
        salt_secrets=[SecretStr(SECRET)],
        port=free_port(),
    )
    gw = serve.build_gateway(settings)
    server = serve._DrainingServer(serve.uvicorn_config(gw, loop="none"), gw)
    server._loop = asyncio.get_running_loop()
    in_flight = asyncio.ensure_future(asyncio.sleep(60))  # stands for a request's task
    server.server_state.tasks.add(in_flight)
    try:
        server.handle_exit(signal.SIGTERM, None)  # the first: the stop is under way
        server.handle_exit(signal.SIGTERM, None)  # again: nothing more
        assert (server.should_exit, server.force_exit, exits) == (True, False, [])
        server.handle_exit(signal.SIGINT, None)  # the force-quit: no exit, the cut
        assert (server.force_exit, exits) == (True, [])
        for _ in range(10):  # scheduled thread-safely from the handler: a turn or two
            await asyncio.sleep(0)
            if in_flight.done():
                break
        assert in_flight.cancelled()
        server.handle_exit(signal.SIGTERM, None)  # never cuts the stop short
        assert exits == []
        with pytest.raises(Exited):
            server.handle_exit(signal.SIGINT, None)
        assert exits == [128 + signal.SIGINT]
    finally:
        in_flight.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await in_flight
        await gw.stop()
