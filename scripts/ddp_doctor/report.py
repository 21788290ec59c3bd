"""The doctor's report: one line per finding (what was seen, the run's evidence, the fix, the lesson), what was
checked and what could not be, and the exit status a learner's CI can use (as linters do: 0 nothing wrong,
1 a mistake found, 2 could not check). Cost notes alone leave the status at 0."""

import html
import json
from dataclasses import asdict, dataclass, field

MISTAKE, COST = "mistake", "cost"
HIDDEN = "(hidden: find it from the evidence; check(..., fixes=True) shows it)"  # a diagnosis exercise (09b)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (a notebook, or JupyterLab's console); False in a plain Python process,
    a terminal IPython, or a test."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


LESSONS = {  # where the course teaches each finding
    "not-distributed": "notebook 03, step 1", "same-device": "notebook 04, pitfall 1",
    "local-rank": "notebook 04, pitfall 6", "not-sharded": "notebook 03, step 4",
    "shard-overlap": "notebook 03, step 4", "shard-gap": "notebook 03, step 4", "set-epoch": "notebook 04, pitfall 2",
    "replicas-start": "notebook 03, step 3", "replicas-drift": "notebook 04b, pitfall 14",
    "grads-scaled": "notebook 04b, pitfall 14",
    "grads-not-averaged": "notebook 03, step 3; exercise 2 of notebook 09",
    "rank-writes": "notebook 03, step 5; deep dive 04b, pitfalls 9-10",
    "eval-padding": "notebook 03, step 4 (validation without padding); deep dive 04b, pitfall 8",
    "eval-one-shard": "notebook 03, step 5; deep dive 04b, pitfall 8; exercise 6 of 09",
    "uneven-batches": "notebook 04, pitfall 7",
    "hang": "notebook 00 (collectives) and 03, step 5; deep dive 04b, pitfall 12; 06 (flight recorder)",
    "collective-mismatch": "notebook 03, step 5; deep dive 04b, pitfall 12",
    "accum-not-divided": "exercise 6 of notebook 09; notebook 05",
    "accum-sync": "notebook 05 (accumulation with no_sync)", "find-unused": "notebook 05",
    "oversubscribed": "notebook 04, pitfall 4", "not-equivalent": "notebook 03 (the proofs)",
    "device-mismatch": "notebook 04, pitfall 3", "split-per-rank": "notebook 03, step 4",
    "eval-ddp-buffers": "notebook 03, step 3; deep dive 04b, pitfall 12"}


def clip(text: str, n: int = 240) -> str:
    """``text`` cut to about ``n`` characters at a word's end, with "…" where it was cut (the recorder keeps an
    error's first 300 characters: a cut text always shows its cut)."""
    text = text.strip()
    if len(text) <= n:
        return text
    return text[:n].rsplit(" ", 1)[0].rstrip(" ,;:.") + " …"


@dataclass
class Finding:
    code: str
    seen: str  # what was seen, in one sentence
    evidence: str  # from the run: ranks, indices, paths, counts
    fix: str
    kind: str = MISTAKE

    @property
    def lesson(self) -> str:
        return LESSONS.get(self.code, "")

    def line(self, fix: bool = True) -> str:
        mark = "cost" if self.kind == COST else "mistake"
        return (f"{mark} [{self.code}] {self.seen} Evidence: {self.evidence}. Fix: {self.fix if fix else HIDDEN}"
                + (f" ({self.lesson})" if self.lesson else ""))


@dataclass
class Report:
    script: str
    command: str  # how it ran: processes, nodes, steps per pass
    findings: list = field(default_factory=list)
    checked: list = field(default_factory=list)  # what was looked at, with counts
    unchecked: list = field(default_factory=list)  # what could not be checked, and why
    hints: list = field(default_factory=list)  # read from the source: never a finding alone
    error: str = ""  # the script's own failure, or why the doctor could not check
    seconds: float = 0.0
    files: str = ""  # where the files the run created were moved

    @property
    def mistakes(self) -> list:
        return [f for f in self.findings if f.kind == MISTAKE]

    @property
    def status(self) -> int:
        if self.mistakes:
            return 1
        return 2 if self.error else 0

    @property
    def verdict(self) -> str:
        if self.mistakes:
            n = len(self.mistakes)
            return f"{n} mistake{'s' if n > 1 else ''} found"
        if self.error:
            return "could not check everything"
        return "no mistake found" + (" (cost notes below)" if self.findings else "")

    def text(self, fixes: bool = True) -> str:
        """The report as lines; ``fixes=False`` hides each finding's fix (the saved report keeps it)."""
        lines = [f"doctor: {self.script} - {self.verdict} ({self.command}; {self.seconds:.0f} s)"]
        if self.error:
            lines += ["  " + line for line in self.error.splitlines()]
        lines += [f.line(fixes) for f in sorted(self.findings, key=lambda f: f.kind != MISTAKE)]
        if self.checked:
            lines.append("checked: " + "; ".join(self.checked))
        if self.unchecked:
            lines.append("not checked: " + "; ".join(self.unchecked))
        lines += [f"read from the source (a hint, not a finding): {h}" for h in self.hints]
        if self.files:
            lines.append(self.files)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(status=self.status, verdict=self.verdict)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def html(self, fixes: bool = True) -> str:
        """The same report as a table (one row per finding), for a notebook; ``fixes=False`` as in text()."""
        rows = "".join(
            f"<tr><td>{html.escape(f.kind)}</td><td><code>{html.escape(f.code)}</code></td>"
            f"<td>{html.escape(f.seen)}</td><td>{html.escape(f.evidence)}</td><td>{html.escape(f.fix if fixes else HIDDEN)}</td>"
            f"<td>{html.escape(f.lesson)}</td></tr>" for f in sorted(self.findings, key=lambda f: f.kind != MISTAKE))
        table = ("<table><tr><th>kind</th><th>finding</th><th>seen</th><th>evidence</th><th>fix</th>"
                 f"<th>where the course teaches it</th></tr>{rows}</table>") if rows else ""
        extra = "".join(f"<p>{html.escape(label)} {html.escape(text)}</p>" for label, text in (
            ("Checked:", "; ".join(self.checked)), ("Not checked:", "; ".join(self.unchecked)),
            ("Error:", self.error), ("", self.files)) if text)
        extra += "".join(f"<p>Read from the source (a hint, not a finding): {html.escape(h)}</p>" for h in self.hints)
        head = f"<p><b>doctor: {html.escape(self.script)} - {html.escape(self.verdict)}</b> ({html.escape(self.command)}; " \
               f"{self.seconds:.0f} s)</p>"
        return head + table + extra
