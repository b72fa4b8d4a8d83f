"""Headless Chromium for the browser tests (the dashboard and the built book).

Playwright drives Debian's ``chromium`` here, because it cannot download its own browsers
offline. The tests must run, not skip: CI installs chromium (``.ci/run``), and a missing
browser fails them with a message saying how to get one.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Iterator

from playwright.sync_api import Browser, sync_playwright

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]


def chromium() -> str:
    """Debian's chromium: ``$CHROMIUM``, else whichever ``chromium`` is on the PATH."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "the browser tests need chromium (apt-get install chromium, or set CHROMIUM=/path)"
    return path


@contextmanager
def headless_chromium() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, timeout=30_000)
        try:
            yield browser
        finally:
            browser.close()
