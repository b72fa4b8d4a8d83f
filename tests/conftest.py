"""Shared fixtures: every test that writes caches does so in its own temporary MINILLM_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh, empty MINILLM_HOME, with the Hugging Face hub switched off (CI has no network)."""
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """``test-artifacts/`` at the repository root (git ignores it): screenshots and other
    files a test leaves behind for a person, or CI, to look at."""
    path = Path(__file__).resolve().parents[1] / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path
