"""Start JupyterLab on the course: ``python -m course.lab`` (what ``make lab`` runs).

Lab listens on 127.0.0.1 only, with a fresh random token, and opens notebook 00. The browser
tests start their server with the same ``start_lab`` function, so what they test is what you run.
Ctrl+C, ``kill`` and closing the terminal (SIGINT, SIGTERM, SIGHUP) end Lab, its kernels and their
runs, and remove Lab's temporary folder; if this helper is killed outright (SIGKILL), a watchdog
process does the same.
"""

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import webbrowser
from pathlib import Path

from course import ROOT
from course.launcher import free_port, start_watchdog

FIRST_NOTEBOOK = "notebooks/00_environment.ipynb"
# The "get official Jupyter news?" toast: it asks to go online, which this course never needs.
NO_NEWS = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}


def lab_url(port: int, token: str, path: str = FIRST_NOTEBOOK, workspace: str | None = None) -> str:
    """The URL that opens ``path`` in Lab; a named ``workspace`` starts from a clean layout (?reset)."""
    prefix = f"/lab/workspaces/{workspace}" if workspace else "/lab"
    query = f"?reset&token={token}" if workspace else f"?token={token}"
    return f"http://127.0.0.1:{port}{prefix}/tree/{path}{query}"


def start_lab(root=ROOT, port: int | None = None, token: str | None = None, *, isolated: bool = False,
              state_dir=None, settings: dict | None = None, env: dict | None = None, log=None,
              timeout: float = 90):
    """Start ``jupyter lab`` serving ``root`` on 127.0.0.1 and wait until it answers.

    Returns ``(base_url, token, process)``; stop it with ``stop_lab``.
    state_dir: this server's own files (page config, runtime files; default: a new temporary folder).
    isolated: keep user settings and workspaces in state_dir too, not in ~/.jupyter/lab, so that a
      test starts from a clean slate and leaves nothing behind. settings: user settings to start
      from (isolated only), e.g. ``{"@jupyterlab/docmanager-extension:plugin": {"autosave": False}}``.
    """
    port = port or free_port()
    token = token or secrets.token_hex(24)
    state = Path(state_dir or tempfile.mkdtemp(prefix="course-lab-"))
    # Page config (the news toast off) goes into a config folder of our own, put first on
    # JUPYTER_CONFIG_PATH: no `jupyter labextension disable`, nothing written outside state_dir.
    (state / "config" / "labconfig").mkdir(parents=True, exist_ok=True)
    (state / "config" / "labconfig" / "page_config.json").write_text(json.dumps(NO_NEWS))
    config_path = os.pathsep.join(filter(None, [str(state / "config"), os.environ.get("JUPYTER_CONFIG_PATH")]))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}"]
    if isolated:
        cmd += [f"--LabApp.user_settings_dir={state / 'settings'}", f"--LabApp.workspaces_dir={state / 'workspaces'}"]
        for plugin, values in (settings or {}).items():
            package, name = plugin.split(":")
            path = state / "settings" / package / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
    elif settings:
        raise ValueError("settings are only applied to an isolated Lab (isolated=True)")
    if os.geteuid() == 0:  # Jupyter refuses to run as root without it (containers, CI)
        cmd.append("--allow-root")
    # The token travels in the environment, not on the command line where `ps` would show it.
    lab_env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTER_CONFIG_PATH": config_path,
               "JUPYTER_RUNTIME_DIR": str(state / "runtime"), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=root, env=lab_env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT if log else None, start_new_session=True)
    proc.state_dir = state  # so stop_lab can remove it (only the temporary folder made here)
    proc.remove_state = state_dir is None
    # Lab has its own session: if this process dies without stop_lab (SIGKILL), the watchdog ends it.
    start_watchdog([proc.pid], remove=[state] if proc.remove_state else [])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with code {proc.returncode} before answering on {base}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    return base, token, proc
            except OSError:
                time.sleep(0.5)
    except BaseException:  # a signal or Ctrl+C while Lab starts: do not leave it half-started
        stop_lab(proc)
        raise
    stop_lab(proc)
    raise RuntimeError(f"jupyter lab did not answer on {base} within {timeout:.0f} s")


def stop_lab(proc: subprocess.Popen) -> int:
    """End Lab with its kernels and everything they started; returns how many processes were ended."""
    from course.launcher import kill_tree

    ended = kill_tree(proc.pid)
    state = getattr(proc, "state_dir", None)
    if state and getattr(proc, "remove_state", False):  # only the temporary folder start_lab made
        shutil.rmtree(state, ignore_errors=True)
    return ended


class Stopped(Exception):
    """A signal (Ctrl+C, kill, a closing terminal) asked the helper to stop."""


STOP_SIGNALS = [sig for sig in (getattr(signal, "SIGHUP", None), signal.SIGTERM, signal.SIGINT) if sig]


def _stop(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


def install_stop_handlers() -> None:
    """SIGHUP (the terminal closed), SIGTERM (kill) and SIGINT (Ctrl+C) raise Stopped in the main thread,
    so that main's ``finally`` ends Lab. (Lab runs in its own session: a closing terminal does not reach it.)"""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Start JupyterLab on the course notebooks (127.0.0.1 only).")
    parser.add_argument("--port", type=int, default=8888, help="preferred port (another free one if taken)")
    parser.add_argument("--no-browser", action="store_true", help="only print the URL")
    args = parser.parse_args(argv)
    install_stop_handlers()
    proc = None
    try:
        base, token, proc = start_lab(port=free_port(args.port))
        url = lab_url(int(base.rsplit(":", 1)[1]), token)
        _say(f"\nJupyterLab is running. Open this URL (it carries the login token):\n\n    {url}\n\n"
             "Press Ctrl+C to stop it (its kernels and their runs stop too).\n")
        if not args.no_browser:
            webbrowser.open(url)
        proc.wait()
    except (Stopped, KeyboardInterrupt) as why:
        _say(f"\nstopping JupyterLab ({why or 'Ctrl+C'}) ...")
    finally:
        for sig in STOP_SIGNALS:  # a second Ctrl+C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None:
            stop_lab(proc)


def _say(text: str) -> None:
    try:
        print(text, flush=True)
    except OSError:  # the terminal is gone (SIGHUP): nobody to tell
        pass


if __name__ == "__main__":
    main()
