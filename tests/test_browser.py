"""JupyterLab in a real browser (headless Chromium): what a student sees, not only what the kernel says.

A: notebook 00, Run All: every cell runs without an error, the 2-rank launch output is in the page, and
   TensorBoard's scalar charts are drawn inside it. (The other notebooks are executed headless once, in
   test_notebooks; running a long one again here would only repeat the same runs.)
B: notebook 03's "Try it yourself" launcher panel, run as a student would (the imports cell and that
   cell only): the real train_ddp.py on 2 ranks, live output and progress, Stop, no process left behind.
C: notebook 00's SVG diagrams, embedded in markdown, are loaded and drawn in Lab (no cell is run).
Lab runs with COURSE_QUICK=1 and without autosave:
each test checks that its notebook file was not written. Screenshots go to tests/artifacts/.
Needs /usr/bin/chromium (CI's .ci/run installs it).
"""
import json
import re
import secrets
import shutil
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
    check_tensorboard,
    dark_pixels,
    error_texts,
    file_state,
    image_loaded,
    open_notebook,
    processes_with,
    prompts,
    run_all,
    run_cell,
    shutdown_kernels,
    wait_for_cell,
    wait_for_run_all,
    wait_until,
)

from course import ROOT
from course.launcher import kill_tree

pytestmark = pytest.mark.browser

NOTEBOOK_00 = "notebooks/00_environment.ipynb"
NOTEBOOK_03 = "notebooks/03_ddp_five_steps.ipynb"
TRY_IT = 'launcher_widget("train_ddp.py"'  # the text of notebook 03's "Try it yourself" cell


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"chromium not installed ({CHROMIUM} missing): apt-get install chromium (CI's .ci/run does this)")
    from course.lab import start_lab, stop_lab

    ARTIFACTS.mkdir(exist_ok=True)
    state = tmp_path_factory.mktemp("lab-state")
    # Lab passes its environment on to its kernels and from them to every rank they launch: this
    # marker tells this Lab's processes from the same scripts run by anything else on the machine.
    marker = {"COURSE_BROWSER_TEST_LAB": secrets.token_hex(8)}
    with open(ARTIFACTS / "lab.log", "w") as log:
        # The repository is Lab's root (notebook 00 writes ../scripts/ and reads course.ROOT). Lab's own
        # state (settings, workspaces) is a temporary folder, and autosave is off: the notebooks stay as they are.
        base, token, proc = start_lab(isolated=True, state_dir=state, settings=LAB_SETTINGS,
                                      env={"COURSE_QUICK": "1", **marker}, log=log)
        yield SimpleNamespace(base=base, token=token, proc=proc,
                              processes=lambda fragment: processes_with(fragment, env=marker))
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


# ------------------------------------------------------------------ A: Run All, notebook by notebook

RUN_ALL = [
    pytest.param(SimpleNamespace(
        name="00", path=NOTEBOOK_00, run_all_s=240,
        launches=1, scripts=["hello_distributed.py"],  # under torchrun (Check yourself starts unanswered: no launch)
        board_runs=["np2"], tags=["all_reduce/bus_bandwidth_GBps"],  # TensorBoard on runs/00_environment
    ), id="00", marks=pytest.mark.timeout(420)),  # a hard stop if Lab or Chromium hangs
]


@pytest.mark.parametrize("nb", RUN_ALL)
def test_notebook_run_all(nb, page, lab):
    before = file_state(ROOT / nb.path)
    start = time.monotonic()
    open_notebook(page, workspace_url(lab, nb.path))
    code_cells = page.locator(".jp-CodeCell").count()
    run_all(page)
    shown = wait_for_run_all(page, timeout=nb.run_all_s)
    run_all_s = time.monotonic() - start
    page.screenshot(path=ARTIFACTS / f"nb{nb.name}_after_run_all.png")
    assert not error_texts(page), error_texts(page)
    assert len(shown) == code_cells and all(p[1:-2].isdigit() for p in shown), f"not every cell ran: {shown}"

    outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    assert "[rank0]:" in outputs and "[rank1]:" in outputs, outputs[-2000:]
    codes = re.findall(r"\[launcher\] exit code (-?\d+)", outputs)
    assert len(codes) >= nb.launches and set(codes) == {"0"}, f"launch exit codes in the page: {codes}"
    for script in nb.scripts:
        assert not lab.processes(script), f"{script}: ranks left running after Run All"

    # TensorBoard, inside its iframe (another port of 127.0.0.1, so another origin): the notebook's
    # runs are listed, and each tag's scalar card has its curve drawn.
    iframe = page.locator(".jp-OutputArea-output iframe").first
    iframe.scroll_into_view_if_needed()
    board = page.frame_locator(".jp-OutputArea-output iframe").first
    drawn = check_tensorboard(board, nb.tags, runs=nb.board_runs)
    board.locator("scalar-card").first.scroll_into_view_if_needed()
    iframe.screenshot(path=ARTIFACTS / f"nb{nb.name}_tensorboard.png")
    assert file_state(ROOT / nb.path) == before, f"{nb.path} was written (autosave must be off)"
    print(f"notebook {nb.name}: Run All {run_all_s:.0f} s ({len(shown)} cells, {len(codes)} launches), "
          f"with TensorBoard check {time.monotonic() - start:.0f} s; dark pixels per chart {drawn}")


