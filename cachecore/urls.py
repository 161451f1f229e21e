"""User info (``user[:password]@``) in URLs, found one way for every component.

kvgate refuses credentials in every URL it is given: the replica registry (a registration's
URL), the gateway's ``--replica`` specs and the agent's ``--engine-url``. Each once parsed the
authority on its own and they disagreed at the edges (an ``@`` in a password, an ``@`` after
a ``?``). The one reading here is RFC 3986's, as ``urllib.parse.urlsplit`` and browsers take
it: the authority runs from ``//`` to the first ``/``, ``?`` or ``#``; its user info is
everything before its LAST ``@`` (an unencoded ``@`` in a password belongs to the password).
Errors built from it name the host and never the secret.

A host put into a URL is written one way too (:func:`url_host`): an IPv6 literal in brackets,
its zone id as the URL's reader needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote


@dataclass(frozen=True, slots=True)
class UserInfo:
    """The user info of a URL, percent-decoded, and what is safe to show of the URL."""

    user: str  # may be empty (``http://:pw@host``)
    password: str | None  # None without a ':' (``http://user@host``)
    host: str  # the rest of the authority: ``host[:port]``, ``[v6]:port``, maybe empty
    redacted: str  # the URL with the user info replaced by ``***``


def _authority_span(url: str) -> tuple[int, int]:
    """Where the authority of ``url`` starts and ends. Without ``scheme://`` (or a leading
    ``//``) the text is read as an authority from its start: ``user:pw@host:80`` typed
    without a scheme still holds a password that no error may quote."""
    sep = url.find("://")
    if sep >= 0:
        start = sep + 3
    elif url.startswith("//"):
        start = 2
    else:
        start = 0
    end = min((i for i in (url.find(c, start) for c in "/?#") if i >= 0), default=len(url))
    return start, end


def split_user_info(url: str) -> UserInfo | None:
    """The user info of ``url``, or None when its authority carries none.

    >>> split_user_info("http://u%40x:p@ss@[::1]:80/v1").password
    'p@ss'
    """
    start, end = _authority_span(url)
    user_info, at, host = url[start:end].rpartition("@")
    if not at:
        return None
    user, colon, password = user_info.partition(":")
    return UserInfo(
        user=unquote(user),
        password=unquote(password) if colon else None,
        host=host,
        redacted=f"{url[:start]}***@{host}{url[end:]}",
    )


ZoneForm = Literal["encoded", "bare", "dropped"]


def url_host(host: str, zone: ZoneForm = "encoded") -> str:
    """``host`` (a name, an IPv4 or IPv6 address, bracketed or not) as the host of a URL:
    an IPv6 literal in brackets (``http://::1:9100`` is no URL). An IPv6 zone id
    (``fe80::1%eth0``, link-local) is written as ``zone`` says:

    * ``encoded``: RFC 6874's URI form, ``[fe80::1%25eth0]`` (URLs shown to people, for
      curl and the like);
    * ``bare``: ``[fe80::1%eth0]``, the only form httpx 0.29 connects to (it hands the host
      to getaddrinfo undecoded, which refuses ``%25eth0``): URLs kvgate itself fetches;
    * ``dropped``: ``[fe80::1]``, for a Host header (RFC 6874 section 4: the zone id means
      nothing beyond the sender).

    One reading of a zone id, whoever wrote it. An unbracketed ``host`` is a socket API's:
    its ``%`` is the delimiter (``fe80::1%25`` is scope 25). A bracketed ``host`` is a
    URL's, where ``%25`` is always RFC 6874's encoded delimiter (``[fe80::1%25eth0]``: zone
    ``eth0``) and a bare ``%`` (section 4's convenience) is taken only before a zone that
    does not begin with ``25``: ``[fe80::1%25x]`` is zone ``x``, never a bare ``25x``. So
    ``url_host(url_host(h)) == url_host(h)``. For the same reason the ``bare`` form of a
    zone id that begins with ``25`` is refused (ValueError): ``[fe80::1%2599]`` would be read
    back, by kvgate's own :func:`~cachecore.registry.normalize_url` as by any URL reader,
    as zone ``99`` (and ``[fe80::1%25]`` as none); name the interface instead of its number.
    An empty zone id is refused too (``fe80::1%``, ``[fe80::1%25]``), unless dropped.

    >>> url_host("fe80::1%eth0"), url_host("[::1]"), url_host("10.0.0.1")
    ('[fe80::1%25eth0]', '[::1]', '10.0.0.1')
    """
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if ":" not in host:
        return host
    address, pct, zone_id = host.partition("%")
    if bracketed and zone_id.startswith("25"):
        zone_id = zone_id[2:]
    if not pct or zone == "dropped":
        return f"[{address}]"
    if not zone_id:
        raise ValueError(f"IPv6 address {host!r} has an empty zone id")
    if zone == "bare" and zone_id.startswith("25"):
        raise ValueError(
            f"IPv6 zone id {zone_id!r} cannot be written bare in a URL: its '%25' reads as "
            "RFC 6874's encoded '%'; give the interface's name instead of its number"
        )
    return f"[{address}%{'25' if zone == 'encoded' else ''}{zone_id}]"


__all__ = ["UserInfo", "ZoneForm", "split_user_info", "url_host"]
