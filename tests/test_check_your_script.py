"""Notebook 09b as a learner meets it (issue 44 item 2), with no headless run of its own: the patient fixed as the
doctor's report says gets a clean check and the next cells accept it; the model answer and its diff stay hidden
until asked for; the quiz asks only what can be predicted; section 2 quotes the doctor's first line as the doctor
writes it; 09b keeps the when/reach-for table and notebook 12 prints the computed tables (course.choose), stating
the tokens and shapes they assume and following their rule. The course's own run of 09b (the three findings) is
read in tests/test_doctor.py."""

import contextlib
import inspect
import io
import re
from pathlib import Path

import nbformat
import pytest

from course import ROOT, choose, quiz
from ddp_doctor.report import Finding, Report

NOTEBOOK = ROOT / "notebooks" / "09b_check_your_script.ipynb"
TWELVE = ROOT / "notebooks" / "12_composed_parallelism.ipynb"
THREE = ("set-epoch", "eval-one-shard", "rank-writes")


def cells(path=None) -> list:
    return nbformat.read(path or NOTEBOOK, as_version=4).cells


def code_cell(containing: str, path=None):
    path = path or NOTEBOOK
    found = [c for c in cells(path) if c.cell_type == "code" and containing in c.source]
    assert len(found) == 1, f"{path.name}: {len(found)} code cells contain {containing!r}"
    return found[0]


def run_cell(source: str, **names) -> str:
    """Execute one notebook cell's source in a namespace of ``names``; return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), dict(names))  # noqa: S102 - the notebook's own cell
    return out.getvalue()


def report(*codes: str) -> Report:
    return Report("doctor_patient.py", "2 processes", findings=[Finding(c, "seen", "evidence", "fix") for c in codes])


def learner_fix(patient: str) -> str:
    """The patient fixed as the doctor's three Fix lines say, nothing more (the model answer also makes the
    validation split exact; a learner on 2 processes need not)."""
    fixes = [("    for epoch in range(args.epochs):\n",
              "    for epoch in range(args.epochs):\n        sampler.set_epoch(epoch)\n"),
             ("        correct, total = evaluate(model.module, val_loader, device).tolist()\n",
              ("        counts = evaluate(model.module, val_loader, device)\n        dist.all_reduce(counts)\n"
               "        correct, total = counts.tolist()\n")),
             ("        torch.save(model.module.state_dict(), args.checkpoint)\n",
              "        if rank == 0:\n            torch.save(model.module.state_dict(), args.checkpoint)\n")]
    for old, new in fixes:
        assert patient.count(old) == 1, old
        patient = patient.replace(old, new)
    return patient


def test_the_check_cell_reports_the_course_run_the_learners_fix_and_what_is_left():
    after = code_cell('check("../scripts/doctor_patient_fixed.py"').source
    clean = lambda *args, **kwargs: report()  # the model answer's check, as the notebook's run makes it
    assert run_cell(after, check=clean, patient=report(*THREE)) == (
        "before the fixes: 3 mistake(s) (set-epoch, eval-one-shard, rank-writes); after: 0\n")
    assert "your patient: no mistake found" in run_cell(after, check=clean, patient=report())
    left = run_cell(after, check=clean, patient=report("rank-writes"))
    assert "1 mistake(s) left (rank-writes)" in left and "run it and the check again" in left
    with pytest.raises(AssertionError, match="the model answer"):
        run_cell(after, check=lambda *a, **k: report("eval-padding"), patient=report(*THREE))


def test_the_patient_fixed_as_the_report_says_checks_clean(tmp_path, datasets):
    """One launched doctor run (2 processes): the learner's fix, not the model answer, gets status 0, and the
    notebook's next cell then says so instead of failing."""
    from ddp_doctor import check

    source = code_cell("%%writefile ../scripts/doctor_patient.py").source
    script = tmp_path / "doctor_patient.py"
    script.write_text(learner_fix(source.split("\n", 1)[1]))
    mine = check(script, ["--epochs", "2"], cwd=tmp_path, folder=tmp_path / "doctor", show=False, timeout=150)
    assert mine.status == 0 and not mine.mistakes, mine.text()
    after = code_cell('check("../scripts/doctor_patient_fixed.py"').source
    assert "your patient: no mistake found" in run_cell(after, check=lambda *a, **k: report(), patient=mine)


def test_the_model_answer_and_its_diff_stay_hidden_until_asked(monkeypatch):
    from course.scriptdiff import ScriptDiff

    answer = code_cell("%%writefile ../scripts/doctor_patient_fixed.py")
    assert answer.metadata.get("jupyter", {}).get("source_hidden") is True
    diff_cell = code_cell("script_diff(").source
    shown = []
    monkeypatch.setattr(ScriptDiff, "show", lambda self: shown.append(self))
    from course.scriptdiff import script_diff

    printed = run_cell(diff_cell, script_diff=script_diff)
    assert not shown and "set SHOW_ANSWER = True" in printed
    run_cell(diff_cell.replace("SHOW_ANSWER = False", "SHOW_ANSWER = True"), script_diff=script_diff)
    assert len(shown) == 1 and shown[0].steps == {1, 2, 3}


