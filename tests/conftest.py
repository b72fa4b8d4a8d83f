"""Shared fixtures: every test that writes caches does so in its own temporary MINILLM_HOME."""

from __future__ import annotations

import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh, empty MINILLM_HOME, with the Hugging Face hub switched off (CI has no network)."""
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path