# ------------------------------------------------------------------ B: the launcher panel of notebook 03

@pytest.fixture
def widget_run_dir(tmp_path):
    """The panel's run folder in notebook 03, put back as it was after the test (and after its kernel
    is gone): the stopped runs would otherwise be a stray curve in the notebook's TensorBoard."""
    run_dir = ROOT / "runs" / "03_ddp_five_steps" / "widget"
    saved = tmp_path / "saved"
    if run_dir.exists():
        shutil.copytree(run_dir, saved)
    yield run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    if saved.exists():
        shutil.copytree(saved, run_dir)


@pytest.mark.timeout(480)
def test_launcher_widget_in_notebook_03(widget_run_dir, page, lab):  # (this order: page ends first)
    before = file_state(ROOT / NOTEBOOK_03)
    run_dir = widget_run_dir
    start = time.monotonic()
    open_notebook(page, workspace_url(lab, NOTEBOOK_03))

    # Only the imports cell and the "Try it yourself" cell: select each, Shift+Enter.
    imports = page.locator(".jp-CodeCell").first
    try_it = page.locator(".jp-CodeCell", has_text=TRY_IT)
    assert "import course" in imports.text_content() and try_it.count() == 1
    run_cell(page, imports)
    wait_for_cell(imports, 120)
    run_cell(page, try_it)
    wait_for_cell(try_it, 60)
    assert sum(p[1:-2].isdigit() for p in prompts(page)) == 2, f"other cells ran too: {prompts(page)}"
    assert not error_texts(page), error_texts(page)
    panel = try_it.locator(".jp-OutputArea-output .widget-vbox").first
    panel.wait_for(timeout=60_000)
    panel.scroll_into_view_if_needed()

    def field(label):
        name = page.locator("label.widget-label", has_text=re.compile(f"^{label}$"))
        return panel.locator(".widget-inline-hbox", has=name).locator("input")

    def set_field(label, value):
        field(label).fill(str(value))
        field(label).press("Tab")

    log = panel.locator(".course-launcher-log")
    launch_button = panel.get_by_role("button", name="Launch")
    buttons = panel.locator(".widget-hbox", has=page.get_by_role("button", name="Launch"))
    status = buttons.locator(".widget-html-content")
    bar = panel.locator(".widget-hprogress .progress-bar")
    preset = [field(label).input_value() for label in ("processes", "max steps", "extra args")]
    assert preset == ["2", "200", "--model cnn"], f"the notebook's preset: {preset}"

    def width() -> float:  # the bar's drawn width, in percent
        return float(re.search(r"width:\s*([\d.]+)%", bar.get_attribute("style") or "width: 0%")[1])

    def both_ranks(text: str) -> bool:
        return "[rank0]:" in text and "[rank1]:" in text

    # Refused in the page, before anything starts: more CPU ranks than cores.
    set_field("processes", 64)
    launch_button.click()
    page.get_by_text("refused: 64 processes on the CPU").wait_for(timeout=10_000)
    # (the panel may still be asking the script for its options: `train_ddp.py --help` is no rank)
    def ranks():  # command lines of train_ddp.py processes other than its --help
        found = []
        for proc in lab.processes("train_ddp.py"):
            try:
                found.append(" ".join(proc.cmdline()))
            except psutil.Error:  # ended meanwhile
                pass
        return [line for line in found if "--help" not in line]

    assert not ranks(), ranks()

    # The preset as the notebook gives it: 2 ranks, 200 steps of the small CNN; it runs to the end.
    set_field("processes", 2)
    launched = time.time()
    launch_button.click()
    wait_until(lambda: "finished in" in (status.text_content() or ""), 120, "the preset run to finish")
    preset_s = time.time() - launched
    text = log.text_content()
    assert both_ranks(text) and "done:" in text, text[-2000:]
    assert width() > 30 and "progress-bar-success" in bar.get_attribute("class")  # "step 200" of 200 asked for
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 200 and metrics["world_size"] == 2
    assert (run_dir / "metrics.json").stat().st_mtime >= launched, "metrics.json is not from this run"
    wait_until(lambda: not lab.processes("train_ddp.py"), 10, "the ranks to end after the run")
    page.screenshot(path=ARTIFACTS / "widget_preset_finished.png")

    # The TensorBoard button: the experiment folder runs/03_ddp_five_steps, inline under the panel, with the
    # panel's run ("widget") listed and its charts drawn.
    panel.get_by_role("button", name="TensorBoard").click()
    iframe = panel.locator(".widget-output iframe")
    iframe.wait_for(timeout=60_000)
    iframe.scroll_into_view_if_needed()
    board = panel.frame_locator(".widget-output iframe")
    check_tensorboard(board, ["train/loss", "val/accuracy"], runs=["widget"])
    board.locator("scalar-card").first.scroll_into_view_if_needed()
    page.screenshot(path=ARTIFACTS / "widget_tensorboard.png")

    # A longer run, stopped mid-run: 7500 steps in batches of 4 (about 40 s here), its "step N" lines (every 10
    # steps) moving the bar between 0 and 100 %.
    set_field("max steps", 7500)
    set_field("extra args", "--batch-size 4")
    launch_button.click()
    wait_until(lambda: "done:" not in (log.text_content() or ""), 10, "the last run's output to clear")
    wait_until(lambda: both_ranks(log.text_content() or ""), 60, "output from ranks 0 and 1")
    wait_until(lambda: width() >= 5, 60, "the progress bar to advance")
    first = width()
    wait_until(lambda: width() > first, 30, "the progress bar to keep advancing")
    assert len(lab.processes("train_ddp.py")) >= 3  # torchrun and its 2 ranks
    page.screenshot(path=ARTIFACTS / "widget_mid_run.png")

    panel.get_by_role("button", name="Stop").click()
    stopped = time.monotonic()
    wait_until(lambda: not lab.processes("train_ddp.py"), 10, "every rank to end after Stop")
    stop_s = time.monotonic() - stopped
    page.get_by_text("stopped: every process was ended").wait_for(timeout=10_000)
    assert "done:" not in log.text_content(), "the run ended by itself before Stop"
    assert width() < 100 and "progress-bar-warning" in bar.get_attribute("class")
    page.screenshot(path=ARTIFACTS / "widget_after_stop.png")

    # Shutting the kernel down (or restarting it) mid-run must not leave ranks behind either:
    # they run in their own process session, so the panel's exit hook stops them.
    launch_button.click()
    wait_until(lambda: len(lab.processes("train_ddp.py")) >= 3, 60, "the next run to start")
    shut_kernels_down(lab)
    wait_until(lambda: not lab.processes("train_ddp.py"), 5, "every rank to end after the kernel shut down")
    assert file_state(ROOT / NOTEBOOK_03) == before, f"{NOTEBOOK_03} was written (autosave must be off)"
    print(f"widget in notebook 03: preset run {preset_s:.0f} s, Stop -> 0 processes in {stop_s:.1f} s, "
          f"whole test {time.monotonic() - start:.0f} s")


