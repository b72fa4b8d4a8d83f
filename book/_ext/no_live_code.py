"""Drop sphinx-thebe's page scripts: the book has no live-code cells.

Jupyter Book always loads ``sphinx_thebe``, which puts a loader for Thebe (fetched from a CDN
when a reader clicks "run") on every page. This book's outputs are committed and its
notebooks run in JupyterLab, so the loader only costs a script per page, and in Jupyter Book
1.0.4 it is added twice, which raises a JavaScript error on every page
(``Identifier 'THEBE_JS_URL' has already been declared``). Removing the listener that adds it
keeps every page free of errors and of references to outside servers.
"""

from __future__ import annotations

import sphinx_thebe
from sphinx.application import Sphinx


def drop_thebe_loader(app: Sphinx) -> None:
    listeners = app.events.listeners.get("env-before-read-docs", [])
    app.events.listeners["env-before-read-docs"] = [
        listener for listener in listeners if listener.handler is not sphinx_thebe.init_thebe_core
    ]


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", drop_thebe_loader)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
