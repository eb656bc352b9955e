"""Builders for transcript-store tests: nodes chained exactly as ``proxy.core.match`` chains them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson
import pytest

from proxy.store.base import ROLE_TOOLS, Node


def chain(parent: bytes, identity: bytes) -> bytes:
    """``c_i = H(c_{i-1} || id_i)``: the definition ``proxy.core.match.chain`` implements."""
    return hashlib.blake2b(parent + identity, digest_size=16).digest()


def tenant_root(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"test-tenant").digest()


def identity_of(role: str, body: bytes) -> bytes:
    return hashlib.blake2b(role.encode() + b"\0" + body, digest_size=16).digest()


Message = str | tuple[str, str]
"""A user message text, or ``(role, text)``."""


def build_path(
    tenant: bytes,
    messages: Sequence[Message],
    *,
    tools: bytes = b"[]",
    created: float = 0.0,
) -> list[Node]:
    """Element 0 (the tools array) and one node per message, each chained to the previous."""
    nodes = [
        Node(
            key=chain(tenant, identity_of(ROLE_TOOLS, tools)),
            parent=tenant,
            tenant=tenant,
            depth=0,
            role=ROLE_TOOLS,
            identity=identity_of(ROLE_TOOLS, tools),
            body=tools,
            tokens=len(tools) // 4,
            created=created,
        )
    ]
    for depth, message in enumerate(messages, start=1):
        role, text = ("user", message) if isinstance(message, str) else message
        body = orjson.dumps({"role": role, "content": text})
        ident = identity_of(role, body)
        nodes.append(
            Node(
                key=chain(nodes[-1].key, ident),
                parent=nodes[-1].key,
                tenant=tenant,
                depth=depth,
                role=role,
                identity=ident,
                body=body,
                tokens=len(body) // 4,
                generated=role == "assistant",
                created=created,
            )
        )
    return nodes


@dataclass
class FakeClock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_path() -> Callable[..., list[Node]]:
    return build_path


@pytest.fixture
def tenant() -> bytes:
    return tenant_root("alice")


@pytest.fixture
def make_tenant() -> Callable[[str], bytes]:
    return tenant_root


@pytest.fixture
def chain_hash() -> Callable[[bytes, bytes], bytes]:
    return chain
