"""A refused listen gives the advice that fits its cause: `kvgate serve --host` with a name
that does not resolve, or an address this host does not have, said "pick another --port",
sending the operator after the wrong flag (found by the twenty-sixth session's F8)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachecore.listen import ListenError, bind_listeners, listen_advice


@pytest.mark.parametrize(
    ("host", "reason_start"),
    [
        ("no-such-host.invalid", "kvgate serve: cannot listen on no-such-host.invalid:0 ("),
        # TEST-NET-1 (RFC 5737): an address no host here has (EADDRNOTAVAIL)
        ("192.0.2.1", "kvgate serve: cannot listen on 192.0.2.1:0 (Cannot assign requested"),
    ],
)
def test_serve_blames_the_host_for_a_host_it_cannot_listen_on(host: str, reason_start: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--open", "--host", host, "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(reason_start), line
    assert line.endswith("; --host (KVGATE_HOST) takes an address or a name of this host"), line


def test_the_advice_follows_the_cause() -> None:
    advice = {"port": "P", "host": "H"}
    with pytest.raises(ListenError) as unresolved:
        bind_listeners("no-such-host.invalid", 0)
    assert listen_advice(unresolved.value, **advice) == "H"
    with pytest.raises(ListenError) as missing:
        bind_listeners("192.0.2.1", 0)
    assert listen_advice(missing.value, **advice) == "H"
    held = bind_listeners("127.0.0.1", 0)
    try:
        port = held[0].getsockname()[1]
        with pytest.raises(ListenError) as busy:
            bind_listeners("127.0.0.1", port)
        assert listen_advice(busy.value, **advice) == "P"
    finally:
        for sock in held:
            sock.close()
    assert listen_advice(ListenError("no address to listen on"), **advice) == ""
