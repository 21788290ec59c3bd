"""Chinese beside English (issue 36 item 1): each notebook's header card and closing summary have a Chinese version
directly below them, and the Chinese text names terms as the glossary renders them.

- A Chinese cell is a markdown cell whose first line contains 中文 (``test_course_text.is_chinese``). A notebook's
  header is its first cell, its summary the markdown cell with a line ``## Summary``; each has exactly one Chinese
  cell right after it, and the notebook has no other.
- The Chinese header's ``**时间：**`` line is ``course.times.header_line_zh`` of the notebook's entry in
  ``notebooks/times.json``: the figures of its English ``**Time:**`` line (``python -m course.times`` rewrites both).
- A glossary link ``[text](…glossary.md#slug)`` in a Chinese cell or in the README's ``## 中文简介`` section has as its
  text one of the entry's renderings: the text after ``中文：`` in glossary.md is split on ``；``, ``、`` and ``/``,
  and each piece counts as written or without its parenthesised notes （…）: ``（弹性）代理进程`` allows itself and
  ``代理进程``; ``gloo（不译）`` allows ``gloo``. A link is the first use of its text in its cell (headings aside):
  the term is linked where the reader first meets it.
"""

import re

import nbformat
import pytest
from test_course_text import is_chinese

from course import ROOT, times

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GLOSSARY = ROOT / "notebooks" / "glossary.md"
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]*glossary\.md)#([\w-]+)\)")
ANY_LINK = re.compile(r"\[[^\]]*\]\([^)]*\)")
SUMMARY = re.compile(r"^## Summary\s*$", re.MULTILINE)


def renderings(glossary: str) -> dict[str, set[str]]:
    """{slug: the link texts its ``中文：`` line allows}."""
    found = {}
    parts = re.split(r'<a id="([^"]+)"></a>', glossary)
    for slug, body in zip(parts[1::2], parts[2::2], strict=True):
        line = re.search(r"中文：(.+)", body)
        pieces = re.split(r"[；、/]", line[1]) if line else []
        found[slug] = {text for piece in pieces for text in (piece.strip(), re.sub(r"（[^（）]*）", "", piece).strip())
                       if text}
    return found


def link_problems(text: str, allowed: dict[str, set[str]]) -> list[str]:
    """What is wrong with the glossary links of one Chinese cell (or section)."""
    problems = []
    prose = "\n".join(" " * len(line) if line.startswith("#") else line for line in text.split("\n"))  # headings blank
    for link in LINK.finditer(text):
        label, slug = link[1], link[3]
        if slug not in allowed:
            problems.append(f"[{label}](#{slug}): no such glossary entry")
        elif label not in allowed[slug]:
            problems.append(f"[{label}](#{slug}): the glossary renders it as {' or '.join(sorted(allowed[slug]))}")
        elif label in ANY_LINK.sub("", prose[:link.start()]):
            problems.append(f"[{label}](#{slug}): {label} is used before its link")
    return problems


def place_problems(cells) -> list[str]:
    """Where the notebook's Chinese cells are missing or extra: one right after the header, one after the summary."""
    summary = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and not is_chinese(c)
               and SUMMARY.search(c.source)]
    if len(summary) != 1:
        return [f"{len(summary)} cells with a '## Summary' line, not one"]
    expected = {1: "the header", summary[0] + 1: "the summary"}
    found = {i for i, c in enumerate(cells) if c.cell_type == "markdown" and is_chinese(c)}
    return ([f"no Chinese cell right after {what} (cell {i - 1})" for i, what in expected.items() if i not in found]
            + [f"cell {i} is Chinese but follows neither the header nor the summary" for i in sorted(found - set(expected))])


