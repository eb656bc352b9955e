"""Fixtures of the pure-core tests (identity, matching, repair, breaks): no event loop, no sockets."""

from __future__ import annotations

import pytest

from proxy.core.policy import Policy
from tests.core.factories import DictStore, Session


@pytest.fixture
def store() -> DictStore:
    return DictStore()


@pytest.fixture
def session(store: DictStore) -> Session:
    """A tenant talking through kvwarm with the default policy (repair on, nothing opt-in)."""
    return Session(store=store, policy=Policy())
