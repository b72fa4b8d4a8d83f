"""Serve MathJax from the book itself, so equations render with no network.

The PyPI package ``sphinx-mathjax-offline`` ships a full MathJax 3 build, but installs it in a
folder whose name (with hyphens) Python cannot import as a Sphinx extension. This extension
finds that folder through the package's installed file list, points Sphinx's ``mathjax_path``
at a local copy, and copies MathJax into ``_static/mathjax`` when the build finishes.
"""

from __future__ import annotations

from importlib.metadata import distribution
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util.fileutil import copy_asset

MATHJAX_ENTRY = "tex-chtml.js"


def mathjax_dir() -> Path:
    """The installed MathJax folder of ``sphinx-mathjax-offline``."""
    dist = distribution("sphinx-mathjax-offline")
    for file in dist.files or []:
        if file.name == MATHJAX_ENTRY and file.parent.name == "mathjax":
            return Path(str(dist.locate_file(file))).parent
    raise RuntimeError("sphinx-mathjax-offline is installed without its MathJax files; reinstall it")


def copy_mathjax(app: Sphinx, exc: Exception | None) -> None:
    if exc is None and app.builder.format == "html":
        copy_asset(str(mathjax_dir()), str(Path(app.outdir) / "_static" / "mathjax"))


def setup(app: Sphinx) -> dict:
    mathjax_dir()  # fail at the start of a build, not after it, if MathJax is missing
    app.config.mathjax_path = f"mathjax/{MATHJAX_ENTRY}"
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
