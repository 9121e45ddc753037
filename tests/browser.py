"""Open dashboard pages in headless Chromium and read their Bokeh data.

For the browser test (tests/test_dashboard.py), the overhead benchmark and
the screenshot script (benchmarks/dashboard_overhead.py, dashboard_screenshot.py,
which put tests/ on their path): a test helper, not part of the library
(``pip install flowreduce[test]`` for selenium; Chromium and its driver from
the system: Debian's ``chromium`` and ``chromium-driver``). Selenium is
pointed at those binaries, so it downloads nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Flags of a quiet, throwaway headless browser (no sandbox: CI runs as root).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage")

_HINT = ("driving Chromium needs selenium (pip install flowreduce[test]) and the browser with its driver "
         "(apt-get install chromium chromium-driver)")

#: A data source of the page by name, as plain lists (typed arrays copied).
_READ = """
const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
if (!doc) return null;
let m = null;
for (const model of doc.all_models) {  // get_model_by_name trips over models whose name is unset
  try { if (model.name === arguments[0]) { m = model; break; } } catch (e) {}
}
if (!m) return null;
const data = m.data instanceof Map ? Object.fromEntries(m.data) : m.data;
return Object.fromEntries(Object.entries(data).map(([k, v]) => [k, Array.from(v)]));
"""


#: The text of every cell of the page's tables as drawn (inside Bokeh's shadow roots).
_TABLE_TEXT = """
const out = [];
function walk(node) {
  if (node.shadowRoot) walk(node.shadowRoot);
  for (const child of node.children || []) walk(child);
  if (node.tagName === "TD") out.push(node.textContent);
}
walk(document.body);
return out;
"""


def binaries() -> tuple[str, str] | None:
    """(chromium, chromedriver) found on the PATH, or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A selenium driver of a fresh headless Chromium (own profile, removed after)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        raise ImportError(_HINT) from e
    found = binaries()
    if found is None:
        raise RuntimeError(_HINT)
    profile = tempfile.mkdtemp(prefix="flowreduce-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=Service(found[1]), options=options)
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def read_source(driver, name: str) -> dict[str, list] | None:
    """The data of the page's data source ``name`` as the browser holds it, or None before it loaded."""
    return driver.execute_script(_READ, name)


def table_text(driver) -> list[str]:
    """The text of every table cell the page draws, in document order (what the user sees)."""
    return driver.execute_script(_TABLE_TEXT)


def wait_for(driver, name: str, predicate, timeout: float = 60.0) -> dict[str, list]:
    """Poll the browser's copy of source ``name`` until ``predicate(data)`` holds; the data then.
    Raises TimeoutError with the last data seen."""
    import time

    deadline = time.monotonic() + timeout
    data = None
    while time.monotonic() < deadline:
        data = read_source(driver, name)
        if data is not None and predicate(data):
            return data
        time.sleep(0.2)
    raise TimeoutError(f"page source {name!r} never satisfied the condition; last seen: {data!r}")
