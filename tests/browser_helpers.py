"""Helpers for the real-browser tests: Debian's Chromium driven by Playwright, JupyterLab from course.lab."""
import io
import json
import os
import urllib.request
from functools import partial
from pathlib import Path

from conftest import processes_with, wait_until  # noqa: F401 (one home for both; tests/test_browser.py imports them here)

# Debian's package; COURSE_CHROMIUM points elsewhere (another distribution's path, a local build).
CHROMIUM = Path(os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium"))
# No GPU, no sandbox (containers run as root), and no calls home: the machine may be offline.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"
# Lab settings for the tests: never write outputs into the repository's notebooks (no autosave),
# and keep every cell in the page so that cells below the fold can be read.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}
ERROR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'


def open_notebook(page, url: str):
    """Open a notebook URL and wait until its kernel is connected."""
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    wait_until(lambda: "Idle" in (page.locator(".jp-StatusBar-TextItem", has_text="|").first.text_content()
                                  or ""), 90, "the notebook's kernel to start")


def run_all(page):
    """Menu Run > Run All Cells, as a student would."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()


def run_cell(page, cell):
    """Select ``cell`` (a click on its prompt: command mode) and press Shift+Enter, as a student would."""
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")


def wait_for_cell(cell, timeout: float) -> str:
    """Wait until ``cell`` has run (its prompt shows a number, e.g. '[2]:'); returns the prompt."""
    def done():
        prompt = cell.locator(".jp-InputPrompt").inner_text().strip()
        return prompt if prompt[1:-2].isdigit() else None

    return wait_until(done, timeout, "the cell to run", poll=0.5)


def prompts(page) -> list[str]:
    return [p.strip() for p in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def wait_for_run_all(page, timeout: float) -> list[str]:
    """Wait until no cell is queued or running ([*]); returns the prompts, e.g. ['[1]:', '[2]:']."""
    def finished():
        shown = prompts(page)
        executed = [p for p in shown if p[1:-2].isdigit()]
        busy = any("*" in p for p in shown)
        errors = page.locator(ERROR_OUTPUT).count()
        # Run All stops at an error: the cells after it are never run, so stop waiting too.
        return shown if executed and not busy and (len(executed) == len(shown) or errors) else None

    return wait_until(finished, timeout, "Run All to finish", poll=1)


def error_texts(page) -> list[str]:
    return [t for t in page.locator(ERROR_OUTPUT).all_inner_texts()
            if "Traceback" in t or "Error" in t]


def shutdown_kernels(base: str, token: str) -> int:
    """Shut every kernel of this Lab down (and with them what they started, e.g. TensorBoard)."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as reply:
        sessions = json.load(reply)
    for session in sessions:
        request = urllib.request.Request(f"{base}/api/sessions/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()
    return len(sessions)


def dark_pixels(png: bytes, threshold: int = 140) -> int:
    """Pixels darker than ``threshold``: on TensorBoard's white plot area these are the drawn lines."""
    from PIL import Image

    gray = Image.open(io.BytesIO(png)).convert("L")
    return sum(count for value, count in enumerate(gray.histogram()) if value < threshold)


def image_loaded(image) -> int:
    """An <img>'s natural width once the browser has loaded and decoded it; 0 while loading or if broken."""
    return image.evaluate("img => (img.complete && img.naturalWidth) || 0")


def file_state(path: Path) -> tuple[int, bytes]:
    """(mtime in ns, content): equal before and after a test = the file was not written."""
    return path.stat().st_mtime_ns, path.read_bytes()


def check_tensorboard(board, tags, runs=(), timeout: float = 60) -> dict[str, int]:
    """In TensorBoard's frame (a FrameLocator): ``runs`` are listed, and every tag in ``tags`` has a
    scalar card with a curve (or, for a one-step run, its dots) drawn on it. Returns {tag: dark pixels}."""
    titles = board.locator("scalar-card tb-truncated-path")
    titles.first.wait_for(timeout=timeout * 1000)
    if runs:
        table = board.locator("runs-data-table")
        wait_until(lambda: all(run in (table.first.text_content() or "") for run in runs), timeout,
                   f"TensorBoard to list the runs {list(runs)}")
    wait_until(lambda: set(tags) <= {titles.nth(i).get_attribute("title") for i in range(titles.count())},
               timeout, f"TensorBoard cards for {list(tags)}")
    drawn = {}
    for tag in tags:
        card = board.locator("scalar-card", has=board.locator(f'tb-truncated-path[title="{tag}"]'))
        card.scroll_into_view_if_needed()  # cards below the fold are drawn only once they are seen
        plot = card.locator("line-chart canvas, line-chart svg.main").first
        drawn[tag] = wait_until(partial(_drawn, plot), timeout, f"TensorBoard to draw {tag}")
    return drawn


def _drawn(plot, least: int = 50) -> int:
    count = dark_pixels(plot.screenshot())
    return count if count > least else 0
