"""Where minillm keeps its files, and the switches every chapter reads.

All caches (tokenizer files, tokenized corpora, Hugging Face downloads) live under one
directory so that nothing is written elsewhere and one `rm -rf` resets everything:

- ``MINILLM_HOME`` if set;
- else, in a source checkout, the checkout itself (``<repo>/.cache`` and ``<repo>/checkpoints``);
- else ``~/.cache/minillm``.

``MINILLM_QUICK=1`` asks every notebook, test and command for its short version: smaller
corpora and schedules, so the whole book runs on a 2-core CPU in minutes.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def quick() -> bool:
    """True when ``MINILLM_QUICK`` is set to a true value (1, true, yes)."""
    return os.environ.get("MINILLM_QUICK", "").strip().lower() in {"1", "true", "yes", "on"}


def project_root() -> Path | None:
    """The source checkout this package was imported from, or None for an installed wheel."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "minillm").is_dir() else None


def home() -> Path:
    """The directory that holds ``.cache`` and ``checkpoints``."""
    if os.environ.get("MINILLM_HOME"):
        return Path(os.environ["MINILLM_HOME"]).expanduser()
    root = project_root()
    return root if root is not None else Path.home() / ".cache" / "minillm"


def cache_dir(*parts: str) -> Path:
    """A subdirectory of the cache, created on first use."""
    path = home().joinpath(".cache", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


CHECKPOINT_NAME = "ckpt.pt"


def preset_dir(preset: str) -> Path:
    """Where ``python -m minillm.train --preset NAME`` writes by default: ``checkpoints/NAME``.

    QUICK runs keep theirs apart, in ``checkpoints/quick``: a 30-step model trained by a test
    run must never become the model that ``make serve`` or a full notebook run picks up.
    """
    checkpoints = home() / "checkpoints" / ("quick" if quick() else "")
    checkpoints.mkdir(parents=True, exist_ok=True)
    return checkpoints / preset


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, given the file itself or the directory ``--out`` wrote."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path
