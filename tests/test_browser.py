"""JupyterLab in a real browser (headless Chromium): what a student sees, not only what the kernel says.

A: notebook 00, Run All: the 2-rank launch output and TensorBoard's scalar charts inside the page.
B: the launcher widget: Launch a 2-rank job, live output and progress, Stop, no process left behind.
Screenshots go to tests/artifacts/. Needs /usr/bin/chromium (CI's .ci/run installs it).
"""
import re
import time
import uuid
import warnings
from types import SimpleNamespace

import psutil
import pytest
from browser_helpers import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    LAB_SETTINGS,
    dark_pixels,
    error_texts,
    open_notebook,
    processes_with,
    run_all,
    shutdown_kernels,
    wait_for_run_all,
    wait_until,
    write_notebook,
)

from course import ROOT
from course.launcher import kill_tree

pytestmark = pytest.mark.browser

FIXTURE = ROOT / "tests" / "fixtures" / "slow_ranks.py"
SCRATCH = ARTIFACTS / "widget_scratch.ipynb"  # inside Lab's root (the repo), git-ignored


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"chromium not installed ({CHROMIUM} missing): apt-get install chromium (CI's .ci/run does this)")
    from course.lab import start_lab, stop_lab

    ARTIFACTS.mkdir(exist_ok=True)
    state = tmp_path_factory.mktemp("lab-state")
    with open(ARTIFACTS / "lab.log", "w") as log:
        # The repository is Lab's root (notebook 00 writes ../scripts/ and reads course.ROOT). Lab's own
        # state (settings, workspaces) is a temporary folder, and autosave is off: the notebooks stay as they are.
        base, token, proc = start_lab(isolated=True, state_dir=state, settings=LAB_SETTINGS,
                                      env={"COURSE_QUICK": "1"}, log=log)
        yield SimpleNamespace(base=base, token=token, proc=proc)
        stop_lab(proc)  # Lab, its kernels and everything they started
    wait_until(lambda: not processes_with(str(state)), 10, "Lab to end")


@pytest.fixture(scope="module")
def browser(lab):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download needed)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, lab):
    context = browser.new_context(viewport={"width": 1400, "height": 950})
    page = context.new_page()
    yield page
    context.close()
    shut_kernels_down(lab)  # each test starts with no kernel of the one before


def shut_kernels_down(lab):
    """Shut every kernel down as Lab's "Shut Down Kernel" does; end (and report) whatever they
    started that is still alive 10 s later: nothing should be."""
    started = psutil.Process(lab.proc.pid).children(recursive=True)
    shutdown_kernels(lab.base, lab.token)
    _, alive = psutil.wait_procs(started, timeout=10)
    survivors = []
    for proc in alive:
        try:
            survivors.append(" ".join(proc.cmdline()[:4]))
        except psutil.Error:
            continue
        kill_tree(proc.pid)
    if survivors:
        warnings.warn("still running 10 s after their kernel was shut down (now ended): " + "; ".join(survivors))


def workspace_url(lab, path: str) -> str:
    # A fresh named workspace with ?reset: no tabs or layout left over from another run.
    return f"{lab.base}/lab/workspaces/t{uuid.uuid4().hex[:8]}/tree/{path}?reset&token={lab.token}"


@pytest.mark.timeout(420)  # a hard stop if Lab or Chromium hangs; the fixtures still end every process
def test_notebook_00_run_all(page, lab):
    start = time.monotonic()
    open_notebook(page, workspace_url(lab, "notebooks/00_environment.ipynb"))
    run_all(page)
    shown = wait_for_run_all(page, timeout=240)
    page.screenshot(path=ARTIFACTS / "nb00_after_run_all.png")
    assert not error_texts(page), error_texts(page)
    assert all(p[1:-2].isdigit() for p in shown), f"not every cell ran: {shown}"

    outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    assert "[rank0]:" in outputs and "[rank1]:" in outputs, outputs[-2000:]
    assert "exit code 0" in outputs
    assert not processes_with("hello_distributed.py"), "ranks left running after the launch cell"

    # TensorBoard, inside its iframe (another port of 127.0.0.1, so another origin): the scalar
    # cards are there, and the bandwidth chart has a line drawn on it.
    iframe = page.locator(".jp-OutputArea-output iframe")
    iframe.scroll_into_view_if_needed()
    board = page.frame_locator(".jp-OutputArea-output iframe")
    titles = board.locator("scalar-card tb-truncated-path")
    titles.first.wait_for(timeout=60_000)
    assert "all_reduce/bus_bandwidth_GBps" in [titles.nth(i).get_attribute("title") for i in range(titles.count())]
    card = board.locator("scalar-card", has=board.locator('tb-truncated-path[title="all_reduce/bus_bandwidth_GBps"]'))
    plot = card.locator("line-chart canvas, line-chart svg.main").first
    wait_until(lambda: dark_pixels(plot.screenshot()) > 50, 60, "TensorBoard to draw the bandwidth curve")
    iframe.screenshot(path=ARTIFACTS / "nb00_tensorboard.png")
    print(f"notebook 00 Run All + TensorBoard check: {time.monotonic() - start:.0f} s")


