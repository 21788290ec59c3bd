"""Notebooks: committed clean, the source of scripts/*.py, and executed headless (quick mode) without error."""

import re

import nbformat
import pytest
from conftest import executed_notebook, notebook_scripts, notebooks_that_clash

from course import ROOT, SCRIPTS

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def written_scripts() -> dict[str, tuple[str, str]]:
    """{script name: (notebook name, exact text %%writefile writes)} over all notebooks."""
    found = {}
    for path in NOTEBOOKS:
        for name, text in notebook_scripts(path)[0].items():
            assert name not in found, f"{name} is written by two notebooks"
            found[name] = (path.name, text)
    return found


def test_course_has_its_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS][:4] == ["00", "01", "02", "03"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} carries outputs"


def test_every_glossary_link_has_its_entry():
    glossary = (ROOT / "notebooks" / "glossary.md").read_text()
    entries = set(re.findall(r'<a id="([^"]+)"></a>', glossary))
    links = {(p.name, slug) for p in [*NOTEBOOKS, ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
             for slug in re.findall(r"glossary\.md#([\w-]+)", p.read_text())}
    links |= {("glossary.md", slug) for slug in re.findall(r"\]\(#([\w-]+)\)", glossary)}
    assert len(entries) > 60 and not {(name, slug) for name, slug in links if slug not in entries | {"slug"}}


def test_committed_scripts_equal_what_the_notebooks_write():
    written = written_scripts()
    assert {"hello_distributed.py", "train_single.py", "train_ddp.py"} <= set(written)
    for name, (notebook, text) in written.items():
        assert (SCRIPTS / name).read_text() == text, f"scripts/{name} differs from what {notebook} writes"
    for path in SCRIPTS.glob("*.py"):
        assert path.name in written, f"scripts/{path.name} is not written by any notebook"


def test_notebooks_that_share_a_script_or_a_chapter_never_run_at_once():
    """The suite runs notebooks two at a time (conftest): not one that launches a script while another writes it,
    nor two of one chapter (they share its runs folder)."""
    clash = notebooks_that_clash([p.stem for p in NOTEBOOKS])
    assert frozenset(("01_single_device", "03_ddp_five_steps")) in clash  # 03 launches train_single.py
    assert frozenset(("03_ddp_five_steps", "06_multinode_and_faults")) in clash  # 06 launches train_ddp.py
    assert frozenset(("04_pitfalls", "04b_pitfalls_reference")) in clash
    assert frozenset(("00_environment", "07_capstone_flowers")) not in clash


def test_scripts_and_tests_pass_ruff():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", str(SCRIPTS), str(ROOT / "tests")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_headless(path, datasets):
    """Run the notebook as `make course` does (quick mode, Check yourself answered from its key); any cell that
    raises fails the test, a key that no longer passes too. The run is shared: tests of a notebook's proofs read
    what this same run wrote (conftest.executed_notebook) instead of launching its scripts again."""
    run = executed_notebook(path.stem)
    assert run.ok, run.error[-4000:]
    executed = nbformat.read(run.executed, as_version=4)
    for cell in executed.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", f"error output in {path.name}"
        if "skips-in-quick" in cell.metadata.get("tags", []):  # says so, in one line, and why
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            assert text.startswith("skipped in quick mode: ") and text.count("\n") == 1, text
    print(f"{path.name}: {run.seconds:.0f} s")