def test_the_doctors_fixes_stay_hidden_until_asked():
    """Review T5: 09b's check showed each fix word for word, so the task was transcription. The check cell now
    passes fixes=SHOW_FIXES (False as committed): the evidence and the lesson show, the fix does not, in the
    notebook's table and in text; True shows them."""
    from ddp_doctor.report import HIDDEN

    cell = code_cell('check("../scripts/doctor_patient.py"').source
    calls = []
    run_cell(cell, check=lambda *a, **k: calls.append(k))
    assert calls == [{"cwd": "..", "fixes": False}]
    run_cell(cell.replace("SHOW_FIXES = False", "SHOW_FIXES = True"), check=lambda *a, **k: calls.append(k))
    assert calls[-1]["fixes"] is True
    finding = Finding("set-epoch", "the same order every epoch", "rank 0: epochs 0 and 1 equal",
                      "call sampler.set_epoch(epoch)")
    shown = Report("doctor_patient.py", "2 processes", findings=[finding])
    for hidden, full in ((shown.html(False), shown.html()), (shown.text(False), shown.text())):
        assert "set_epoch" not in hidden and "epochs 0 and 1 equal" in hidden and "notebook 04" in hidden
        assert "fixes=True" in hidden and "call sampler.set_epoch(epoch)" in full
    assert HIDDEN not in shown.text()


def test_the_quiz_asks_numbers_a_learner_can_predict_and_its_key_passes(monkeypatch):
    """Question 1 once asked for a finding code that no output of 09b shows; every answer is now a number or a
    yes/no, checked against what the cell computes."""
    assert all(isinstance(v, (bool, int, float)) for v in quiz.key("09b").values()), quiz.key("09b")
    check_cell = code_cell('quiz.answers("09b"').source
    monkeypatch.setenv("COURSE_ANSWER_KEY", "1")
    printed = run_cell(check_cell, layouts=choose.layouts, **dict.fromkeys(quiz.key("09b")))
    assert printed.startswith("PASS: 1004 samples counted for 1001 (padding: 3 counted twice)"), printed
    monkeypatch.delenv("COURSE_ANSWER_KEY")
    wrong = {**quiz.key("09b"), "TWICE": 0}
    assert "Not yet: question 1: the sampler pads" in run_cell(check_cell, layouts=choose.layouts, **wrong)