def readme_section() -> str:
    """The README's ``## 中文简介`` section, to the next section or the end of the file."""
    text = times.README.read_text()
    start = text.index("\n## 中文简介\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_header_and_the_summary_have_their_chinese_versions(path):
    cells = nbformat.read(path, as_version=4).cells
    assert not place_problems(cells), f"{path.name}: {place_problems(cells)}"
    lines = [line for line in cells[1].source.splitlines() if line.startswith("**时间")]
    assert lines == [times.header_line_zh(times.load()["notebooks"][path.stem])], (
        f"{path.name}: the Chinese header's time line is not times.json's (python -m course.times rewrites it)")


def test_chinese_glossary_links_use_the_glossary_renderings():
    allowed = renderings(GLOSSARY.read_text())
    assert allowed["agent"] == {"（弹性）代理进程", "代理进程"} and allowed["gloo"] == {"gloo（不译）", "gloo"}
    texts = {f"{p.name} cell {i}": c.source for p in NOTEBOOKS
             for i, c in enumerate(nbformat.read(p, as_version=4).cells) if c.cell_type == "markdown" and is_chinese(c)}
    texts["README.md, 中文简介"] = readme_section()
    assert len(texts) == 2 * len(NOTEBOOKS) + 1
    assert sum(len(LINK.findall(text)) for text in texts.values()) > 3 * len(NOTEBOOKS)
    wrong = {where: problems for where, text in texts.items() if (problems := link_problems(text, allowed))}
    assert not wrong, wrong


def test_a_wrong_rendering_a_late_link_or_a_missing_cell_is_found():
    allowed = renderings('<a id="rank"></a>\n**rank** — a process. 中文：进程序号（全局 rank）\n\n'
                         '<a id="scatter-gather"></a>\n**scatter** — split. 中文：分发 / 收集 / 规约\n')
    assert allowed == {"rank": {"进程序号（全局 rank）", "进程序号"}, "scatter-gather": {"分发", "收集", "规约"}}
    good = "### 中文：进程序号\n每个[进程序号](glossary.md#rank)唯一；[收集](../notebooks/glossary.md#scatter-gather)。"
    assert link_problems(good, allowed) == []
    assert link_problems("**中文**\n[进程编号](glossary.md#rank)", allowed) == [
        "[进程编号](#rank): the glossary renders it as 进程序号 or 进程序号（全局 rank）"]
    assert link_problems("**中文**\n[rank](glossary.md#rank)，[分发](glossary.md#scatter)", allowed)[1:] == [
        "[分发](#scatter): no such glossary entry"]
    assert link_problems("**中文**\n进程序号是[进程序号](glossary.md#rank)", allowed) == [
        "[进程序号](#rank): 进程序号 is used before its link"]
    cells = [nbformat.v4.new_markdown_cell("# 00 · title"), nbformat.v4.new_markdown_cell("### 中文：00 · 标题"),
             nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell("## Summary\n- one"),
             nbformat.v4.new_markdown_cell("### 中文：小结\n- 一")]
    assert place_problems(cells) == []
    assert place_problems(cells[:4]) == ["no Chinese cell right after the summary (cell 3)"]
    assert place_problems([cells[0], cells[2], cells[1], *cells[3:]]) == [
        "no Chinese cell right after the header (cell 0)", "cell 2 is Chinese but follows neither the header nor the summary"]


def test_a_rerun_of_course_times_rewrites_the_chinese_time_line(tmp_path, monkeypatch):
    import json
    import shutil

    stem = NOTEBOOKS[0].stem
    data = times.load()
    data["notebooks"][stem].update(quick_s=999, full_min=7.5, full_measured=True, full_note="x", full_note_zh="某次")
    (tmp_path / "times.json").write_text(json.dumps(data))
    shutil.copy(NOTEBOOKS[0], tmp_path)
    shutil.copy(times.README, tmp_path / "README.md")
    monkeypatch.setattr(times, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(times, "TIMES", tmp_path / "times.json")
    monkeypatch.setattr(times, "README", tmp_path / "README.md")
    assert f"{stem}.ipynb" in times.apply()
    header = nbformat.read(tmp_path / NOTEBOOKS[0].name, as_version=4).cells[1].source
    assert times.header_line_zh(data["notebooks"][stem]) in header
    assert "快速模式（`COURSE_QUICK=1`）999 秒（实测），完整模式 7.5 分钟（实测，某次）。" in header


DATA_PARALLEL = re.compile(r"(?<!distributed )(?<!sharded )\bdata[- ]parallel", re.IGNORECASE)
SHU_JU = re.compile(r"(?<!分布式)(?<!分片)数据并行")  # 数据并行 itself, not inside 分布式/完全分片/混合分片数据并行
DDP_EN = re.compile(r"DDP|DistributedDataParallel|distributed data parallel", re.IGNORECASE)


def term_problems(english: str, chinese: str) -> list[str]:
    """Audit Z-1: the glossary keeps data parallelism (数据并行) and DDP (分布式数据并行) apart; a Chinese cell
    says 数据并行 where its English cell says data-parallel, and 分布式数据并行 only where it says DDP."""
    problems = []
    if DATA_PARALLEL.search(english) and not SHU_JU.search(chinese):
        problems.append("the English says data-parallel; the Chinese has no 数据并行 of its own")
    if "分布式数据并行" in chinese and not DDP_EN.search(english):
        problems.append("the Chinese says 分布式数据并行 (DDP); the English names no DDP")
    return problems


def pairs(path) -> dict[str, tuple[str, str]]:
    """{'header' / 'summary': (English cell, its Chinese cell)} of one notebook."""
    cells = nbformat.read(path, as_version=4).cells
    summary = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and not is_chinese(c)
                   and SUMMARY.search(c.source))
    return {"header": (cells[0].source, cells[1].source), "summary": (cells[summary].source, cells[summary + 1].source)}


def test_data_parallel_and_ddp_keep_their_glossary_terms():
    wrong = {f"{p.stem} {where}": problems for p in NOTEBOOKS for where, (en, zh) in pairs(p).items()
             if (problems := term_problems(en, zh))}
    assert not wrong, wrong
    assert term_problems("names each data-parallel mistake", "对每个[分布式数据并行](glossary.md#ddp)错误") == [
        "the English says data-parallel; the Chinese has no 数据并行 of its own",
        "the Chinese says 分布式数据并行 (DDP); the English names no DDP"]
    assert term_problems("FSDP (fully sharded data parallel)", "完全分片数据并行") == []
    assert term_problems("DDP", "分布式数据并行") == [] and term_problems("x", "分布式数据并行") != []


def test_the_chinese_readme_keeps_the_conditions_and_the_times_of_the_english():
    """Audit Z-2 and Z-15: the CPU-only install line keeps its `rm -rf .venv` condition, and the quick course's time
    is not "a few minutes": both state the same range of minutes, and the table's quick-mode times add up to a figure
    inside it."""
    zh = readme_section()
    assert "make setup TORCH=cpu" in zh and "rm -rf .venv" in zh
    english = re.search(r"finishes in\s+about (\d+)-(\d+) minutes", (ROOT / "README.md").read_text())
    chinese = re.search(r"约 (\d+)-(\d+) 分钟跑完", zh)
    assert english and chinese and english.groups() == chinese.groups(), (english, chinese)
    low, high = map(int, english.groups())
    assert low <= sum(e["quick_s"] for e in times.load()["notebooks"].values()) / 60 <= high
    assert "几分钟" not in zh
