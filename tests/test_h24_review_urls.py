"""``normalize_url`` (every registration URL, allowlist entry and replica URL compared
through it) writes an IPv6 host with ``url_host``: the zone id keeps its case (Linux
interface names are case-sensitive) and RFC 6874's ``%25`` form, which the agent prints,
reads as the bare ``%`` form httpx connects to. It lower-cased the zone id and kept ``%25``,
so an operator pasting the agent's printed URL into the allowlist matched nothing."""

from __future__ import annotations

import pytest

from cachecore.registry import ReplicaAllowlist, normalize_url
from cachecore.urls import url_host
from tests.test_registry import reg


@pytest.mark.parametrize(
    ("url", "norm"),
    [
        # the zone id as written, the address lower-cased
        ("http://[FE80::1%enP1s0]:8000", "http://[fe80::1%enP1s0]:8000"),
        # RFC 6874's encoded form: the bare one
        ("http://[fe80::1%25enP1s0]:8000/", "http://[fe80::1%enP1s0]:8000"),
        ("https://[FE80::A%25Eth0]/v1", "https://[fe80::a%Eth0]:443/v1"),
        # no zone, IPv4, names: as before
        ("http://[2001:DB8::A]:9000/", "http://[2001:db8::a]:9000"),
        ("http://[::1]", "http://[::1]:80"),
        ("HTTP://10.0.0.1", "http://10.0.0.1:80"),
        ("http://Host.Example:8000/v1/", "http://host.example:8000/v1"),
    ],
)
def test_normalize_url_keeps_the_zone_id_and_writes_it_bare(url: str, norm: str) -> None:
    assert normalize_url(url) == norm
    assert normalize_url(norm) == norm  # a fixed point


def test_the_zone_form_is_the_one_url_host_gives_for_fetching() -> None:
    """One writing of an IPv6 host: normalize_url's is url_host's ``bare`` (what kvgate
    fetches with httpx), whichever form the URL came in."""
    host = "fe80::1%enP1s0"
    for written in (url_host(host), url_host(host, zone="bare")):
        assert normalize_url(f"http://{written}:8000") == f"http://{url_host(host, 'bare')}:8000"


def test_the_allowlist_matches_the_agents_printed_url_and_the_zone_case() -> None:
    """The agent prints ``http://[fe80::1%25enP1s0]:8000``; its registration may carry
    either form. An interface of another case is another interface."""
    allow = ReplicaAllowlist(["http://[fe80::1%25enP1s0]:8000"])
    assert allow.allows(reg("a", url="http://[fe80::1%enP1s0]:8000")) is None
    assert allow.allows(reg("a", url="http://[FE80::1%25enP1s0]:8000/")) is None
    assert allow.allows(reg("a", url="http://[fe80::1%enp1s0]:8000")) == "not_allowlisted"
