"""The course's text stays readable in a sitting: the markdown of notebooks 00-09 (04b included) holds at most
22,000 words, counted by splitting on whitespace (issue 19: say each thing once, link to the glossary after)."""

import nbformat

from course import ROOT

LIMIT = 22_000


def markdown_words(path) -> int:
    return sum(len(cell.source.split()) for cell in nbformat.read(path, as_version=4).cells
               if cell.cell_type == "markdown")


def test_markdown_of_notebooks_00_to_09_stays_under_the_word_limit():
    paths = sorted(p for p in (ROOT / "notebooks").glob("0[0-9]*.ipynb"))
    assert [p.name[:2] for p in paths][:2] == ["00", "01"] and paths[-1].name.startswith("09")
    counts = {p.name: markdown_words(p) for p in paths}
    total = sum(counts.values())
    print(f"markdown words in notebooks 00-09: {total} (limit {LIMIT}); "
          + ", ".join(f"{name[:3].rstrip('_')} {n}" for name, n in counts.items()))
    assert total <= LIMIT, f"{total} words of markdown in notebooks 00-09, more than {LIMIT}: {counts}"
