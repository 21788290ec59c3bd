"""The DDP doctor: runs a learner's own torchrun-ready training script on several processes under the recorder and
names its data-parallel mistakes, each with the run's evidence, the fix and the lesson that teaches it.

    ddp-doctor train.py --epochs 2                         # from a shell: a report, exit status 0 / 1 / 2
    from ddp_doctor import check                           # from a notebook: the same report as a table
    report = check("train.py", args=["--epochs", "2"])

What it runs: the script as torchrun would (its own arguments, its working directory), on 2 processes (one per
GPU where there are 2 or more; on a CPU machine as 2 nodes of 1 process, so that LOCAL_RANK differs from RANK as
on a cluster), each training pass over a DataLoader cut to ``steps`` batches, the process-group timeout cut to
``hang_after`` seconds, the whole job to ``timeout``; nothing is left running. Afterwards your folders are as they
were: files the script overwrote or deleted are restored, files it created are moved to the doctor's folder for
the script (``runs/doctor/<script>-<key>/files`` where the script runs; the report says where).
Scripts as people write them run too (``running``): written for CUDA and NCCL (on a CPU machine, with a CPU
stand-in), starting their own processes (``mp.spawn``: run once, as ``python script.py``; of several worlds
spawned one after another, the first is checked), or taking ``--local_rank``.
With ``compare_batch_arg="--batch-size"`` it also runs 1 process with that argument's value (the global batch)
and N processes with 1/N of it, and compares the first steps' losses (notebook 03's proof, on your script).

What it finds is made from what the run did (``rules_data``, ``rules_sync``, ``rules_ddp``), never from reading
the source alone: a hint read from the source is labelled as such. ``running`` launches, ``report`` formats.
"""

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_doctor import rules_data, rules_ddp, rules_files, rules_sync, worlds
from ddp_doctor.report import COST, Finding, Report, in_notebook
from ddp_doctor.running import Job, Run, run
from ddp_doctor.unchecked import nothing_checked, own_failure, still_running

__all__ = ["Finding", "Job", "Report", "check", "diagnose"]


@dataclass
class Facts:
    """What the rules found, checked and could not check, as they go."""

    cwd: str
    findings: list = field(default_factory=list)
    checked: list = field(default_factory=list)
    unchecked: list = field(default_factory=list)
    model_parallel: str = ""

    def add(self, finding: Finding) -> None:
        if not any(f.code == finding.code for f in self.findings):
            self.findings.append(finding)

    def fold_symptoms(self) -> None:
        """A hang whose cause was found is told as that cause's consequence, not as a second mistake."""
        symptom = next((f for f in self.findings if f.code in SYMPTOMS), None)
        cause = next((f for f in self.findings if f.code in CAUSES), None)
        if symptom and cause:
            self.findings.remove(symptom)
            cause.evidence += f"; the job then hung: {symptom.evidence}"


CUT = ("StopIteration",)  # a cut pass ended a loop that draws more batches than the loader's length
SYMPTOMS = ("hang", "collective-mismatch")
CAUSES = ("uneven-batches", "local-rank", "eval-one-shard", "eval-ddp-buffers")


def diagnose(run: Run, moved_to: str = "the doctor's folder") -> Report:
    """The report of one run: every rule applied to what the recorder saw; ``moved_to``: where the files the
    run created now are, as the report says it."""
    job, records = run.job, run.records
    shape = f"{job.nodes} nodes x {job.nproc // job.nodes}" if job.nodes > 1 else "1 node"
    cut = f"DataLoader passes cut to {job.steps} batches" if job.steps else "passes not cut"
    shown = os.path.relpath(job.script, job.cwd) if job.script.is_relative_to(job.cwd) else str(job.script)
    report = Report(shown, f"{job.nproc} processes ({shape}); {cut}", seconds=run.seconds)
    facts = Facts(str(job.cwd.resolve()))
    if len(records) < job.nproc and run.returncode in (0, None):
        report.error = f"the script ended before every rank recorded anything ({len(records)} of {job.nproc})"
    hung = rules_sync.hangs(run, facts)
    worlds.check_earlier(records, job.nproc, _world_rules, facts)  # process groups made before the last one
    _world_rules(records, facts, job.nproc)
    if records:
        rules_files.writes(records, facts)
        rules_files.handoffs(records, facts)
        rules_files.node_local_writes(records, _source(job.script), facts)
    rules_sync.aborted_mismatch(run, facts)
    rules_sync.own_error(run, facts)
    if run.returncode not in (0, None) and not hung and not report.error:
        how = "failed" if any(f.kind != COST for f in facts.findings) else "failed on its own"
        report.error = f"the script {how} (exit code {run.returncode}): {own_failure(run)}"
    elif run.timed_out and not hung:
        report.error = f"the job was still running after {job.timeout:.0f} s and was stopped: {still_running(run)}"
    if run.later:  # mp.spawn called again: worlds one after another, the first checked
        facts.unchecked.append(f"the processes of the script's later mp.spawn calls ({run.parent['spawn_jobs'] - 1})")
    facts.fold_symptoms()
    if not report.error and not any(f.kind != COST for f in facts.findings):
        report.error = nothing_checked(run)  # never "no mistake found" about a run that checked nothing
    report.findings, report.checked, report.unchecked = facts.findings, facts.checked, facts.unchecked
    report.hints = _hints(job.script, facts, records)
    if run.moved or run.restored:
        report.files = (f"your folders are as before: {len(run.restored)} overwritten file(s) restored, "
                        f"{len(run.moved)} new file(s) moved to {moved_to}")
    return report


