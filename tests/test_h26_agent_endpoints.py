"""Review R2's O12: the engine's bind address (``tcp://*:PORT``, shown beside the agent's
flags in README and the runbook) given to an agent that connects. It passed the endpoint
check, and the agent then looped on a ZMQError traceback for ever, never ready, standalone
and embedded in ``kvgate serve``. Now it is a one-line refusal saying what to write.

Review R3's V2: the every-interface addresses were refused with it, though a ZMQ connect to
tcp://0.0.0.0:PORT reaches this host (an agent beside its engine used it): only ``*``, which
ZMQ cannot connect to, is refused; the others pass with a WARNING."""

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


def test_a_bind_address_is_refused_with_what_to_write() -> None:
    with pytest.raises(ValueError) as exc:
        check_zmq_endpoint("tcp://*:5557")
    said = str(exc.value)
    assert "bind address" in said and "give the engine's host" in said, said
    assert "tcp://10.0.0.5:5557" in said, said


def test_zmq_cannot_connect_to_the_refused_host_but_reaches_this_host_at_0_0_0_0() -> None:
    """What the rule rests on, checked against this pyzmq on loopback."""
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(zmq.ZMQError):
            sub.connect(f"tcp://*:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://0.0.0.0:{port}")
        deadline, got = time.monotonic() + 10.0, None
        for _ in range(100):  # a SUB misses what is sent before its handshake: resend
            pub.send(b"hello")
            if sub.poll(100):
                got = sub.recv()
                break
            if time.monotonic() > deadline:
                break
        assert got == b"hello"
    finally:
        pub.close()
        sub.close()
        ctx.term()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://:::5557"])
def test_an_every_interface_address_passes_with_a_warning(
    endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="cachecore.agent.settings"):
        assert check_zmq_endpoint(endpoint) == endpoint
    assert any(
        "connects to this host only" in r.getMessage() and r.__dict__["endpoint"] == endpoint
        for r in caplog.records
    ), caplog.records
    spec = parse_replica_spec(f"r0=http://127.0.0.1:9={endpoint},tcp://0.0.0.0:5558")
    assert (spec.events, spec.replay) == (endpoint, "tcp://0.0.0.0:5558")


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
