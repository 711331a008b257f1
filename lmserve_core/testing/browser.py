"""Headless Chromium for the chat page's tests (docs/webui.md), driven by Playwright.

The browser is the system's Chromium (Debian's ``chromium`` package, ``/usr/bin/chromium``,
or ``$LMSERVE_CHROMIUM``): Playwright's own browser download is never used. When Chromium
or the ``playwright`` package is missing, the tests that need them are skipped with the
reason, except under CI (``$CI`` set), where they fail: CI installs both (noxfile.py), and
a browser test that silently stopped running would hide a broken page.

A test folder's conftest.py imports the fixtures::

    from lmserve_core.testing.browser import chromium, tab  # noqa: F401

``chromium`` is the browser (one per test module); ``tab`` a page in a fresh browser context
(empty localStorage and sessionStorage) per test, which fails the test on any uncaught error
in the page's scripts. (Not ``browser`` and ``page``: those are pytest-playwright's, which
these tests do not need.) ``screenshot(tab, name)`` writes ``test-artifacts/webui/NAME.png``
(``$LMSERVE_TEST_ARTIFACTS`` moves the folder).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1200, "height": 760}


def wanted_chromium() -> str:
    return os.environ.get("LMSERVE_CHROMIUM", "/usr/bin/chromium")


def chromium_path() -> str | None:
    path = wanted_chromium()
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else shutil.which(path)


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install playwright)"
    if chromium_path() is None:
        return (
            f"no Chromium at {wanted_chromium()} (apt-get install chromium, or set "
            "LMSERVE_CHROMIUM to a Chromium binary)"
        )
    return None


def require_browser() -> None:
    """Skip the test when no browser can run, or fail it under CI."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"browser tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("LMSERVE_TEST_ARTIFACTS", "test-artifacts")) / "webui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(tab: Any, name: str) -> Path:
    path = artifacts_dir() / f"{name}.png"
    tab.screenshot(path=str(path))
    return path


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One headless Chromium for the module's tests."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def tab(chromium: Any) -> Iterator[Any]:
    """A new page in a new context; an uncaught script error fails the test."""
    context = chromium.new_context(viewport=VIEWPORT)
    context.set_default_timeout(20_000)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"script errors in the page: {errors}"


def open_page(tab: Any, base_url: str, *, api_key: str | None = None) -> None:
    """Load the chat page (with ``api_key`` already in its session storage) and wait until
    it has read the served model."""
    if api_key is not None:
        tab.add_init_script(f"sessionStorage.setItem('lmserve.apiKey', {api_key!r});")
    tab.goto(base_url + "/")
    tab.wait_for_selector("body[data-ready]")
    if api_key is not None:
        tab.wait_for_function("() => document.getElementById('model-id').textContent !== '…'")


def send(tab: Any, text: str) -> None:
    tab.fill("#input", text)
    tab.press("#input", "Enter")


def wait_idle(tab: Any, timeout: float = 60_000) -> None:
    """Until no reply is streaming (the Send button is back)."""
    tab.wait_for_selector("#send:not([hidden])", timeout=timeout)


def settings(tab: Any, **values: str) -> None:
    """Fill the settings panel's fields by id (``max_tokens`` -> ``#max-tokens``)."""
    if tab.is_hidden("#settings"):
        tab.click("#settings-toggle")
    for name, value in values.items():
        tab.fill("#" + name.replace("_", "-"), value)