def _world_rules(records: dict, facts: Facts, nproc: int) -> None:
    """Every rule of one world (one process group) on its ranks' records."""
    if len(records) == nproc and rules_sync.process_group(records, facts):  # rules that compare ranks: every rank
        facts.model_parallel = rules_sync.model_parallel(records)
        rules_sync.devices(records, facts)
        if facts.model_parallel:
            facts.unchecked.append(f"replicas, gradients and the data split (no replicas: {facts.model_parallel})")
        elif rules_sync.sharded(records):
            facts.unchecked.append("replicas and gradients: each rank holds a shard of the parameters (FSDP)")
            rules_data.sharding(records, facts)
        else:
            rules_data.sharding(records, facts)
            rules_sync.gradients(records, facts)
            rules_sync.replicas(records, facts)
        for rule in (rules_data.epoch_order, rules_data.uneven, rules_data.evaluation, rules_ddp.eval_through_ddp,
                     rules_ddp.accumulation, rules_ddp.ddp_settings, rules_data.oversubscribed):
            rule(records, facts)
    elif records and any(rec.get("pg") for rec in records.values()):  # a rank left no record: what one rank shows
        lost = sorted(set(range(nproc)) - set(records))
        facts.unchecked.append(f"what compares the ranks (rank {', '.join(map(str, lost))} left no record)")
        for rule in (rules_data.epoch_order, rules_ddp.accumulation, rules_ddp.ddp_settings):
            rule(records, facts)


def _source(script: Path) -> str:
    try:
        return script.read_text(errors="replace")
    except OSError:
        return ""


def _hints(script: Path, facts: Facts, records: dict | None = None) -> list:
    """What the source suggests where the run could not tell (never a finding on its own)."""
    source = _source(script)
    if not source:
        return []
    hints = []
    if any("order from epoch" in u for u in facts.unchecked) and "DistributedSampler" in source \
            and "set_epoch" not in source:
        hints.append("the script uses DistributedSampler and never calls set_epoch")
    divisor = rules_data.divisor_hint(records or {}, source)
    if divisor:
        hints.append(divisor)
    return hints


def _compare(job: Job, arg: str, work: Path, report: Report, n_run: Run) -> None:
    """1 process with the global batch against the N-process run's first losses."""
    one = Job(job.script, list(job.args), nproc=1, nodes=1, cwd=job.cwd, timeout=job.timeout,
              hang_after=job.hang_after, steps=job.steps)
    index = _arg_index(one.args, arg)
    one.args[index] = str(int(one.args[index]) * job.nproc)
    single = run(one, work / "one_process")

    def per_step(records):
        losses = [{s: sum(x["v"] for x in rec["losses"] if x["step"] == s and x["v"] is not None)
                   for s in {x["step"] for x in rec.get("losses", [])}} for rec in records.values()]
        return [sum(ls[s] for ls in losses) / len(losses) for s in sorted(set.intersection(*map(set, losses)))]

    a, b = per_step(single.records) if single.records else [], per_step(n_run.records) if n_run.records else []
    n = min(len(a), len(b), 5)
    if n == 0:
        report.unchecked.append("1 process against N (a run recorded no loss)")
        return
    close = [abs(x - y) <= 1e-4 * max(abs(x), abs(y), 1e-8) for x, y in zip(a[:n], b[:n])]
    shown = ", ".join(f"{x:.5f}/{y:.5f}" for x, y in zip(a[:n], b[:n]))
    if not close[0]:
        report.unchecked.append(f"1 process against {job.nproc}: the first losses differ already ({shown}): "
                                "different samples in the first batch, or random layers (dropout, augmentation)")
    elif not all(close):
        k = close.index(False)
        report.findings.append(Finding(
            "not-equivalent", f"{job.nproc} processes do not train as 1 process on the global batch: the first "
            f"losses agree, then step {k} differs.", f"losses (1 process / {job.nproc} processes, mean over ranks): "
            f"{shown}", "average the gradients (DDP does) and keep the learning rate and the global batch as on "
            "one process"))
    else:
        report.checked.append(f"1 process against {job.nproc} (the first {n} steps' losses equal to 1e-4)")


