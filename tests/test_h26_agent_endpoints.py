"""Review R2's O12: the engine's bind address (``tcp://*:PORT``, shown beside the agent's
flags in README and the runbook) given to an agent that connects. It passed the endpoint
check, and the agent then looped on a ZMQError traceback for ever, never ready, standalone
and embedded in ``kvgate serve``. Now it is a one-line refusal saying what to write.

Review R3's V2: 0.0.0.0 was refused with it, though a ZMQ connect to tcp://0.0.0.0:PORT
reaches this host (an agent beside its engine used it): it passes. V5: ``::`` stays refused,
since the agent's sockets (zmq.IPV6 off) reach nothing there."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import zmq

from cachecore.agent.settings import check_zmq_endpoint
from gateway.replicas import ReplicaSpecError, parse_replica_spec


def _kvgate(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvgate ARGV`` with no KVGATE_* from the test's environment; unfixed, both commands
    start and run on (the agent retrying, the gateway serving), so a timeout bounds them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    try:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            env=env, capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvgate {' '.join(argv)} started instead of refusing")


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://[::]:5557", "tcp://:::5557"])
def test_a_bind_address_is_refused_with_what_to_write(endpoint: str) -> None:
    with pytest.raises(ValueError) as exc:
        check_zmq_endpoint(endpoint)
    said = str(exc.value)
    assert "bind address" in said and "give the engine's host" in said, said
    assert "tcp://10.0.0.5:5557" in said, said


def _received(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, pub: zmq.Socket[bytes], within_s: float
) -> bool:
    """Whether a SUB set up as the agent's (zmq.IPV6 off) connected to ``endpoint`` gets
    what ``pub`` sends, within about ``within_s``."""
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        deadline = time.monotonic() + within_s
        # a SUB misses what is sent before its handshake: resend
        for _ in range(int(within_s * 10) + 1):
            pub.send(b"hello")
            if sub.poll(100):
                return sub.recv() == b"hello"
            if time.monotonic() > deadline:
                break
        return False
    finally:
        sub.close()


def test_what_the_rule_rests_on_checked_on_loopback() -> None:
    """ZMQ cannot connect to "*", and "::" reaches nothing with the agent's sockets, while
    tcp://0.0.0.0:PORT reaches this host (an agent beside its engine: not refused)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.IPV6, 1)  # listens on IPv4 and IPv6
        port = pub.bind_to_random_port("tcp://*")
        with ctx.socket(zmq.SUB) as sub, pytest.raises(zmq.ZMQError):
            sub.connect(f"tcp://*:{port}")
        # what reaches is given 10 s (a busy host's handshake; it returns as it arrives);
        # what reaches nothing is watched 1.5 s, as before (a slow host cannot fail that)
        assert _received(ctx, f"tcp://0.0.0.0:{port}", pub, within_s=10.0)
        assert not _received(ctx, f"tcp://[::]:{port}", pub, within_s=1.5)
    finally:
        pub.close()
        ctx.term()


def test_0_0_0_0_passes_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = "tcp://0.0.0.0:5557"
    with caplog.at_level(logging.DEBUG):
        assert check_zmq_endpoint(endpoint) == endpoint
        spec = parse_replica_spec(f"r0=http://127.0.0.1:9={endpoint},tcp://0.0.0.0:5558")
    assert (spec.events, spec.replay) == (endpoint, "tcp://0.0.0.0:5558")
    # it was a WARNING per parse (8 lines for one kvgate serve --replica), saying it reached
    # this host of "::" too, which reaches nothing
    assert caplog.records == []


def test_connectable_endpoints_still_pass() -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://engine-0:5557"):
        assert check_zmq_endpoint(endpoint) == endpoint


def test_the_standalone_agent_refuses_it_in_one_line() -> None:
    done = _kvgate(
        "agent", "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
        "--events", "tcp://*:30101", "--replay", "tcp://*:31101",
        "--redis", "redis://127.0.0.1:9/0", "--http-port", "0", "--no-register",
        "--gc-freeze-interval", "0",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "events (--events, KVGATE_AGENT_EVENTS): 'tcp://*:30101' is a bind address" in (
        done.stderr
    ), done.stderr
    assert "tcp://10.0.0.5:30101" in done.stderr, done.stderr


def test_an_embedded_agent_refuses_it_at_the_gateways_start() -> None:
    spec = "r0=http://127.0.0.1:9=tcp://*:30101,tcp://*:31101"
    with pytest.raises(ReplicaSpecError) as exc:
        parse_replica_spec(spec)
    assert "agent endpoint: 'tcp://*:30101' is a bind address" in str(exc.value)
    done = _kvgate("serve", "--open", "--port", "0", "--replica", spec)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "'tcp://*:30101' is a bind address" in done.stderr, done.stderr[-2000:]
