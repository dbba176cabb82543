"""Open an HTML file in a real headless Chromium (Debian's `chromium`, driven by Playwright over the DevTools
protocol; Playwright's own browser download is never used) and say what a reader would see.

    python tests/browser.py PAGE.html SHOT.png [WIDTH]     # a full-page screenshot, e.g. docs/report.png

Used by tests/test_report.py; the README's picture of the report is taken with the same code.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path


def chromium() -> str | None:
    """The system browser: $CHROMIUM, else Debian's chromium (or another Chromium/Chrome on PATH)."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


@dataclass
class Seen:
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    requests: list[str] = field(default_factory=list)  # every URL the page asked for beyond itself
    images: list[dict] = field(default_factory=list)  # each <img>: alt, naturalWidth, complete
    text: str = ""  # the page's visible text


def open_page(page_file: Path, screenshot: Path | None = None, width: int = 1200) -> Seen:
    from playwright.sync_api import sync_playwright

    exe = chromium()
    if exe is None:
        raise RuntimeError("no chromium on PATH (apt-get install chromium, or set CHROMIUM)")
    url = page_file.resolve().as_uri()
    seen = Seen()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on("console", lambda m: seen.errors.append(f"console.{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: seen.errors.append(f"uncaught: {e}"))
            page.on("requestfailed", lambda r: seen.errors.append(f"request failed: {r.url}"))
            page.on("request", lambda r: seen.requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load")
            seen.images = page.eval_on_selector_all(
                "img", "els => els.map(e => ({alt: e.alt, naturalWidth: e.naturalWidth, complete: e.complete}))")
            seen.text = page.inner_text("body")
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return seen


if __name__ == "__main__":
    seen = open_page(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1200)
    print(f"{len(seen.images)} images, widths {[i['naturalWidth'] for i in seen.images]}; errors: {seen.errors}; "
          f"other requests: {[u[:60] for u in seen.requests]}")