def _arg_index(args: list, name: str) -> int:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args) and re.fullmatch(r"\d+", args[i + 1]):
            return i + 1
        if a.startswith(name + "="):
            args[i:i + 1] = [name, a.split("=", 1)[1]]
            return i + 1
    raise ValueError(f"--compare-batch-arg={name}: the script's arguments hold no `{name} N` to split")


def check(script, args=(), nproc: int | None = None, *, nodes: int | None = None, timeout: float = 180,
          hang_after: float = 30, steps: int = 8, compare_batch_arg: str | None = None, cwd=None,
          folder=None, show: bool = True, fixes: bool = True, on_line=None, launch: str | None = None,
          pretend_gpus: bool = False) -> Report:
    """Run the doctor on ``script`` (see the module's docstring); show and return the report.
    launch: "torchrun" or "spawn" (the script starts its own processes) as the user says; default: read from the
    source, then from the first try (a script started once that asks for torchrun's RANK runs under torchrun; a
    rank under torchrun that starts processes of its own, once as its author runs it). pretend_gpus: on a machine
    with fewer GPUs than processes, the CPU stand-in tells the script it has one GPU per process (its GPU path runs;
    by default a script that asks whether a GPU is there runs its CPU path, unless that stops before training).
    cwd: the script's working directory (default: this process's); folder: where the records, the report and
    the files the run created go (default runs/doctor/<script name>-<key of its path> in ``cwd``; claimed: one
    doctor run at a time); fixes=False: the report shown hides each finding's fix (a diagnosis exercise; report.txt keeps
    it). Raises ValueError (one line) for what cannot be checked at all: a missing script, a bad
    argument; RunDirBusy when another doctor is checking the same script."""
    from ddp_doctor.hardware import accelerator
    from ddp_doctor.rundir import STAGING, claim_run_dir, publish
    from ddp_doctor.running import style

    path = Path(script).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"no such script: {script}")
    acc, count = accelerator()
    gpus = count if acc and acc != "mps" else 0
    nproc = nproc or (max(gpus, 2))
    how = style(path, gpus, nproc)
    if launch not in (None, "torchrun", "spawn"):
        raise ValueError(f"--launch {launch}: torchrun or spawn")
    if launch:
        how.update(launch=launch, launch_why=f"launched as `--launch {launch}` asked")
    if pretend_gpus and gpus < nproc:
        how.update(standin=True, pretend=True)
    nodes_asked, nodes = nodes, nodes or (1 if gpus >= 2 or how["launch"] == "spawn" else nproc)
    if how["launch"] == "spawn" and nodes != 1:
        raise ValueError("the script starts its own processes: it runs on one node (no --nodes)")
    if nproc < 2 or nproc % nodes:
        raise ValueError(f"nproc={nproc}, nodes={nodes}: the doctor needs 2 processes or more, split evenly over nodes")
    job = Job(path, [str(a) for a in args], nproc, nodes, Path(cwd or Path.cwd()).resolve(), timeout, hang_after,
              steps, **how)
    if compare_batch_arg:
        index = _arg_index(job.args, compare_batch_arg)
        if int(job.args[index]) % nproc:
            raise ValueError(f"{compare_batch_arg} {job.args[index]} does not split over {nproc} processes")
        job.args[index] = str(int(job.args[index]) // nproc)
    folder = Path(folder).resolve() if folder else doctor_folder(path, job.cwd)
    start = time.monotonic()
    with claim_run_dir(folder):
        work = folder / STAGING
        shutil.rmtree(work, ignore_errors=True)
        n_run = run(job, work / "job", on_line=on_line, files=work / "files")
        wanted = "" if launch else wants_torchrun(n_run)
        if wanted:  # both styles in one script, and its arguments chose torchrun's
            job.launch, job.nodes = "torchrun", nodes_asked or (1 if gpus >= 2 else nproc)
            job.launch_why = f"run under torchrun: started once as `python script`, it stopped at {wanted}"
            n_run = run(job, work / "job-torchrun", on_line=on_line, files=work / "files")
        if job.steps and all(text in n_run.output for text in CUT):  # the script reads its DataLoader with next(): run it uncut
            job.steps = 0
            n_run = run(job, work / "job-uncut", on_line=on_line, files=work / "files")
        gpu_minded = job.standin or (gpus < nproc and "accelerator" in path.read_text(errors="replace"))
        if gpu_minded and not job.pretend and not any(rec.get("pg") for rec in n_run.records.values()):
            # the script's own CPU path stopped before any process group (a device count, an is_available() guard):
            # run it again with the stand-in answering as a GPU machine would
            job.standin = job.pretend = True
            n_run = run(job, work / "job-pretend", on_line=on_line, files=work / "files")
        spawned = "" if launch else _spawned(n_run)
        if spawned:  # a rank started processes of its own (code the doctor did not read): as its author runs it
            job.launch, job.nodes = "spawn", 1
            n_run = run(job, work / "job-spawn", on_line=on_line, files=work / "files")
        report = diagnose(n_run, _shown(folder / "files", job.cwd))
        _how_it_ran(n_run, report)
        if spawned:
            report.command += f" (under torchrun its ranks started processes of their own at {spawned})"
        if compare_batch_arg and not report.error:
            _compare(job, compare_batch_arg, work, report, n_run)
        report.seconds = time.monotonic() - start
        (work / "report.txt").write_text(report.text() + "\n")
        (work / "report.json").write_text(report.to_json())
        publish(folder, work)
    if show:
        _show(report, fixes)
    return report


def doctor_folder(script: Path, base=None) -> Path:
    """The doctor's folder for a script: runs/doctor/<name>-<key of its full path> in ``base`` (default: the
    current working folder; two projects' train.py: two folders)."""
    import hashlib

    path = Path(script).expanduser().resolve()
    base = Path(base or Path.cwd()).resolve()
    return base / "runs" / "doctor" / f"{path.stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def _shown(path: Path, cwd: Path) -> str:
    """A path as the report says it: relative to the script's working folder when inside it."""
    return os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path)


