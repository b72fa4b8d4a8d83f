"""Shared fixtures: every test that writes caches does so in its own temporary MINILLM_HOME; the
CPU's C++ kernels, built once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    path = ROOT / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> Path:
    """The book built once per test session, as ``make book`` builds it (Sphinx warnings are
    errors, nitpicky cross-references): the ``_build/html`` folder."""
    out = tmp_path_factory.mktemp("book")
    result = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-book"), "build", "--warningiserror", "--nitpick", "--keep-going",
         "--path-output", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / "_build" / "html"


@pytest.fixture(scope="session")
def kernel() -> None:
    """The CPU's C++ kernels (minillm.speedups.gemv), built once per session; a machine with a
    C++ compiler must build them."""
    from minillm.speedups import gemv

    if not gemv.load():
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is here, yet the CPU kernels did not build (see the warning)")
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
