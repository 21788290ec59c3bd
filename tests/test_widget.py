"""The launcher widget without a browser: refusals, a live 2-rank run, Stop leaves no process behind."""
import html
import re
import time
from pathlib import Path

import pytest
from conftest import processes_with, wait_until

from course.widget import launcher_widget

FIXTURE = Path(__file__).parent / "fixtures" / "slow_ranks.py"
pytestmark = pytest.mark.timeout(120)


def fixture_processes() -> list:
    return processes_with(FIXTURE.name)


def text_of(panel) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", panel.output.value))


@pytest.fixture
def panel(tmp_path):
    panel = launcher_widget(str(FIXTURE), nproc=2, run_dir=tmp_path / "run", max_steps=400,
                            args="--step-seconds 0.1")
    yield panel
    panel.shutdown()  # whatever a test left running


def test_controls(panel):
    assert panel.script.value == str(FIXTURE)
    assert "train_ddp.py" in [value for _, value in panel.script.options]  # every scripts/*.py is offered
    assert panel.nproc.value == 2 and panel.backend.value == "auto"
    assert {"--epochs", "--max-steps", "--run-dir"} <= panel.accepted_options()  # asked of the script
    assert not panel.epochs.disabled and not panel.max_steps.disabled  # the fixture has both flags
    assert panel.command_args() == ["--epochs", "1", "--max-steps", "400", "--step-seconds", "0.1"]
    assert panel.stop_button.disabled and not panel.launch_button.disabled


def test_output_is_split_by_rank_and_tqdm_redraws_collapse(panel):
    # What torchrun --tee really delivers (seen on this machine): tqdm's "\r" redraws arrive as
    # fragments, and another rank's line can be glued to rank 0's unfinished one.
    for chunk in ["[rank0]:\n", "[rank0]:epoch 1:   0%|          | 0/12 [00:00<?, ?it/s][rank0]:\n",
                  "[rank0]:epoch 1:  75%|███████▌  | 9/12 [00:01<00:00,  4.96it/s][rank1]:rank 1: epoch 1 done\n",
                  "[launcher] exit code 0 after 7.1 s\n"]:
        panel._feed(chunk)
    panel._paint()
    assert text_of(panel).splitlines() == [
        "[rank0]:epoch 1:  75%|███████▌  | 9/12 [00:01<00:00,  4.96it/s]",
        "[rank1]:rank 1: epoch 1 done",
        "[launcher] exit code 0 after 7.1 s",
    ]
    assert (panel.progress.value, panel.progress.max, panel.progress.description) == (9, 12, "epoch 1")


def test_refuses_nccl_without_gpus(panel):
    from course.hardware import accelerator_count

    if accelerator_count() >= 2:
        pytest.skip("this machine has 2 GPUs: nccl is valid here")
    panel.backend.value = "nccl"
    panel.launch_button.click()
    assert "refused" in panel.status.value and "nccl needs one GPU per process" in panel.status.value
    assert panel.thread is None and not fixture_processes()


def test_refuses_more_cpu_ranks_than_cores(panel):
    from course.hardware import cpu_cores

    panel.backend.value = "gloo"  # on CPU even where there are GPUs
    panel.nproc.value = cpu_cores() + 1
    panel.launch_button.click()
    assert "refused" in panel.status.value and f"{cpu_cores()} CPU cores" in panel.status.value
    assert panel.thread is None and not fixture_processes()


def test_launch_progress_stop_no_orphans(panel):
    assert not fixture_processes(), "fixture processes left over from something else"
    start = time.monotonic()
    panel.launch_button.click()
    assert panel.running and panel.launch_button.disabled and not panel.stop_button.disabled

    panel.launch_button.click()  # a second Launch while running is refused, the run goes on
    assert "already running" in panel.status.value and panel.running

    wait_until(lambda: panel.progress.value >= 5, 60, "rank 0's progress bar to move")
    assert panel.progress.max == 400 and panel.progress.description == "epoch 1"
    output = text_of(panel)
    assert "[rank0]:" in output and "[rank1]:" in output, output
    assert len(fixture_processes()) >= 3  # torchrun + 2 ranks

    panel.stop_button.click()
    wait_until(lambda: not panel.running, 20, "the launch thread to end after Stop")
    wait_until(lambda: not fixture_processes(), 5, "every fixture process to end")
    assert "stopped" in panel.status.value
    assert "stopped: ended" in text_of(panel)
    assert panel.progress.bar_style == "warning" and panel.progress.value < 400
    assert not panel.launch_button.disabled and panel.stop_button.disabled
    print(f"launch -> stopped, no orphans: {time.monotonic() - start:.1f} s")


def test_full_run_finishes(tmp_path):
    panel = launcher_widget(str(FIXTURE), nproc=2, run_dir=tmp_path / "run", max_steps=20,
                            args="--step-seconds 0.05")
    panel.launch_button.click()
    wait_until(lambda: not panel.running, 90, "the run to finish")
    assert "finished" in panel.status.value, panel.status.value
    assert panel.progress.value == panel.progress.max == 20 and panel.progress.bar_style == "success"
    # tqdm redraws one line in place: the log keeps one progress line per epoch, not one per redraw
    assert len(re.findall(r"epoch 1: +\d+%", text_of(panel))) == 1
    assert not fixture_processes()


def test_options_come_from_the_scripts_parser(tmp_path):
    """Not from its source text: a flag named only in a docstring is not an option, and a script without
    an argument parser is not run just to ask (it would start working)."""
    from course.widget import script_options

    mentions = tmp_path / "mentions.py"
    mentions.write_text('"""Unlike train_ddp.py, this has no --max-steps."""\nimport argparse\n\n'
                        'parser = argparse.ArgumentParser()\nparser.add_argument("-e", "--epochs", type=int, '
                        'help="like --max-steps, but whole epochs")\nparser.parse_args()\n')
    plain = tmp_path / "plain.py"
    plain.write_text('"""Trains at once; knows no --epochs."""\nopen(__file__ + ".ran", "w").close()\n')
    panel = launcher_widget(str(mentions), nproc=1)
    assert panel.accepted_options() == {"--epochs", "--help"} == script_options(mentions)
    assert not panel.epochs.disabled and panel.max_steps.disabled
    panel.max_steps.value = 5
    assert panel.command_args() == ["--epochs", "1"]
    assert script_options(plain) == frozenset() and not (tmp_path / "plain.py.ran").exists()
