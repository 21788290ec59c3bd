"""The DDP doctor (ddp_doctor) on scripts the course did not write for itself: every case of
tests/fixtures/doctor/cases.json (the pitfalls of 04/04b that show on a CPU, exercise 6's bugs, the correct scripts,
learner-shaped scripts with realistic mistakes) gets exactly its expected findings, no more; the learner's folder is
left as it was; nothing is left running; the command line's exit status and one-line errors."""

import json
import subprocess
import sys

import pytest
from conftest import wait_for_no_processes

from course import ROOT
from course import doctor_cases as cases
from ddp_doctor import rules_data, rules_ddp, rules_files, rules_sync
from ddp_doctor.doctor import Facts, diagnose
from ddp_doctor.report import COST, Finding, Report, clip
from ddp_doctor.running import Job, Run
from ddp_doctor.unchecked import own_failure, still_running

CASES = cases.load(bench=False)


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory):
    """Every case run once, two at a time (each in a working folder of its own)."""
    return cases.run_all(CASES, tmp_path_factory.mktemp("doctor"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_doctor_makes_exactly_the_expected_findings(case, outcomes):
    outcome = outcomes[case.name]
    report = outcome.report
    assert outcome.found == sorted(case.expect), f"{case.name}:\n{report.text()}"
    mistakes = [f for f in report.findings if f.kind != COST]
    assert report.status == (1 if mistakes else 2 if report.error else 0), report.text()
    for finding in report.findings:  # one line each: what, evidence, fix, lesson
        line = finding.line()
        assert "\n" not in line and finding.evidence and finding.fix and finding.lesson, line


def test_correct_scripts_are_clean_and_mistakes_have_evidence(outcomes):
    clean = [o for o in outcomes.values() if o.case.group == "correct"]
    assert len(clean) >= 9 and all(o.report.status == 0 and not o.report.findings for o in clean)
    set_epoch = outcomes["pitfall-2-set-epoch"].report.findings[0]
    assert "epoch was 0 both times" in set_epoch.evidence and "first samples" in set_epoch.evidence
    uneven = outcomes["pitfall-7-uneven"].report.findings[0]
    assert "rank 0: 5 batches, rank 1: 4 batches" in uneven.evidence
    one_shard = outcomes["exercise-6a"].report.findings[0]  # the hang it causes is told as its consequence
    assert "the job then hung" in one_shard.evidence and "rank 1 in barrier at ex6a_debug.py" in one_shard.evidence
    mismatch = outcomes["pitfall-12-collective"].report.findings[0].evidence
    assert "rank 0 called all_reduce" in mismatch and "rank 1 called barrier" in mismatch
    assert "pitfall_collective.py:" in mismatch  # the line of each rank


def test_a_hang_names_where_each_rank_was(outcomes):
    """Rank 0 in an all_reduce, rank 1 in a loop without collectives: at the wall-clock limit each rank said where."""
    hang = outcomes["hang-without-timeout"].report.findings[0]
    assert "rank 0 in all_reduce at hang_forever.py:10" in hang.evidence, hang.evidence
    assert "rank 1 at hang_forever.py:13, in no collective" in hang.evidence, hang.evidence
    assert wait_for_no_processes("hang_forever.py", timeout=10) == []


def test_nothing_is_left_running_after_any_case(outcomes):
    for script in {str(o.case.script) for o in outcomes.values()}:
        assert wait_for_no_processes(script, timeout=10) == [], script


def test_the_learners_folder_is_as_it_was(outcomes):
    """Files the script overwrote are restored; files it created are moved to the doctor's folder."""
    outcome = outcomes["learner-trainer-class"]
    assert (outcome.cwd / "checkpoint.pt").read_text() == "the learner's own checkpoint"
    writes = outcomes["learner-save-every-rank"]
    assert sorted(p.name for p in writes.cwd.iterdir()) == []  # runs_local/ was created by the run: gone
    moved = {p.name for p in writes.folder.rglob("*") if p.is_file() and "files" in p.relative_to(writes.folder).parts}
    assert {"last.pt", "log.csv"} <= moved and any(n.startswith("events.out.tfevents") for n in moved)


def test_a_script_that_fails_on_its_own_is_shown_once(outcomes):
    report = outcomes["crashes-on-its-own"].report
    assert report.status == 2 and report.text().count("KeyError: 'learning_rate'") == 1, report.text()
    assert "rank 1" in report.error


def test_one_process_against_n_is_the_equivalence_proof(outcomes):
    wrong = outcomes["learner-by-hand-sum"].report.findings[0]
    assert wrong.code == "not-equivalent" and "then step 1 differs" in wrong.seen
    assert any("1 process against 2" in c for c in outcomes["learner-by-hand-fixed"].report.checked)


def test_every_rank_on_one_gpu_is_named_from_the_records():
    """The GPU-only pitfall 1, from records as two ranks on one GPU would leave them (no GPU here)."""
    records = {r: {"modules": [{"device": "cuda:0"}], "env": {}} for r in (0, 1)}
    facts = Facts("/")
    rules_sync.devices(records, facts)
    assert [f.code for f in facts.findings] == ["same-device"] and "cuda:0" in facts.findings[0].evidence
    records[1]["modules"][0]["device"] = "cuda:1"
    facts = Facts("/")
    rules_sync.devices(records, facts)
    assert facts.findings == []


def test_exit_status_follows_the_linters():
    clean, cost = Report("s", "c"), Report("s", "c", findings=[Finding("find-unused", "x", "y", "z", kind=COST)])
    wrong = Report("s", "c", findings=[Finding("set-epoch", "x", "y", "z")])
    assert (clean.status, cost.status, wrong.status, Report("s", "c", error="boom").status) == (0, 0, 1, 2)
    assert json.loads(wrong.to_json())["status"] == 1


@pytest.mark.parametrize("argv, message", [
    (["no_such_script.py"], "error: no such script: no_such_script.py"),
    (["--steps", "-1", "x.py"], "error: argument --steps: -1 must be >= 0"),
    (["--compare-batch-arg=--batch-size", "tests/fixtures/doctor/crashes.py"],
     "error: --compare-batch-arg=--batch-size: the script's arguments hold no `--batch-size N` to split"),
])
def test_bad_input_gets_one_line_and_status_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "ddp_doctor", *argv], cwd=ROOT, capture_output=True, text=True,
                            check=False,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.notebook
def test_notebook_09b_finds_the_three_mistakes_and_none_after_the_fixes():
    """Read from the notebook's own headless run (conftest.executed_notebook), not launched again."""
    from conftest import executed_notebook

    run = executed_notebook("09b_check_your_script").require_ok()
    text = run.output()
    assert "before the fixes: 3 mistake(s) (set-epoch, eval-one-shard, rank-writes); after: 0" in text, text[-2000:]
    assert "PASS: 1004 samples counted for 1001" in text


# --- The rules on records built by hand: the outside tests' defects (issues 41 item 3, 42, 43), in-process ------

def _pass(indices, size, train=True, distributed=None, **extra):
    return {"loader": 1, "train": train, "size": size, "base": size, "count": len(indices), "batches": 5,
            "indices": list(indices), "sampler": "DistributedSampler" if distributed else "MySampler",
            "distributed": distributed, "t": 0.0, "dataset": "TensorDataset", **extra}


def _records(*shards, **extra):
    return {r: {"loaders": shard, "env": {"RANK": str(r), "LOCAL_RANK": "0"}, **extra} for r, shard in enumerate(shards)}


def _codes(rule, records, *args):
    facts = Facts("/")
    rule(records, *args, facts) if args else rule(records, facts)
    return facts, [f.code for f in facts.findings]


def test_padding_to_equal_shards_is_not_overlap():
    """drop_last=True on an odd-length set (total_size < len): no padding, no overlap; a sampler of one's own
    that pads as DistributedSampler does (one repeated index) is not overlap either; real overlap still is."""
    dist = [{"total_size": 100, "num_replicas": 2, "rank": r, "drop_last": True, "shuffle": True} for r in (0, 1)]
    dropped = _records([_pass(range(0, 100, 2), 101, distributed=dist[0])], [_pass(range(1, 100, 2), 101,
                                                                                   distributed=dist[1])])
    assert _codes(rules_data.sharding, dropped)[1] == []
    padded = _records([_pass(range(0, 101, 2), 101)], [_pass([*range(1, 101, 2), 0], 101)])
    assert _codes(rules_data.sharding, padded)[1] == []
    overlap = _records([_pass(range(60), 101)], [_pass(range(40, 101), 101)])
    facts, codes = _codes(rules_data.sharding, overlap)
    assert codes == ["shard-overlap"] and "20 samples" in facts.findings[0].evidence


def test_an_evaluation_pass_is_known_by_no_optimizer_step_in_it():
    """Issue 54 item 5: a test loader whose batch function turns gradients off inside (not around the loop) is
    evaluation, known by no optimizer step between its start and its end: its order, the same every epoch, is not
    set-epoch. The same passes with a step inside are training, and are."""
    from ddp_doctor.recorder import recorder_training

    assert rules_data.RECORDED_STEPS == recorder_training.MAX_STEPS
    dist = {"epoch": 0, "seed": 0, "shuffle": True, "drop_last": False, "num_replicas": 2, "total_size": 40}

    def rank(r, test_steps=()):
        own = {**dist, "rank": r}
        train = [_pass(range(r + e, 80 + e, 2), 80, distributed=own, t=10.0 * e, end=10.0 * e + 5) for e in (0, 1)]
        test = [_pass(range(r, 40, 2), 40, distributed=own, loader=2, t=10.0 * e + 6, end=10.0 * e + 8) for e in (0, 1)]
        steps = [10.0 * e + k for e in (0, 1) for k in (1, 2, 3)] + list(test_steps)
        return {"loaders": [train[0], test[0], train[1], test[1]], "grads": [{"t": t} for t in sorted(steps)],
                "env": {"RANK": str(r), "LOCAL_RANK": "0"}}

    facts, codes = _codes(rules_data.epoch_order, {r: rank(r) for r in (0, 1)})
    assert codes == [] and "sample order from epoch to epoch" in facts.checked, (codes, facts.checked)
    assert [p["loader"] for p in rules_data.passes(rank(0), False)] == [2, 2]
    trained = {r: rank(r, test_steps=(7.0, 17.0)) for r in (0, 1)}  # a step inside each test pass: training
    assert _codes(rules_data.epoch_order, trained)[1] == ["set-epoch"]


def test_overlap_from_a_split_or_data_of_each_rank_names_that_cause():
    """random_split drawn on every rank: the Subsets differ (validation leaks into training); data drawn at random
    on every rank: the tensors differ. Neither advises sampler arguments."""
    train = [_pass(range(60), 100, split=11), _pass(range(100, 120), 120, train=False, split=12)]
    other = [_pass(range(40, 100), 100, split=21), _pass(range(50, 70), 120, train=False, split=22)]
    facts, codes = _codes(rules_data.sharding, _records(train, other))
    assert codes == ["split-per-rank"], codes
    finding = facts.findings[0]
    assert "rank 1's validation samples are in rank 0's training set" in finding.evidence, finding.evidence
    assert "generator" in finding.fix and "rank=" not in finding.fix and finding.lesson
    data = _records([_pass(range(100), 100, data=[1.5, 90.0])], [_pass(range(100), 100, data=[-3.0, 95.0])])
    facts, codes = _codes(rules_data.sharding, data)
    assert codes == ["split-per-rank"] and "different tensors" in facts.findings[0].evidence
    same = _records([_pass(range(100), 100, data=[1.5, 90.0])], [_pass(range(100), 100, data=[1.5, 90.0])])
    assert _codes(rules_data.sharding, same)[1] == ["not-sharded"]


def test_evaluation_through_the_ddp_wrapper_on_one_rank_is_named():
    """Rank 0 alone runs no-grad forwards through DDP that broadcast buffers: named with its evidence."""
    evals = [{"t": 1.0, "buffers": 3, "where": "train.py:40"}] * 5
    facts, codes = _codes(rules_ddp.eval_through_ddp, {0: {"ddp_eval": evals}, 1: {"ddp_eval": []}})
    assert codes == ["eval-ddp-buffers"] and facts.findings[0].lesson
    assert "rank 0: 5 buffer broadcast(s)" in facts.findings[0].evidence and "train.py:40" in facts.findings[0].evidence
    assert "forward_sync_buffers=False" in facts.findings[0].fix and "first forward" in facts.findings[0].seen
    assert "model.module" in facts.findings[0].fix
    assert _codes(rules_ddp.eval_through_ddp, {0: {"ddp_eval": evals}, 1: {"ddp_eval": evals}})[1] == []
    no_buffers = [{"t": 1.0, "buffers": 0, "where": "x"}]  # nanoGPT's rank-0 estimate_loss: no collective
    assert _codes(rules_ddp.eval_through_ddp, {0: {"ddp_eval": no_buffers}, 1: {"ddp_eval": []}})[1] == []


def _grad_records(ddp, cls="DistributedDataParallel", unused=False):
    def rec(r):
        fp = [[1.0 + r, 2.0], [3.0 - r, 4.0], None if unused else [5.0, 6.0]]  # not one factor: not grads-scaled
        return {"ddp": ddp, "modules": [{"class": cls}],
                "grads": [{"opt": 0, "step": 0, "names": ["w", "b", "aux.w"], "fp": fp}]}
    return {0: rec(0), 1: rec(1)}


def test_fixes_fit_a_model_that_is_already_wrapped():
    """Gradients not averaged although the model is in DDP: the forward went around it, or a parameter got no
    gradient with find_unused_parameters=False. Replicas that differ at the start although DDP was built."""
    ddp = [{"find_unused_parameters": False}]
    facts, _ = _codes(rules_sync.gradients, _grad_records([]))
    assert "wrap the model in DistributedDataParallel" in facts.findings[0].fix
    facts, _ = _codes(rules_sync.gradients, _grad_records(ddp, cls="Net"))
    assert "model.module" in facts.findings[0].seen and "wrap the model" not in facts.findings[0].fix
    facts, _ = _codes(rules_sync.gradients, _grad_records(ddp, unused=True))
    assert "find_unused_parameters=True" in facts.findings[0].fix and "aux.w" in facts.findings[0].seen
    params = {r: {"ddp": ddp, "modules": [{"names": ["w"]}], "params": [{"m": 0, "step": 0, "fp": [[1.0 + r, 1.0]]}]}
              for r in (0, 1)}
    facts, codes = _codes(rules_sync.replicas, params)
    assert codes == ["replicas-start"] and "after DDP was built" in facts.findings[0].seen
    assert "wrap the model" not in facts.findings[0].fix


def test_a_folder_is_never_a_file_written_by_several_ranks(tmp_path):
    """tempfile.TemporaryFile opens its folder (O_TMPFILE): the folder is not a shared file."""
    folder = str(tmp_path)
    assert _codes(rules_files.writes, {r: {"writes": [folder], "env": {}} for r in (0, 1)})[1] == []
    shared = str(tmp_path / "last.pt")
    assert _codes(rules_files.writes, {r: {"writes": [shared], "env": {}} for r in (0, 1)})[1] == ["rank-writes"]


def test_saving_on_each_nodes_local_rank_0_is_not_called_a_mistake(tmp_path):
    """The tutorial series' torchrun scripts save `if self.gpu_id == 0` (LOCAL_RANK): on the doctor's simulated
    nodes both first processes write; right on one node, so said as what the run cannot tell. A script that does not
    gate on LOCAL_RANK, or writers that are not each node's first process, stay a mistake."""
    shared = str(tmp_path / "snapshot.pt")
    nodes = {r: {"writes": [shared], "env": {"LOCAL_RANK": "0", "GROUP_RANK": str(r)}} for r in (0, 1)}

    def codes(records, source):
        facts = Facts("/")
        rules_files.writes(records, facts)
        rules_files.node_local_writes(records, source, facts)
        return facts, [f.code for f in facts.findings]

    facts, found = codes(nodes, "if self.gpu_id == 0 and epoch % self.save_every == 0:\n")
    assert found == [] and any("share a filesystem" in u and "snapshot.pt" in u for u in facts.unchecked), facts
    assert codes(nodes, 'if int(os.environ["LOCAL_RANK"]) == 0:\n')[1] == []
    assert codes(nodes, "torch.save(model.state_dict(), 'snapshot.pt')\n")[1] == ["rank-writes"]
    one_node = {r: {"writes": [shared], "env": {"LOCAL_RANK": str(r), "GROUP_RANK": "0"}} for r in (0, 1)}
    assert codes(one_node, "if local_rank == 0:\n")[1] == ["rank-writes"]
    # Where the recorder saw each write (its sites): a file written from lines under no LOCAL_RANK test (hydra's
    # outputs, written as the job starts) stays a mistake beside the node-local snapshot (minGPT-ddp's shape).
    script = tmp_path / "train.py"
    script.write_text("def save(path):\n    torch.save(model, path)\n\n\n"
                      "def main():\n    open('run.log', 'w')\n    if self.local_rank == 0 and epoch % 2 == 0:\n"
                      "        save('snapshot.pt')\n")
    log = str(tmp_path / "run.log")
    sites = {shared: [[str(script), 2], [str(script), 8]], log: [[str(script), 6]]}
    both = {r: {"writes": [shared, log], "sites": sites, "env": {"LOCAL_RANK": "0", "GROUP_RANK": str(r)}}
            for r in (0, 1)}
    facts, found = codes(both, script.read_text())
    assert found == ["rank-writes"] and "run.log" in facts.findings[0].evidence, facts
    assert "snapshot.pt" not in facts.findings[0].evidence
    assert any("share a filesystem" in u and "snapshot.pt" in u and "run.log" not in u for u in facts.unchecked)


def test_a_peek_at_one_batch_before_set_epoch_is_not_an_epoch():
    """The DDP tutorial series' multigpu.py reads next(iter(loader)) for the batch size before set_epoch: that
    one-batch pass repeats the previous epoch's order, and is not an epoch. Two whole passes in the same order are."""
    dist = lambda epoch: {"epoch": epoch, "shuffle": True, "num_replicas": 2, "rank": 0, "total_size": 10}
    order = {0: [3, 1, 4, 0, 2], 1: [2, 0, 4, 1, 3]}
    peeked = [_pass(order[0], 10, distributed=dist(0), consumed=1), _pass(order[0], 10, distributed=dist(0), consumed=5),
              _pass(order[0], 10, distributed=dist(0), consumed=1), _pass(order[1], 10, distributed=dist(1), consumed=5)]
    assert _codes(rules_data.epoch_order, _records(peeked))[1] == []
    same = [_pass(order[0], 10, distributed=dist(0), consumed=5) for _ in range(2)]
    assert _codes(rules_data.epoch_order, _records(same))[1] == ["set-epoch"]
    # nor is it an evaluation: no optimizer step falls in it (issue 54 item 5's rule), yet it evaluated nothing
    steps = {"grads": [{"t": 2.0}, {"t": 4.0}]}
    timed = [{**peeked[0], "t": 0.0, "end": None}, {**peeked[1], "t": 1.0, "end": 5.0}]
    facts, codes = _codes(rules_data.evaluation, _records(timed, **steps))
    assert codes == [] and rules_data.passes(_records(timed, **steps)[0], False) == [], codes
    assert "evaluation (no DataLoader pass without gradients recorded)" in facts.unchecked


def test_a_cut_error_shows_its_cut():
    text = "RuntimeError: Expected to have finished reduction in the prior iteration " * 5
    cut = clip(text[:300])
    assert cut.endswith(" …") and len(cut) <= 242 and text.startswith(cut[:-2]) and cut[-3] != " "
    assert not text[len(cut) - 2].isalnum()  # cut where a word ends
    assert clip("short error") == "short error"


def _run(output="", records=None, returncode=1, stuck=None, nproc=2):
    return Run(Job(ROOT / "x.py", [], nproc=nproc, nodes=nproc), returncode, output, records or {}, stuck or {}, 1.0)


def test_a_rank_that_aborts_on_a_collective_mismatch_is_the_one_shown():
    """gloo aborts rank 1 (no record: C++ terminate); rank 0 only saw it die. The mismatch is named, rank 1 first."""
    output = ("[node1] [rank0]:terminate called after throwing an instance of 'gloo::EnforceNotMet'\n[node1] [rank0]:"
              "  what():  [enforce fail at gloo/transport/tcp/pair.cc:464] op.preamble.length <= op.nbytes. 12 vs 4. "
              "Received data size doesn't match expected size. Is there a distributed collective mismatch in your "
              "code?\n")
    victim = {"in": "script", "t": 2.0, "where": "train.py:9", "code": "",
              "error": "RuntimeError: [pair.cc:545] Read error: Connection reset by peer. This is typically caused"}
    run = _run(output, {0: {"errors": [victim], "pg": {"rank": 0}, "env": {}}})
    facts = Facts("/")
    rules_sync.aborted_mismatch(run, facts)
    assert [f.code for f in facts.findings] == ["collective-mismatch"], facts.findings
    assert "rank 1 aborted in gloo" in facts.findings[0].evidence
    failure = own_failure(run)
    assert failure.startswith("rank 1 aborted: ") and "collective mismatch" in failure, failure
    assert "then rank 0, having only seen it die" in failure
    report = diagnose(run)
    assert report.status == 1 and any("left no record" in u for u in report.unchecked), report.text()


def test_a_hang_names_the_rank_whose_collective_its_peers_leaving_ended():
    """CI of stop 58: rank 0's all_reduce timed out; gloo then closed rank 1's barrier ("pair closure") and rank 1
    exited before it could write where it was. Its failed collective says where: both ranks are named."""
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    timed_out = {"op": "all_reduce", "where": "ex6a_debug.py:44", "error": gloo + "unbound_buffer.cc:78] Timed out "
                 "waiting 5000ms for recv operation to complete"}
    closed = {"op": "barrier", "where": "ex6a_debug.py:79", "error": gloo + "pair.cc:561] Application timeout "
              "caused pair closure"}
    records = {0: {"collectives": [timed_out], "env": {}}, 1: {"collectives": [closed], "env": {}}}
    facts = Facts("/")
    assert rules_sync.hangs(_run(records=records), facts)
    evidence = facts.findings[0].evidence
    assert "rank 0 in all_reduce at ex6a_debug.py:44; rank 1 in barrier at ex6a_debug.py:79" in evidence, evidence
    # a peer's leaving alone is no hang: a rank that crashed on its own ends its peers' collectives too
    records[0]["collectives"] = [{**timed_out, "error": "RuntimeError: Connection closed by peer"}]
    assert not rules_sync.hangs(_run(records=records), Facts("/"))


def test_a_job_stopped_at_the_timeout_says_what_the_records_show():
    """Rank 1 had ended, rank 0 had failed (in DDP's buffer broadcast): not 'every rank at the same collective'."""
    died = {"in": "script", "t": 9.0, "error": "RuntimeError: Connection closed by peer", "where": "", "code": ""}
    run = _run(records={0: {"errors": [died], "env": {}}, 1: {"errors": [], "env": {}}}, returncode=None)
    text = still_running(run)
    assert "same collective" not in text and "rank 0 had failed" in text and "rank 1 had ended" in text, text
    same = {r: {"fr": [{"collective_seq_id": 7}]} for r in (0, 1)}
    assert "every rank at the same collective" in still_running(_run(records={}, returncode=None, stuck=same))
    # Issue 51: a rank still running is named where it was, in the words of a hang (rules_sync.stuck_line)
    script = str(ROOT / "x.py")
    stuck = {0: {"stack": [{"file": script, "line": 7}], "current": {"op": "all_reduce"}}}
    text = still_running(_run(records={0: {"script": script}, 1: {"errors": [], "env": {}}}, returncode=None,
                               stuck=stuck))
    assert "rank 0 in all_reduce at x.py:7" in text and "rank 1 had ended" in text, text


def test_an_accuracy_divided_by_one_ranks_share_is_hinted():
    source = (ROOT / "tests/fixtures/doctor/outside_accuracy.py").read_text()
    share = {"total_size": 40, "num_replicas": 2, "rank": 0, "drop_last": False, "shuffle": False}
    records = {r: {"loaders": [_pass(range(r, 40, 2), 40, train=False, distributed=share)],
                   "collectives": [{"op": "all_reduce", "t": 1.0}]} for r in (0, 1)}
    hint = rules_data.divisor_hint(records, source)
    assert "len(val_sampler)" in hint and "20 of the 40" in hint and "2x too large" in hint, hint
    fixed = source.replace("len(val_sampler)", "len(val)")
    assert rules_data.divisor_hint(records, fixed) == ""
    records[0]["collectives"] = records[1]["collectives"] = []  # nothing summed the counts: no hint
    assert rules_data.divisor_hint(records, source) == ""


def test_outside_shapes_say_what_the_run_showed(outcomes):
    """Launched: the rank that aborted on the mismatch comes first; rank-0 evaluation through DDP exits 1 and never
    reads as a job in step; the accuracy divisor is a labelled hint; a cut error shows its cut."""
    uneven = outcomes["outside-uneven-whole-passes"].report
    assert "aborted" in uneven.error and "collective mismatch" in uneven.findings[0].evidence, uneven.text()
    assert uneven.status == 1 and uneven.checked, uneven.text()
    bn = outcomes["outside-bn-rank0-eval"].report
    assert bn.status == 1 and "same collective" not in bn.error, bn.text()
    # Issue 51: rank 1 succeeds, rank 0 fails; torchrun's agent of rank 1's node then waits in its exit barrier for
    # the other's (300 s, in 3 of 5 runs): the runner ends the job once both ranks have exited, not at its timeout.
    assert bn.error.startswith("the script failed (exit code 1)") and "still running" not in bn.error, bn.text()
    assert "outside_eval.py:" in bn.findings[0].evidence, bn.text()
    accuracy = outcomes["outside-accuracy-divisor"].report
    assert any("len(val_sampler)" in h for h in accuracy.hints), accuracy.text()
    assert "read from the source (a hint, not a finding): the script divides by len(val_sampler)" in accuracy.text()
    assert not outcomes["outside-accuracy-fixed-tempfile"].report.hints
    unused = outcomes["outside-unused-branch"].report
    assert "Expected to have finished reduction" in unused.error and " …" in unused.error, unused.text()


def test_the_cost_benchmark_times_the_doctor_three_ways():
    """course.bench_doctor's cost: plain on one node, plain on the doctor's 2 nodes, the doctor; one round here
    (make bench runs 5), so no verdict."""
    from course import bench_doctor

    cost = bench_doctor.overhead("tests/fixtures/doctor/startup_only.py", [], repeats=1, warmup=0)
    assert set(cost["median"]) == {"plain", "plain 2 nodes", "doctor"} and cost["plain_s"] > 0, cost
    assert cost["added_s"] == round(cost["median"]["doctor"] - cost["median"]["plain"], 2)
    assert "too few to decide" in cost["verdict"] and "too few to decide" in cost["verdict_whole"], cost


def test_published_shapes_that_stop_on_a_cpu_are_run_again_as_on_gpus(outcomes):
    """Issue 54: pytorch/examples' device count (torch.accelerator) and the article's is_available() guard stopped
    on the CPU before any process group; the doctor runs them again with the stand-in answering as a machine with a
    GPU per process, and SyncBatchNorm all-reduces its statistics on the CPU, so replicas and gradients are checked.
    A script that exits before any process group, or whose ranks all fail while it exits 0, is never clean."""
    for name in ("published-accelerator-count", "published-guard-syncbn"):
        report = outcomes[name].report
        assert report.status == 0 and "telling the script it has" in report.command, report.text()
    checked = " ".join(outcomes["published-guard-syncbn"].report.checked)
    assert "gradients before" in checked and "replicas" in checked, checked
    early = outcomes["exits-before-process-group"].report
    assert early.status == 2 and early.error.startswith("the script ended without making a process group"), early.text()
    assert "Unable to locate sufficient 4096 devices" in early.error, early.text()
    children = outcomes["children-raise"].report
    assert children.status == 2 and "ValueError: rank" in children.error and "exit status was 0" in children.error, \
        children.text()



def test_a_file_handed_between_ranks_outside_the_working_folder_is_named():
    """Issue 54 item 6: written by one rank and read by another, in the temporary folder or at a fixed path: not
    checked (fine on one machine, not across nodes or jobs); in the working folder: nothing said."""
    for path, said in (("/tmp/initial_weights.pt", True), ("/work/project/initial_weights.pt", False)):
        facts = Facts("/work/project")
        rules_files.handoffs({0: {"writes": [path], "reads": [path]}, 1: {"writes": [], "reads": [path]}}, facts)
        assert bool(facts.unchecked) == said, facts.unchecked
        if said:
            assert f"rank 0 wrote {path} and rank 1 read it" in facts.unchecked[0]
    facts = Facts("/work/project")  # each rank reads back only what it wrote itself: no hand-off
    rules_files.handoffs({0: {"writes": ["/tmp/a.pt"], "reads": ["/tmp/a.pt"]}, 1: {"writes": ["/tmp/b.pt"],
                                                                                   "reads": ["/tmp/b.pt"]}}, facts)
    assert not facts.unchecked