def printed_layouts(path, cell_marker: str) -> tuple[dict, str]:
    """Run a notebook's choose cell with ``layouts`` recorded: ({(psi, gpu_gb, gpus_per_node, nodes): rows}, text)."""
    seen = {}
    signature = inspect.signature(choose.layouts)

    def recorded(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        rows = choose.layouts(*args, **kwargs)
        key = tuple(bound.arguments[k] for k in ("psi", "gpu_gb", "gpus_per_node", "nodes"))
        seen[key] = rows
        return rows

    source = "\n".join(line for line in code_cell(cell_marker, path).source.splitlines()
                       if not line.startswith(("from ", "import ", "show_published")))
    names = {name: getattr(choose, name) for name in ("SHAPES", "TOKENS", "table")}
    return seen, run_cell(source, layouts=recorded, show_published=lambda name: None, **names)


def test_09b_keeps_the_when_table_and_12_prints_the_computed_tables_by_their_rule():
    """Issue 52: 09b, the end of the core path, keeps its when/reach-for table; the computed HSDP/TP/PP tables are
    notebook 12's. 12's printout states the tokens and shapes it assumes, and each pick follows course.choose.RULE."""
    assert not [c for c in cells() if c.cell_type == "code" and ("table(" in c.source or "widget(" in c.source)]
    markdown = "\n".join(c.source for c in cells() if c.cell_type == "markdown")
    assert "| when | reach for | what it costs | deep dive |" in markdown
    assert "sends only activations (and, backward, their gradients)" in markdown  # audit N6-20: choose.pp_bytes
    twelve, text = printed_layouts(TWELVE, "table(layouts(")
    assert (70e9, 80, 8, 16) in twelve
    assert text.count(f"{choose.TOKENS} tokens per GPU per step") == len(twelve) == text.count("the rule: ")
    for (psi, *_), rows in twelve.items():
        layers, width = choose.SHAPES[psi]
        assert f"({layers} blocks of width {width})" in text
        best = choose.pick(rows)
        fitting = [r for r in rows if r.fits and not r.same_as]
        assert best.inter_bytes == min(r.inter_bytes for r in fitting if not r.bubble)  # no pipeline: others fit
        assert not best.bubble and not best.same_as  # every cluster printed has a layout without a bubble
    twelve_markdown = "\n".join(c.source for c in cells(TWELVE) if c.cell_type == "markdown")
    assert "a pipeline only when nothing else fits" in twelve_markdown and "a pipeline only when nothing else fits" in (
        choose.RULE)


def test_a_fused_qkv_halves_tp_backward_and_the_step_sends_two_thirds():
    """Audit N6-2: 09b said a fused qkv makes "the backward send 2/3". Per block the backward all-reduces once per
    column-parallel input (4 with q, k, v and fc; 2 fused), the forward twice either way: the backward halves, the
    step's total becomes 2/3. Any notebook that states the ratio says that."""
    from course.comm_count import predict_block

    separate = predict_block(1024, 64, sequence_parallel=False)
    fused = predict_block(1024, 64, sequence_parallel=False, column_inputs=2)
    assert fused["backward"]["all-reduce"][1] * 2 == separate["backward"]["all-reduce"][1]
    assert fused["forward"] == separate["forward"]
    total = {k: sum(b for phase in block.values() for _, b in phase.values()) for k, block in
             (("separate", separate), ("fused", fused))}
    assert total["fused"] * 3 == total["separate"] * 2
    for path in sorted((TWELVE.parent).glob("*.ipynb")):
        for cell in cells(path):
            if cell.cell_type == "markdown" and "fused qkv the backward sends" in cell.source:
                assert "the backward sends half as much, so the step sends 2/3" in cell.source, path.name


def test_section_2_quotes_the_doctors_first_line_for_each_way_it_runs_a_script():
    """Issue 56 item 4: 09b says what a learner's own script will meet: the launch modes (torchrun, simulated nodes,
    a script that starts its own processes, --local_rank) and the CPU stand-in for CUDA scripts. Each phrase 09b
    quotes is in the first line the doctor writes for such a run (diagnose and _how_it_ran on a run that recorded
    no rank, so nothing is launched here)."""
    from ddp_doctor.doctor import _how_it_ran, diagnose
    from ddp_doctor.running import Job, Run

    first_lines = []
    for launch, nodes, arg in (("torchrun", 2, ""), ("torchrun", 1, ""), ("spawn", 1, "--local_rank")):
        job = Job(Path("/tmp/train.py"), [], nproc=2, nodes=nodes, cwd=Path("/tmp"), launch=launch,
                  local_rank_arg=arg)
        run = Run(job, 0, "", {}, {}, 1.0, parent={"standin": ["train.py:3", "train.py:9"]})
        shown = diagnose(run)
        _how_it_ran(run, shown)
        first_lines.append(shown.text().splitlines()[0].replace("`", ""))
    section = next(c.source for c in cells() if "**What your script will meet.**" in c.source)
    bullets = section.split("**What your script will meet.**")[1].split("\n\n")[0].splitlines()[1:]
    quoted = [q for b in bullets for q in re.findall(r"`([^`]+)`:", b)]  # each phrase quoted, then what it means
    assert len(bullets) == 4 and len(quoted) == 5, bullets
    for phrase in quoted:
        assert any(phrase.replace(" N ", " 2 ") in line for line in first_lines), (phrase, first_lines)


def test_09b_names_cells_by_what_they_hold_and_promises_no_outcome():
    """Audit N6-9 and design note 5: "your own fixed patient gets the same clean check" was a promise, and "(cell 5)"
    a 0-based index JupyterLab does not show. The summary now points at the cell that prints the patient's state."""
    text = "\n".join(c.source for c in cells())
    assert not re.search(r"\bcells? \d", text), re.search(r"\bcells? \d", text)
    assert "gets the same clean check" not in text and "同样干净的结果" not in text
    summary = next(c.source for c in cells() if c.source.startswith("## Summary"))
    assert "the check cell below the model answer printed how your own patient stands" in summary
    check_cell = code_cell('check("../scripts/doctor_patient_fixed.py"').source
    assert "your patient:" in check_cell  # that cell prints it


@pytest.mark.parametrize("psi", [125e6, 1e9, 7e9, 30e9, 70e9])
@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_choose_takes_hsdp_only_across_nodes_and_a_pipeline_only_when_nothing_else_fits(psi, gpus_per_node):
    one = choose.layouts(psi, 80, gpus_per_node, 1)
    best = choose.pick(one)
    assert best is None or best.name != "HSDP"
    hsdp = next(r for r in one if r.name == "HSDP")
    assert hsdp.same_as == "FSDP2" and "same as FSDP2" in hsdp.note
    for nodes in (1, 2, 16):
        rows = choose.layouts(psi, 80, gpus_per_node, nodes)
        best = choose.pick(rows)
        if best is not None and best.bubble:
            assert not [r for r in rows if r.fits and not r.bubble and not r.same_as]
    assert choose.pick(choose.layouts(7e9, 80, 8, 1)).name == "FSDP2"  # audit D-5: was HSDP (1 x 8), a tie-break
    assert choose.pick(choose.layouts(7e9, 80, 8, 4)).name == "HSDP"  # across nodes it is the pick