MISSING_ENV = re.compile(r"environment variable (\w+) expected, but not set|KeyError: '(RANK|WORLD_SIZE|LOCAL_RANK|"
                         r"LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|GROUP_RANK)'")


def wants_torchrun(run: Run) -> str:
    """A script started once (``spawn``) that made no process group and failed asking for a variable torchrun
    sets: the error's text, else ""."""
    if run.job.launch != "spawn" or run.returncode in (0, None) or any(r.get("pg") for r in run.records.values()):
        return ""
    found = MISSING_ENV.search(run.output)
    return f"`{found.group(0)}`" if found else ""


def _spawned(run: Run) -> str:
    """Where a rank under torchrun started processes of its own (the recorder ended it there), or ""."""
    return next((e.get("where") or "?" for r in run.records.values() for e in r.get("errors", [])
                 if e.get("in") == "spawn"), "") if run.job.launch != "spawn" else ""


def _how_it_ran(run: Run, report: Report) -> None:
    """What the runner did that the report's reader must know: the launch style, the CPU stand-in and what it
    cannot see, files it could not put back."""
    if run.job.launch == "spawn":
        report.command += "; started once as `python script`, its processes recorded"
    if run.job.launch_why:
        report.command += f"; {run.job.launch_why}"
    if run.job.local_rank_arg:
        report.command += (f"; given {run.job.local_rank_arg}=N, spelled as the script declares it (torch.distributed"
                           ".launch writes --local-rank since torch 2.0)")
    sites = run.standin_sites
    if sites:
        report.command += f"; CUDA/NCCL on a CPU stand-in at {len(sites)} call site{'s' if len(sites) > 1 else ''}"
        if run.job.pretend:
            per_node = run.job.nproc // run.job.nodes
            report.command += (f", telling the script it has {per_node} GPU{'s' * (per_node != 1)} per node (torch.cuda"
                               " and torch.accelerator)")
        else:  # the script asks whether a GPU is there (else the stand-in would pretend)
            report.unchecked.append(
                f"the script's GPU path: it asks whether a GPU is there and ran its CPU path here; --pretend-gpus runs "
                f"it as on a machine with {run.job.nproc // run.job.nodes} GPU(s) per node")
        report.unchecked.append(
            f"what needs a GPU: the script ran on the CPU with gloo for nccl ({', '.join(sites[:6])}"
            f"{' ...' if len(sites) > 6 else ''}), so GPU-only code paths, NCCL-only behaviour (its own timeouts, "
            "asynchronous errors, stream ordering) and speed were not seen")
    if run.ended_early:
        report.unchecked.append(run.ended_early)
    if run.lost:
        report.files = (report.files + "; " if report.files else "") + \
            f"could not restore {len(run.lost)} file(s): {', '.join(run.lost[:4])}"


def _show(report: Report, fixes: bool = True) -> None:
    if in_notebook():
        from IPython.display import HTML, display

        display(HTML(report.html(fixes)))
    else:
        print(report.text(fixes), flush=True)
