"""Fixtures of the checkpoint tests: the session's generated corpus (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def corpus(sample_data) -> list[str]:
    """Data flags for the session's generated corpus (`sample_data`)."""
    return sample_data
