"""A launch panel for notebooks: pick a script, ranks, backend and run length; Launch, watch, Stop.

    from course.widget import launcher_widget
    launcher_widget("train_ddp.py", nproc=2, args="--model cnn")

The job runs through ``course.launcher.launch`` in a background thread, so the notebook stays
usable while it trains; Stop (or shutting the kernel down) ends every rank. Combinations that
cannot work (nccl without GPUs, more CPU ranks than cores) are refused before anything starts,
by the same ``launcher.plan()`` that a ``launch()`` from a cell goes through. Which run-length
fields apply is asked of the script itself (its ``--help``), once per version of the file.
"""

import atexit
import html
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import ipywidgets as widgets

from course import ROOT, SCRIPTS
from course.launcher import LaunchError, launch, plan, resolve_script
from ddp_doctor.runner.torchrun_output import split_chunk

# tqdm's default format: "epoch 1:  40%|████      | 20/50 [00:03<00:05, 6.1it/s]"
STEP = re.compile(r"^\s*step (?P<n>\d+)\b")  # train_ddp.py's log line, "step 200: train loss 0.31"
PROGRESS = re.compile(r"^\s*(?:(?P<desc>[^|]*?):\s*)?(?:\d+%\|[^|]*\|\s*)?(?P<n>\d+)/(?P<total>\d+)\s*\[")
MAX_LINES = 400  # the log keeps the newest lines; the full output is in the run's result
REFRESH_S = 0.25  # repaint at most 4x a second: every repaint sends the log to the browser
COLOURS = ["inherit", "#1565c0", "#2e7d32", "#ad1457", "#6a1b9a", "#e65100", "#00838f", "#5d4037"]

_live = weakref.WeakSet()  # panels with a job, stopped when the kernel shuts down
_options_cache: dict[tuple[str, int], frozenset[str]] = {}


def script_options(script, timeout: float = 120) -> frozenset[str]:
    """The options a script's argument parser accepts (``{"--epochs", "--run-dir", ...}``), from the
    script's own ``--help``; cached per version of the file. A script that does not build an
    argparse parser is not run just to ask (it might start training): it accepts nothing we know of."""
    path = resolve_script(script)
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _options_cache:
        options: frozenset[str] = frozenset()
        if "ArgumentParser" in path.read_text(errors="replace"):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            try:
                done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, env=env, timeout=timeout, check=False,
                                      capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
                if done.returncode == 0:
                    options = _parse_help(done.stdout)
            except subprocess.TimeoutExpired:
                pass
        _options_cache[key] = options
    return _options_cache[key]


