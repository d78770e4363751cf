"""HMAC-SHA256 challenge-response over a shared secret: the connecting side proves it knows the secret.

    acceptor:   nonce = 32 random bytes ─────▶
    connector:  mac = HMAC(secret, context + nonce) ─────▶ acceptor checks it in constant time

`context` separates the uses of one secret (the data plane, the KV transfer ports), so a mac computed for
one can never be replayed on the other. No secret configured: no check (a mac of None is accepted).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def auth_mac(secret: str, context: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), context + nonce, hashlib.sha256).digest()


def mac_matches(secret: str | None, context: bytes, nonce: bytes, mac: bytes | None) -> bool:
    if secret is None:
        return True
    return mac is not None and hmac.compare_digest(mac, auth_mac(secret, context, nonce))
