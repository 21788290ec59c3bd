"""The run directory (ddp_doctor.rundir, course.rundir, course.launcher.rundir): one live run at a time, claimed atomically;
a run's results replace the previous ones only when it succeeds."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from course import ROOT
from course.launcher import LaunchError, launch
from course.rundir import RunDirBusy, claim_run_dir

# Each claimant tries every round at the same instant, reports whether it won, and holds what it won until
# every claimant has said it tried (a marker file each), so a second winner cannot be one that came after a
# release, however late a loaded machine runs a claimant.
CLAIMANT = """
import sys, time
from pathlib import Path
from course.rundir import RunDirBusy, claim_run_dir
base, t0, rounds, period = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
me, claimants = sys.argv[5], int(sys.argv[6])
for r in range(rounds):
    start = t0 + r * period
    while time.time() < start:
        pass
    try:
        claim = claim_run_dir(base / f"round{r}")
        print(f"{r} won", flush=True)
    except RunDirBusy:
        claim = None
        print(f"{r} busy", flush=True)
    (base / f"tried{r}_{me}").touch()
    if claim:
        deadline = time.time() + 30
        while len(list(base.glob(f"tried{r}_*"))) < claimants and time.time() < deadline:
            time.sleep(0.005)
        claim.release()
"""


def test_simultaneous_claims_have_exactly_one_winner(tmp_path):
    """Issue 21 #1: the old claim (an O_EXCL create, its owner written after) had two winners in some rounds."""
    claimants, rounds, period = 4, 120, 0.1  # the old claim had two winners in about 8 of 100 such rounds
    t0 = time.time() + 3  # every claimant has started and imported by then
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMANT, str(tmp_path), repr(t0), str(rounds), str(period),
                               str(me), str(claimants)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for me in range(claimants)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    winners = {r: 0 for r in range(rounds)}
    for output in outputs:
        for line in output.splitlines():
            r, what = line.split()
            winners[int(r)] += what == "won"
    assert list(winners.values()) == [1] * rounds, winners


def test_a_live_claim_is_refused_naming_its_owner_and_a_dead_ones_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", ("import sys, time\nfrom course.rundir import claim_run_dir\n"
                               "c = claim_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)"), str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert (tmp_path / ".lock").read_text().endswith(f" {holder.pid}")  # the owner is in it from the start
        with pytest.raises(RunDirBusy, match=f"in use by a live run .* {holder.pid}\\)"):
            claim_run_dir(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".lock").exists()  # left behind by the killed owner
    with claim_run_dir(tmp_path):
        assert (tmp_path / ".lock").read_text().endswith(f" {os.getpid()}")
    assert not (tmp_path / ".lock").exists() and not list(tmp_path.glob(".lock.*"))


WRITER = """
import argparse, os, sys
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("--run-dir", type=Path)
p.add_argument("--tag")
p.add_argument("--fail", action="store_true")
p.add_argument("--resume", action="store_true")
a = p.parse_args()
print("staged", os.environ.get("COURSE_STAGED"), "into", a.run_dir.name, "holding", sorted(x.name for x in a.run_dir.iterdir()))
(a.run_dir / f"events.out.tfevents.{a.tag}").write_text(a.tag)
(a.run_dir / "note.txt").write_text(a.tag)
if a.fail:
    sys.exit("failing on purpose")
(a.run_dir / "metrics.json").write_text('{"tag": "%s"}' % a.tag)
"""


def test_the_launcher_publishes_a_run_only_when_it_succeeds(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    run_dir = tmp_path / "run"
    shown = []
    first = launch(script, 1, ["--tag", "first"], run_dir=run_dir, timeout=120, on_line=shown.append)
    assert first.metrics == {"tag": "first"} and "staged 1 into in_progress holding []" in "".join(shown)
    assert sorted(p.name for p in run_dir.iterdir()) == ["events.out.tfevents.first", "metrics.json", "note.txt"]
    with pytest.raises(LaunchError):
        launch(script, 1, ["--tag", "second", "--fail"], run_dir=run_dir, timeout=120, on_line=shown.append)
    assert json.loads((run_dir / "metrics.json").read_text()) == {"tag": "first"}  # untouched
    assert (run_dir / "note.txt").read_text() == "first" and not (run_dir / ".lock").exists()
    shown.clear()
    resumed = launch(script, 1, ["--tag", "third", "--resume"], run_dir=run_dir, timeout=120, on_line=shown.append)
    assert "holding ['events.out.tfevents.second', 'note.txt']" in "".join(shown)  # the crashed run's, kept
    assert resumed.metrics == {"tag": "third"}
    assert sorted(p.name for p in run_dir.glob("events.*")) == ["events.out.tfevents.second", "events.out.tfevents.third"]
    shown.clear()
    launch(script, 1, ["--tag", "fourth", "--resume"], run_dir=run_dir, timeout=120, on_line=shown.append)
    assert "holding ['events.out.tfevents.second', 'events.out.tfevents.third']" in "".join(shown)  # finished: copied
    launch(script, 1, ["--tag", "fifth"], run_dir=run_dir, timeout=120, on_line=shown.append)
    assert sorted(p.name for p in run_dir.iterdir()) == ["events.out.tfevents.fifth", "metrics.json", "note.txt"]


def test_a_launch_into_a_claimed_run_directory_is_refused_before_it_starts(tmp_path):
    with claim_run_dir(tmp_path / "run"), pytest.raises(RunDirBusy, match="in use by a live run"):
        launch("hello_distributed.py", 1, run_dir=tmp_path / "run", timeout=60)


def test_runlog_claims_and_stages_by_itself_but_writes_straight_under_the_launcher(tmp_path, monkeypatch):
    from course.runlog import RunLog

    monkeypatch.delenv("COURSE_STAGED", raising=False)
    log = RunLog(tmp_path / "plain", world_size=1)  # plain torchrun: its own claim and staging
    with pytest.raises(RunDirBusy):
        claim_run_dir(tmp_path / "plain")
    assert list((tmp_path / "plain" / "in_progress").glob("events.*"))
    log.finish(done=True)
    assert json.loads((tmp_path / "plain" / "metrics.json").read_text())["done"] is True
    published = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert published[0].startswith("events.out.tfevents.") and published[1:] == ["metrics.json"]  # no lock left
    monkeypatch.setenv("COURSE_STAGED", "1")
    with claim_run_dir(tmp_path / "staged"):  # the launcher holds it
        log = RunLog(tmp_path / "staged" / "in_progress", world_size=1)
        log.finish(done=True)
    written = sorted(p.name for p in (tmp_path / "staged" / "in_progress").iterdir())
    assert written[0].startswith("events.out.tfevents.") and written[1:] == ["metrics.json"]  # straight there
