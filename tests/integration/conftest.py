"""Fixtures shared by the worker's integration tests."""

from __future__ import annotations

import pytest

from fairlane.subjects import Subjects
from tests.integration.test_worker import FakeDispatcher


@pytest.fixture
async def dispatcher(nc, uid):
    """A scripted dispatcher (`FakeDispatcher`) on the test's own subject prefix."""
    d = await FakeDispatcher(nc, Subjects(f"t{uid}")).start()
    yield d
    await d.stop()
