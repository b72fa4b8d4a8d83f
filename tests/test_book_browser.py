"""The built book in headless Chromium, as a reader sees it: the pages open, every figure
loads, every equation is typeset by the book's own MathJax, and nothing is fetched from the
network. Screenshots go to ``test-artifacts/`` (the README's picture of the book is one).
"""

from __future__ import annotations

import functools
import json
import threading
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from browser import headless_chromium

ROOT = Path(__file__).resolve().parents[1]
# The introduction, and two notebook chapters heavy in equations and figures.
PAGES = ["book/intro", "notebooks/01_roofline", "notebooks/08_paged_attention"]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve(folder: Path) -> Iterator[str]:
    """The built book over HTTP on a free local port, as GitHub Pages would serve it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def committed_figures(entry: str) -> int:
    """How many images a notebook's committed outputs hold (its page must show them all)."""
    path = ROOT / f"{entry}.ipynb"
    if not path.is_file():
        return 0
    cells = json.loads(path.read_text())["cells"]
    return sum("image/png" in o.get("data", {}) for c in cells if c["cell_type"] == "code" for o in c["outputs"])


@pytest.fixture(scope="module")
def book_url(built_book: Path) -> Iterator[str]:
    with serve(built_book) as url:
        yield url


@pytest.mark.parametrize("entry", PAGES)
def test_a_page_renders_its_figures_and_math_offline(entry: str, book_url: str, artifacts: Path) -> None:
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(30_000)
        errors: list[str] = []
        outside: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((book_url, "data:", "blob:")) else None)

        page.goto(f"{book_url}/{entry}.html", wait_until="load")
        assert page.title(), "the page has a title"
        images = page.evaluate("""() => [...document.querySelectorAll('article img')].map(
            img => ({src: img.getAttribute('src'), ok: img.complete && img.naturalWidth > 0}))""")
        assert [i["src"] for i in images if not i["ok"]] == [], "every figure loads"
        assert len(images) >= committed_figures(entry)

        math = page.evaluate("document.querySelectorAll('article .math').length")
        if math:
            page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise")
            page.evaluate("() => MathJax.startup.promise")
            typeset = page.evaluate("document.querySelectorAll('article .math mjx-container').length")
            assert typeset == math, f"{typeset} of {math} equations typeset"
            assert page.evaluate("document.querySelectorAll('mjx-merror').length") == 0, "a TeX error"
        assert errors == []
        assert outside == [], "the page fetched something from outside the book"

        name = Path(entry).name
        page.screenshot(path=str(artifacts / f"book-{name}.png"))
        if images:
            page.locator("article img").first.scroll_into_view_if_needed()
            page.screenshot(path=str(artifacts / f"book-{name}-figure.png"))
        page.close()


def test_the_intro_and_a_chapter_have_math(book_url: str) -> None:
    """Guard the test above against passing vacuously: the pages it checks do contain math."""
    with headless_chromium() as browser:
        page = browser.new_page()
        page.goto(f"{book_url}/notebooks/01_roofline.html", wait_until="load")
        assert page.evaluate("document.querySelectorAll('article .math').length") > 5
        assert page.evaluate("document.querySelectorAll('article img').length") > 3
        page.close()