@pytest.mark.timeout(300)
def test_launcher_widget_launch_and_stop(page, lab, tmp_path):
    start = time.monotonic()
    write_notebook(SCRATCH, "from course.widget import launcher_widget\n\n"
                   f"launcher_widget(script={str(FIXTURE)!r}, nproc=2, run_dir={str(tmp_path / 'run')!r},\n"
                   "                args='--step-seconds 0.1', max_steps=100)")
    open_notebook(page, workspace_url(lab, SCRATCH.relative_to(ROOT).as_posix()))
    run_all(page)
    wait_for_run_all(page, timeout=120)
    panel = page.locator(".jp-OutputArea-output .widget-vbox").first
    panel.wait_for(timeout=60_000)

    def field(label):
        name = page.locator("label.widget-label", has_text=re.compile(f"^{label}$"))
        return panel.locator(".widget-inline-hbox", has=name).locator("input")

    # Refused in the page, before anything starts: more CPU ranks than cores.
    field("processes").fill("64")
    field("processes").press("Tab")
    panel.get_by_role("button", name="Launch").click()
    page.get_by_text("refused: 64 processes on the CPU").wait_for(timeout=10_000)
    assert not processes_with(FIXTURE.name)

    # A short 2-rank run, set in the widget itself.
    field("processes").fill("2")
    field("processes").press("Tab")
    field("max steps").fill("300")
    field("max steps").press("Tab")
    panel.get_by_role("button", name="Launch").click()
    log = panel.locator(".course-launcher-log")
    wait_until(lambda: "[rank1]:" in (log.text_content() or ""), 60, "output from rank 1")
    bar = panel.locator(".widget-hprogress .progress-bar")

    def width() -> float:  # the bar's drawn width, in percent
        return float(re.search(r"width:\s*([\d.]+)%", bar.get_attribute("style") or "width: 0%")[1])

    wait_until(lambda: width() >= 5, 60, "the progress bar to advance")
    first = width()
    wait_until(lambda: width() > first, 30, "the progress bar to keep advancing")
    text = log.text_content()
    assert "[rank0]:" in text and "[rank1]:" in text and "/300 [" in text
    assert len(processes_with(FIXTURE.name)) >= 3  # torchrun and its 2 ranks
    page.screenshot(path=ARTIFACTS / "widget_mid_run.png")

    panel.get_by_role("button", name="Stop").click()
    stopped = time.monotonic()
    wait_until(lambda: not processes_with(FIXTURE.name), 10, "every rank to end after Stop")
    print(f"Stop -> 0 processes in {time.monotonic() - stopped:.1f} s")
    page.get_by_text("stopped: every process was ended").wait_for(timeout=10_000)
    assert width() < 100
    page.screenshot(path=ARTIFACTS / "widget_after_stop.png")

    # The TensorBoard button: the run's experiment folder, inline under the panel, with the
    # fixture's scalar drawn (it logged one point per step until Stop).
    panel.get_by_role("button", name="TensorBoard").click()
    iframe = panel.locator(".widget-output iframe")
    iframe.wait_for(timeout=60_000)
    iframe.scroll_into_view_if_needed()
    board = panel.frame_locator(".widget-output iframe")
    card = board.locator("scalar-card", has=board.locator('tb-truncated-path[title="fixture/loss"]'))
    card.wait_for(timeout=60_000)
    plot = card.locator("line-chart canvas, line-chart svg.main").first
    wait_until(lambda: dark_pixels(plot.screenshot()) > 50, 60, "TensorBoard to draw the fixture's curve")
    page.screenshot(path=ARTIFACTS / "widget_tensorboard.png")

    # Shutting the kernel down (or restarting it) mid-run must not leave ranks behind either:
    # they run in their own process session, so the panel's exit hook stops them.
    panel.get_by_role("button", name="Launch").click()
    wait_until(lambda: len(processes_with(FIXTURE.name)) >= 3, 60, "the second run to start")
    shut_kernels_down(lab)
    wait_until(lambda: not processes_with(FIXTURE.name), 5, "every rank to end after the kernel shut down")
    print(f"widget launch/stop in the browser: {time.monotonic() - start:.0f} s")
    SCRATCH.unlink()
