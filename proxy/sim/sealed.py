"""Sealed reasoning: the opaque ``encrypted_content`` of the reference upstream's ``reasoning`` items.

A provider hands its reasoning back to the client only as bytes the client
cannot read and must return unchanged; the provider opens them on the next
request and puts the reasoning back into the prompt. The reference upstream
does the same with :func:`seal` / :func:`open_sealed`: a keyed, authenticated,
deterministic encryption (a synthetic IV from a keyed BLAKE2b of the text, a
BLAKE2b keystream), URL-safe base64 like the real thing. Every reference
upstream shares the key, as the replicas of one provider do. This is an
emulation, not cryptography to rely on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

_KEY = b"kvwarm-sim/reasoning/v1"
_VERSION = b"\x80"
_TAG_SIZE = 16
_BLOCK = 64


def seal(text: str) -> str:
    """``text`` as opaque, authenticated ``encrypted_content`` (the same text seals the same)."""
    plain = text.encode("utf-8")
    tag = hashlib.blake2b(plain, key=_KEY, digest_size=_TAG_SIZE, person=b"tag").digest()
    sealed = _VERSION + tag + _xor(plain, tag)
    return base64.urlsafe_b64encode(sealed).decode("ascii")


def open_sealed(content: str) -> str | None:
    """The text :func:`seal` sealed into ``content``; ``None`` when ``content`` is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(content.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None
    if len(raw) < 1 + _TAG_SIZE or raw[:1] != _VERSION:
        return None
    tag, cipher = raw[1 : 1 + _TAG_SIZE], raw[1 + _TAG_SIZE :]
    plain = _xor(cipher, tag)
    expected = hashlib.blake2b(plain, key=_KEY, digest_size=_TAG_SIZE, person=b"tag").digest()
    if expected != tag:
        return None
    try:
        return plain.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _xor(data: bytes, tag: bytes) -> bytes:
    stream = bytearray()
    for counter in range(0, len(data), _BLOCK):
        stream += hashlib.blake2b(
            counter.to_bytes(8, "little"), key=_KEY, salt=tag, digest_size=_BLOCK, person=b"stream"
        ).digest()
    return bytes(a ^ b for a, b in zip(data, stream, strict=False))
