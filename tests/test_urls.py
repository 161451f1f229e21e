"""One reading of user info (``user[:password]@``) in URLs, ``cachecore.urls``, for its
three users: the replica registry (``normalize_url``), the gateway's ``--replica`` specs
and the agent's ``--engine-url``. Each parsed the authority on its own: the spec quoted
part of a password that held an ``@`` as the host, and the registry quoted one whole in
a ``//host`` URL's scheme error."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachecore.agent.settings import AgentSettings
from cachecore.registry import InvalidURLError, normalize_url
from cachecore.urls import UserInfo, split_user_info
from gateway.replicas import ReplicaSpecError, parse_replica_spec


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("http://u:pw@h:80/x", UserInfo("u", "pw", "h:80", "http://***@h:80/x")),
        # percent-encoded: decoded, and an encoded '@' or ':' splits nothing
        ("http://u%40x:p%3Aw%40@h", UserInfo("u@x", "p:w@", "h", "http://***@h")),
        # an unencoded '@' in the password: the host is after the LAST '@' (urlsplit's)
        ("http://u:p@ss@h:1?q", UserInfo("u", "p@ss", "h:1", "http://***@h:1?q")),
        ("http://:pw@h", UserInfo("", "pw", "h", "http://***@h")),  # empty user
        ("http://@h", UserInfo("", None, "h", "http://***@h")),  # empty user info
        ("http://u@h", UserInfo("u", None, "h", "http://***@h")),  # no password
        ("http://u:@h", UserInfo("u", "", "h", "http://***@h")),  # empty password
        ("http://u:p=w@h", UserInfo("u", "p=w", "h", "http://***@h")),
        ("http://u:pw@[::1]:9100/", UserInfo("u", "pw", "[::1]:9100", "http://***@[::1]:9100/")),
        ("http://u:pw@[fe80::1%25eth0]", UserInfo("u", "pw", "[fe80::1%25eth0]", "http://***@[fe80::1%25eth0]")),
        ("http://u:pw@", UserInfo("u", "pw", "", "http://***@")),  # no host
        ("//u:pw@h:1", UserInfo("u", "pw", "h:1", "//***@h:1")),  # scheme-relative
        ("u:pw@h:1", UserInfo("u", "pw", "h:1", "***@h:1")),  # no scheme, as typed
    ],
)  # fmt: skip
def test_user_info_is_found_decoded_and_redacted(url: str, want: UserInfo) -> None:
    assert split_user_info(url) == want


@pytest.mark.parametrize(
    "url",
    [
        "http://h:1",
        "http://[::1]:9100",
        "http://[fe80::1%25eth0]:1/v",
        "http://h:1/p@x",  # an '@' in the path, query or fragment is no user info
        "http://h:1?a@b",
        "http://h:1#a@b",
        "http://h:1/a?b@c#d@e",
        "http://u%40h:1",  # an encoded '@' is part of the host text
        "h:1",
        "",
    ],
)
def test_no_user_info(url: str) -> None:
    assert split_user_info(url) is None


def _agent(url: str) -> str:
    return AgentSettings(replica_id="r", engine_url=url, events="tcp://h:1").engine_url


_REFUSED = [
    "http://u:s3cret@h:1",
    "http://u:s3c@ret@h:1",
    "http://u%40x:s3cret@h:1",
    "http://:s3cret@h:1",
    "http://@h:1",
    "http://s3cret@h:1",
    "http://u:s3cret@[::1]:1",
    "https://u:s3c=ret@h",
    "http://u:s3cret@h:99999",  # a bad port too: refused for the user info first
]


@pytest.mark.parametrize("url", _REFUSED)
def test_every_user_refuses_user_info_without_echoing_it(url: str) -> None:
    with pytest.raises(InvalidURLError) as reg:
        normalize_url(url)
    assert "user info" in str(reg.value) and "s3c" not in str(reg.value)
    with pytest.raises(ReplicaSpecError) as spec:
        parse_replica_spec(f"r0={url}")
    assert "must not carry credentials" in str(spec.value)
    assert "s3c" not in str(spec.value) and "ret@" not in str(spec.value), spec.value
    with pytest.raises(ValidationError) as agent:
        _agent(url)
    assert "user info" in str(agent.value)


def test_a_spec_names_the_host_after_the_last_at() -> None:
    """The spec's own pattern stopped at the first '@' and named the rest 'the host':
    `http://u:s3c@ret@h:1` was refused 'for ret@h:1', part of the password."""
    with pytest.raises(ReplicaSpecError, match="replica URL for h:1 must not"):
        parse_replica_spec("http://u:s3c@ret@h:1")


@pytest.mark.parametrize("spec", ["//u:s3cret@h:1", "u:s3cret@h:1", "r0=u:s3c=ret@h:1"])
def test_a_schemeless_spec_with_user_info_is_refused_without_echo(spec: str) -> None:
    """These were refused by the scheme check, which quoted the URL, password and all."""
    with pytest.raises(ReplicaSpecError) as err:
        parse_replica_spec(spec)
    assert "s3c" not in str(err.value) and "must not carry credentials" in str(err.value)


def test_the_registry_refuses_a_scheme_relative_url_without_echo() -> None:
    with pytest.raises(InvalidURLError) as err:
        normalize_url("//u:s3cret@h:1")
    assert "s3cret" not in str(err.value) and "user info" in str(err.value)


@pytest.mark.parametrize(
    "url",
    ["http://h:1", "http://h:1/p@x", "http://[::1]:1", "https://h", "http://[fe80::1%25eth0]:1"],
)
def test_urls_without_user_info_are_still_taken(url: str) -> None:
    normalize_url(url)
    assert _agent(url) == url
    assert parse_replica_spec(f"r0={url}").url == url


@pytest.mark.parametrize("url", ["http://h:1?a@b", "http://h:1#a@b", "http://h:1/?x"])
def test_the_agent_refuses_a_query_or_fragment_as_a_registration_does(url: str) -> None:
    """An '@' after '?' or '#' is no user info. The agent's own parser read it as some
    (its authority ran to the first '/') and refused it; it is still refused, for what it
    is: the Registration the agent heartbeats refuses a query or fragment, so such an agent
    never registered."""
    with pytest.raises(InvalidURLError):
        normalize_url(url)
    with pytest.raises(ValidationError, match="query or fragment"):
        _agent(url)
