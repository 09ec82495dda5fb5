"""A real headless Chromium for the page tests, with the network blocked.

The browser is the system's Chromium (Debian's ``chromium`` package, which ``make setup``
installs when it is missing), driven by Playwright from pip; no browser build is ever
downloaded. Every request any page makes is recorded, and all but the page file itself are
aborted, so a test can assert that nothing left the page.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from helpers.needs import CHROMIUM, needs

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1500, "height": 1000}


@dataclass
class Browser:
    context: object  # a playwright BrowserContext
    allowed: set[str] = field(default_factory=set)  # the page files opened so far
    requests: list[str] = field(default_factory=list)  # every URL asked for, by any page
    blocked: list[str] = field(default_factory=list)  # the ones aborted

    def open(self, path: str | os.PathLike, *, ready: bool = True):
        """A new tab showing the HTML file ``path``; with ``ready``, once the page says it is
        drawn (``<html data-ready="true">``), failing on a script error."""
        url = Path(path).absolute().as_uri()
        self.allowed.add(url)
        page = self.context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        if ready:
            # a function, not an expression: Playwright polls an expression with eval, which the page's CSP forbids
            page.wait_for_function("() => document.documentElement.dataset.ready", timeout=30_000)
            state = page.evaluate("document.documentElement.dataset.ready")
            assert state == "true" and not errors, f"{url} failed to draw: {errors or page.inner_text('#error')}"
        return page

    def _route(self, route) -> None:
        url = route.request.url
        if url in self.allowed:
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()


@needs("browser")
@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[Browser]:
    """Headless Chromium with a fresh user-data-dir ``profile``; the network is blocked."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium package "
                           f"(apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                       args=FLAGS, viewport=VIEWPORT)
        browser = Browser(context)
        context.on("request", lambda request: browser.requests.append(request.url))
        context.route("**/*", browser._route)
        try:
            yield browser
        finally:
            context.close()