# ------------------------------------------------------------------ C: diagrams, as Lab draws them

DIAGRAMS_00 = ["00_ranks_two_nodes.svg", "00_all_reduce.svg"]  # notebooks/figures/, embedded in markdown


@pytest.mark.timeout(240)
def test_diagrams_render_in_notebook_00(page, lab):
    """Each diagram is an <img> in a rendered markdown cell that Lab loaded (naturalWidth > 0) and drew
    at a readable size with visible content; a screenshot of each goes to tests/artifacts/."""
    before = file_state(ROOT / NOTEBOOK_00)
    open_notebook(page, workspace_url(lab, NOTEBOOK_00))
    for name in DIAGRAMS_00:
        embedded = f'.jp-RenderedMarkdown img[src*="{name}"]'
        image = page.locator(f".jp-MarkdownCell {embedded}")
        assert image.count() == 1, f"{name}: not embedded in a rendered markdown cell of {NOTEBOOK_00}"
        image.scroll_into_view_if_needed()
        natural_width = wait_until(lambda image=image: image_loaded(image), 30, f"{name} to load")
        box = image.bounding_box()
        assert box and box["width"] >= 300 and box["height"] >= 150, f"{name} drawn too small: {box}"
        assert dark_pixels(image.screenshot()) > 2000, f"{name}: loaded but nothing drawn"
        cell = page.locator(".jp-MarkdownCell", has=page.locator(embedded))
        cell.screenshot(path=ARTIFACTS / f"nb00_{name[:-4]}.png")
        print(f"{name}: naturalWidth {natural_width}, drawn {box['width']:.0f}x{box['height']:.0f} px")
    assert file_state(ROOT / NOTEBOOK_00) == before, f"{NOTEBOOK_00} was written (autosave must be off)"
