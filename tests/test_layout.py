"""The helper packages' layout (issue 22; issue 53: the take-home doctor, ddp_doctor, too): one job per module, said
in its docstring, and no module over 350 lines."""

import ast

from course import SCRIPTS

MODULES = sorted(p for package in ("course", "ddp_doctor") for p in (SCRIPTS / package).rglob("*.py")
                 if "build" not in p.relative_to(SCRIPTS).parts)


def test_every_course_module_is_small_and_says_its_job():
    assert len(MODULES) > 40
    too_long = {str(p.relative_to(SCRIPTS)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 350}
    assert not too_long, f"modules over 350 lines: {too_long}"
    silent = [str(p.relative_to(SCRIPTS)) for p in MODULES
              if "solutions" not in p.parts and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent, f"modules without a docstring saying their job: {silent}"