def _parse_help(text: str) -> frozenset[str]:
    """The long options in argparse's help: the invocation part of each option line (before the help text)."""
    found = set()
    for line in text.splitlines():
        if line.lstrip().startswith("-"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            found.update(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", invocation))
    return frozenset(found)


def launcher_widget(script: str = "train_ddp.py", nproc: int = 2, args: str = "", run_dir=None, *,
                    epochs: int = 1, max_steps: int = 0, backend: str = "auto", timeout: float = 3600):
    """A panel that launches ``script`` under torchrun; display it as a cell's last expression.

    run_dir: where the run writes TensorBoard events and metrics.json
      (default ``runs/widget/<script>_np<N>``). epochs / max_steps: 0 keeps the script's default.
    """
    return LauncherPanel(script, nproc, args, run_dir, epochs, max_steps, backend, timeout)


class LauncherPanel(widgets.VBox):
    def __init__(self, script, nproc, args, run_dir, epochs, max_steps, backend, timeout):
        self.run_dir_arg, self.timeout = run_dir, timeout
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._lines: list[tuple[str, str]] = []  # (rank tag, text)
        self._bar_rows: dict = {}  # (tag, desc) -> row of the progress line that tqdm keeps redrawing
        self._progress = None  # newest (desc, n, total) from rank 0
        self._dirty = False
        self._options: frozenset[str] = frozenset()  # what the chosen script accepts (asked in a thread)
        self._options_ready = threading.Event()

        wide = {"description_width": "initial"}
        self.script = widgets.Dropdown(options=_script_options(script), value=_script_value(script),
                                       description="script", layout={"width": "340px"})
        self.backend = widgets.Dropdown(options=["auto", "gloo", "nccl"], value=backend, description="backend",
                                        layout={"width": "180px"})
        self.nproc = widgets.BoundedIntText(value=nproc, min=1, max=256, description="processes",
                                            style=wide, layout={"width": "150px"})
        self.epochs = widgets.IntText(value=epochs, description="epochs", style=wide, layout={"width": "120px"},
                                      tooltip="0: the script's default")
        self.max_steps = widgets.IntText(value=max_steps, description="max steps", style=wide,
                                         layout={"width": "140px"}, tooltip="0: no limit")
        self.extra = widgets.Text(value=args, description="extra args", placeholder="--model cnn",
                                  style=wide, layout={"width": "560px"})
        self.launch_button = widgets.Button(description="Launch", icon="play", button_style="success")
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.tb_button = widgets.Button(description="TensorBoard", icon="line-chart",
                                        tooltip="show TensorBoard for this run's experiment folder")
        self.status = widgets.HTML("ready")
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress",
                                            layout={"width": "560px"})
        self.output = widgets.HTML(_render([]))  # (not `log`: ipywidgets uses that name)
        self.tb_out = widgets.Output()

        self.script.observe(self._script_changed, "value")
        self.launch_button.on_click(self.on_launch)
        self.stop_button.on_click(self.on_stop)
        self.tb_button.on_click(self.on_tensorboard)
        self._script_changed()
        super().__init__([
            widgets.HBox([self.script, self.backend]),
            widgets.HBox([self.nproc, self.epochs, self.max_steps]),
            self.extra,
            widgets.HBox([self.launch_button, self.stop_button, self.tb_button, self.status]),
            self.progress, self.output, self.tb_out,
        ])

    # ------------------------------------------------------------------ decisions, before launching

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run_dir(self) -> Path:
        stem = Path(self.script.value).stem
        path = Path(self.run_dir_arg or f"runs/widget/{stem}_np{self.nproc.value}")
        return path if path.is_absolute() else ROOT / path

    def refusal(self) -> str | None:
        """Why this launch cannot run here (None: it can). Checked before any process starts."""
        if self.running:
            return "a job is already running: Stop it first (one job at a time keeps the cores for it)"
        try:
            resolve_script(self.script.value)
            chosen = plan(self.nproc.value, self.backend.value)  # nccl without enough GPUs: ValueError
        except (ValueError, FileNotFoundError) as err:
            return str(err)
        return chosen.refusal  # e.g. more CPU ranks than cores: the same rule as launch()

    def accepted_options(self, timeout: float = 120) -> frozenset[str]:
        """The options the chosen script accepts (waits for the script's --help the first time)."""
        self._options_ready.wait(timeout)
        return self._options

    def command_args(self) -> list[str]:
        """Script arguments: run length (only flags the script has), then the extra args, which win."""
        options = self.accepted_options()
        args = []
        if self.epochs.value > 0 and "--epochs" in options:
            args += ["--epochs", str(self.epochs.value)]
        if self.max_steps.value > 0 and "--max-steps" in options:
            args += ["--max-steps", str(self.max_steps.value)]
        return args + shlex.split(self.extra.value)

    def _script_changed(self, _=None):
        # Grey out run-length fields the chosen script does not understand, rather than crash it. Asking
        # the script (python script.py --help) takes seconds the first time: a thread does it.
        script = self.script.value
        self._options_ready.clear()
        self.epochs.disabled = self.max_steps.disabled = True

        def ask():
            try:
                options = script_options(script)
            except (OSError, ValueError):
                options = frozenset()  # a missing script is refused, with the reason, at Launch
            if self.script.value != script:
                return  # changed meanwhile: the newer question answers
            self._options = options
            self.epochs.disabled = "--epochs" not in options
            self.max_steps.disabled = "--max-steps" not in options
            self._options_ready.set()

        threading.Thread(target=ask, daemon=True, name="course-script-options").start()

    # ------------------------------------------------------------------ buttons

    def on_launch(self, _=None):
        why_not = self.refusal()
        if why_not:
            self._set_status(f"refused: {why_not}", "#c62828")
            return
        script, nproc, backend = self.script.value, self.nproc.value, self.backend.value
        args = self.command_args()
        run_dir = self.run_dir() if "--run-dir" in self.accepted_options() else None
        with self._lock:
            self._lines, self._bar_rows, self._progress, self._dirty = [], {}, None, True
        self.progress.value, self.progress.bar_style, self.progress.description = 0, "", "progress"
        self.stop_event = threading.Event()
        self.launch_button.disabled, self.stop_button.disabled = True, False
        self._set_status(f"running {Path(script).name} on {nproc} process(es) ...", "#1565c0")
        self.thread = threading.Thread(target=self._run, args=(script, nproc, args, backend, run_dir),
                                       daemon=True, name="course-launcher")
        _live.add(self)
        self.thread.start()

    def on_stop(self, _=None):
        if self.running:
            self.stop_event.set()  # the launcher sees it within 0.1 s and ends every rank
            self._set_status("stopping: ending every process ...", "#e65100")

    def on_tensorboard(self, _=None):
        # The experiment folder (the run dir's parent), so every run of it is a curve to compare.
        from course.inline_tensorboard import show

        self.tb_out.clear_output()
        with self.tb_out:
            show(self.run_dir().parent)

    # ------------------------------------------------------------------ the job, in a background thread

    def _run(self, script, nproc, args, backend, run_dir):
        done = threading.Event()
        painter = threading.Thread(target=self._paint_until, args=(done,), daemon=True)
        painter.start()
        started = time.monotonic()
        try:
            result = launch(script, nproc, args, backend=backend, run_dir=run_dir, timeout=self.timeout,
                            on_line=self._feed, stop=self.stop_event)
            where = f"; run dir {_short(run_dir)}" if run_dir and run_dir.exists() else ""
            status, colour, bar = f"finished in {result.wall_time:.1f} s{where}", "#2e7d32", "success"
        except LaunchError as err:
            stopped = self.stop_event.is_set()
            status = "stopped: every process was ended" if stopped else f"failed: {str(err).splitlines()[0]}"
            colour, bar = ("#e65100", "warning") if stopped else ("#c62828", "danger")
        except Exception as err:  # noqa: BLE001 -- anything else must reach the user, not vanish in a thread
            status, colour, bar = f"error: {type(err).__name__}: {err}", "#c62828", "danger"
        done.set()
        painter.join()
        self._paint()  # the last lines
        self.progress.bar_style = bar
        self.launch_button.disabled, self.stop_button.disabled = False, True
        self._set_status(f"{status} (after {time.monotonic() - started:.0f} s)", colour)

    def _feed(self, chunk: str):
        """on_line callback: split into rank-tagged lines, collapse tqdm redraws, note rank 0 progress."""
        with self._lock:
            for tag, text in split_chunk(chunk):
                match = PROGRESS.search(text)
                key = (tag, match["desc"]) if match else None
                if key in self._bar_rows:
                    self._lines[self._bar_rows[key]] = (tag, text)  # redraw in place, as tqdm would
                else:
                    self._lines.append((tag, text))
                    if key:
                        self._bar_rows[key] = len(self._lines) - 1
                if match and tag == "rank0":
                    self._progress = (match["desc"] or "progress", int(match["n"]), int(match["total"]))
                steps = STEP.search(text) if not match and tag == "rank0" and self.max_steps.value > 0 else None
                if steps:  # a plain script's "step N: ..." line, against the steps asked for
                    self._progress = ("steps", int(steps["n"]), self.max_steps.value)
            if len(self._lines) > MAX_LINES:
                drop = len(self._lines) - MAX_LINES
                del self._lines[:drop]
                self._bar_rows = {k: row - drop for k, row in self._bar_rows.items() if row >= drop}
            self._dirty = True

    def _paint_until(self, done: threading.Event):
        while not done.wait(REFRESH_S):
            self._paint()

    def _paint(self):
        # Widget updates from a thread are plain comm messages: safe, and they show up without the
        # cell running. Output.append_stdout would resend the whole output on every line.
        with self._lock:
            if not self._dirty:
                return
            lines, progress, self._dirty = list(self._lines), self._progress, False
        self.output.value = _render(lines)
        if progress:
            desc, n, total = progress
            self.progress.description = desc[:16]
            self.progress.max, self.progress.value = max(total, 1), min(n, total)

    def _set_status(self, text: str, colour: str):
        self.status.value = f'<span style="color:{colour}">{html.escape(text)}</span>'

    def shutdown(self, wait: float = 15):
        """Stop the job (if any) and wait for its processes to end."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(wait)


def _render(lines) -> str:
    rows = []
    for tag, text in lines:
        colour = COLOURS[int(tag[4:]) % len(COLOURS)] if tag else "#757575"
        label = f"[{tag}]:" if tag else ""
        rows.append(f'<span style="color:{colour}">{html.escape(label + text)}</span>')
    # column-reverse keeps the box scrolled to the newest line while output arrives.
    return ('<div class="course-launcher-log" style="max-height:260px;overflow:auto;display:flex;'
            'flex-direction:column-reverse;border:1px solid #ddd;padding:2px 6px;background:#fafafa">'
            f'<pre style="margin:0;font-size:12px;line-height:1.3">{chr(10).join(rows) or "(no output yet)"}'
            '</pre></div>')


def _script_options(current) -> list[tuple[str, str]]:
    options = [(p.name, p.name) for p in sorted(SCRIPTS.glob("*.py"))]
    value = _script_value(current)
    if value not in {v for _, v in options}:
        options.append((_short(value), value))  # e.g. a test fixture elsewhere
    return options


def _script_value(script) -> str:
    """A course script by its name (as the dropdown lists it), anything else by its full path."""
    try:
        path = resolve_script(script)
    except FileNotFoundError:
        return str(script)  # refused, with the reason, when Launch is clicked
    return path.name if path.resolve().parent == SCRIPTS else str(path.resolve())


def _short(path) -> str:
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


@atexit.register
def _stop_all():
    # Ranks run in their own process session: a kernel shutdown would not reach them. This does.
    for panel in list(_live):
        panel.shutdown()
