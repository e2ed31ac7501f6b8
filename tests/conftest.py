"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.redis_fixture"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's HF directory, converted on first use (about 20 s, once per cache)."""
    from services.common.model_store import ensure_default_model

    return ensure_default_model()
