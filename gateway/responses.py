"""Sealed response ids: the Responses API's affinity without a gateway-side table (D30).

An engine stores a response (and, in its prefix cache, the conversation's KV) in its own
memory, so a follow-up naming it (``previous_response_id``) or a retrieval must reach the
replica that produced it. The gateway answers the client with a *sealed* id in place of the
engine's: the replica's id and the engine's response id, encrypted and authenticated under
a key derived from the salt secrets, bound to the tenant and, for an isolating scope (a
session's, a request's), to that scope. Every gateway of a deployment that shares the
secrets opens it; a tenant cannot forge one, redirect one to another replica, or open
another tenant's, nor one session another session's (the tag does not verify under its
own tenant and scope: the same 404 as an unknown id).

The construction is a deterministic authenticated encryption (SIV, from HMAC-SHA256
alone): ``tag = HMAC(k_mac, bound || plaintext)[:16]`` (``bound``: the tenant, and an
isolating scope's canonical name), the plaintext XORed with an
HMAC-SHA256 keystream under ``k_enc`` seeded by the tag. Each engine id is random and
used once, so determinism shows nothing. The replica's id is encrypted rather than only
signed: it is the operator's name or internal URL of a replica, which an operator that
turns ``KVGATE_EXPOSE_REPLICA`` off has chosen not to show tenants.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence

from cachecore.keys import Scope

SEALED_PREFIX = "resp_kvg1"
"""A sealed id's start (``resp_`` as every Responses id; ``kvg1`` its format)."""
_INFO = b"kvgate/response-id/v1/"
_TAG = 16
_MAX_SEALED = 1024  # longer than any id this gateway makes: refused without work
_SCOPED = 1 << 31  # set in the tenant's length field: a scope's name follows the tenant


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class ResponseIds:
    """Seals and opens response ids under the salt secrets (``KVGATE_SALT_SECRETS``):
    sealed under the primary, opened under any live one, so ids made before a rotation
    stay valid while the old secret is listed (as the salts do)."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self._keys = [(_mac(s, _INFO + b"mac"), _mac(s, _INFO + b"enc")) for s in secrets]

    def seal(self, tenant: str, scope: Scope, replica: str, engine_id: str) -> str:
        """``scope``: the request's cache scope (the salt's); only an isolating one binds."""
        rep = replica.encode()
        plain = len(rep).to_bytes(2, "big") + rep + engine_id.encode()
        k_mac, k_enc = self._keys[0]
        tag = _mac(k_mac, _bound(tenant, scope) + plain)[:_TAG]
        sealed = tag + _xor(plain, k_enc, tag)
        return SEALED_PREFIX + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()

    def open(self, tenant: str, scope: Scope, sealed: object) -> tuple[str, str] | None:
        """The (replica, engine response id) of an id this gateway sealed for ``tenant`` in
        ``scope`` (any shared scope of the tenant's for a shared one's); None for anything
        else (another tenant's or isolating scope's, tampered, not sealed, not a string)."""
        if (
            not isinstance(sealed, str)
            or not sealed.startswith(SEALED_PREFIX)
            or len(sealed) > _MAX_SEALED
        ):
            return None
        text = sealed[len(SEALED_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return None
        # one spelling per id: the decoder drops characters outside its alphabet (a quote,
        # which the answer's byte rewrite would then copy into the JSON), takes + and / and
        # ignores a last character's spare bits; anything but the encoding seal() makes is
        # another id
        if base64.urlsafe_b64encode(raw).rstrip(b"=") != text.encode():
            return None
        if len(raw) < _TAG + 2:
            return None
        tag, body = raw[:_TAG], raw[_TAG:]
        bound = _bound(tenant, scope)
        for k_mac, k_enc in self._keys:
            plain = _xor(body, k_enc, tag)
            if hmac.compare_digest(_mac(k_mac, bound + plain)[:_TAG], tag):
                n = int.from_bytes(plain[:2], "big")
                try:
                    return plain[2 : 2 + n].decode(), plain[2 + n :].decode()
                except UnicodeDecodeError:  # authentic, so never: only ours are sealed
                    return None
        return None


def _bound(tenant: str, scope: Scope) -> bytes:
    """What an id is bound to, length-prefixed so that no (tenant, scope, plaintext) reads
    as another. A shared scope (the tenant's, a trust group's) binds the tenant alone: a
    trust group shares cache, not content, and the bytes are those of the ids made before
    scopes were bound, which keep opening. An isolating one (a session's, a request's) binds
    its canonical name too, the salt's: another session of the tenant cannot open it; the
    flag in the length field keeps these inputs apart from the tenant-only ones."""
    t = tenant.encode()
    if not scope.ephemeral:
        return len(t).to_bytes(4, "big") + t
    s = scope.canonical().encode()
    return (len(t) | _SCOPED).to_bytes(4, "big") + t + len(s).to_bytes(4, "big") + s


def _xor(data: bytes, key: bytes, tag: bytes) -> bytes:
    stream = bytearray()
    counter = 0
    while len(stream) < len(data):
        stream += _mac(key, tag + counter.to_bytes(4, "big"))
        counter += 1
    return bytes(a ^ b for a, b in zip(data, stream, strict=False))
