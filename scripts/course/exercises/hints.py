"""The hint ladder shared by every exercise: hints per diagnosis go from the symptom, to the tool that finds
it, to the cause; each check of the same mistake (or each ``hint()``) shows one more, never the answer first.

``COMMON_HINTS`` holds the diagnoses any exercise can meet (a crash, a hang, a syntax error, gaps left,
a step an exact factor off); an exercise's own hints come first. ``level()`` says which rung is shown.
A hint may hold ``{detail}``: what the check measured that points at the cause (``Verdict.facts["detail"]``,
kept in the results file), shown only when that rung is reached (``filled``).
"""

from course.exercises.crashes import CRASH_HINTS

COMMON_HINTS = {
    "missing": ["Run the `%%writefile` cell of the exercise (it writes the script), then this cell."],
    "syntax": [("Python cannot read the script: fix the line shown (the caret points where Python gave up), run "
                "the `%%writefile` cell again, then this cell."),
               "Look also at the line above the one shown: an unclosed bracket or quote is often reported one line late.",
               "Indentation counts: the filled-in lines must line up with the code around the gap."],
    "gaps": [("Replace each `...` marked `# TODO` with your code (the comment can stay), run the `%%writefile` cell, "
              "then this cell.")],
    "crash": ["Read the error and the line of your script it points to: which name or shape does it complain about?",
              ("Run the script by hand to see every rank's whole output: `torchrun --standalone --nproc-per-node=2 "
               "scripts/<name>.py`, or read output.txt in the run folder."),
              ("If the error is about a name that does not exist, compare your line with the imports at the top and "
               "the variables defined above it; for a shape or device error print the tensors' .shape and .device.")],
    "hang": [("One rank waited in a collective (all_reduce, broadcast, barrier, ...) that the other never called, or "
              "called in another order; the process-group timeout ended it. The lines above show where each rank was."),
             ("Every collective must be called by every rank, the same number of times, in the same order. Look for a "
              "collective inside an `if` on the rank, or in a loop whose length differs between ranks (notebook 03 "
              "step 5, collectives on every rank and printing on rank 0; notebook 04 section 7, uneven inputs; deep "
              "dive: 04b section 12, a collective only some ranks call)."),
             ("Find the collective in the rank that timed out, then the condition or loop that keeps the other rank "
              "from reaching it, and make every rank call it.")],
    "no-trace": [("Keep the lines that create `trace = Trace(...)`, call `trace.step(...)` and `trace.save()`: the "
                  "checker reads what they record.")],
    "steps": [("The number of optimizer steps differs from the reference: check the loop bounds and the batch size "
               "(per process, as the check passes it).")],
    "differs": ["Compare your step with the reference: which parameters differ first, and by how much?",
                ("Print, on each rank, a gradient's norm after your averaging and the same gradient's norm on one "
                 "process with the whole batch: they should be equal."),
                ("Check each line between backward() and optimizer.step(): the gradient every rank applies must be the "
                 "mean over ranks of their gradients.")],
    "loss-differs": ["The parameters are right but the recorded losses are not: record the loss of the step you took."],
    "no-output": [("The job ended without writing what the check reads (the line above names the file): keep the "
                   "script's saving lines as they were given.")],
    "no-broadcast": ["At step 0 the ranks hold different weights: nothing made them start from the same ones.",
                     "Which collective copies rank 0's tensors to every rank? (DDP does it when it wraps the model.)",
                     "Broadcast every parameter from rank 0 before the first step (or wrap the model in DDP)."],
    "wrong-start": ["The ranks agree at step 0, but not on rank 0's initial weights: which rank's did you copy?",
                    "The reference starts from rank 0's weights.",
                    "Broadcast with src=0."],
    "ranks-differ": ["After a step the ranks' copies differ: they applied different gradients or updates.",
                     "Print a gradient's norm on each rank just before optimizer.step(): it must be the same on every rank.",
                     "Every gradient must be averaged over the ranks (all_reduce, then divide by the world size) before the step."],
    "summed": ["The step is world-size times the reference's: the gradients were added up over the ranks, not averaged.",
               "all_reduce sums by default: where is the division by the world size?",
               "Divide the summed gradients by the world size (or all_reduce with op=dist.ReduceOp.AVG)."],
    "halved": ["The step is 1/world size of the reference's: the average was divided once too often.",
               "Count the divisions by the world size between backward() and optimizer.step() (ReduceOp.AVG divides too).",
               "Sum with all_reduce and divide once, or use ReduceOp.AVG alone."],
    "log-unreadable": [("The log file holds broken lines: two processes wrote into it at once. Which ranks open it for "
                        "writing?"),
                       "Only one process (rank 0) should open and write the log; the others should not touch it."],
}

COMMON_HINTS.update(CRASH_HINTS)  # a crash of a known kind (course.exercises.crashes)

COMMON_HINTS["factor"] = [
    ("The step is an exact multiple (or fraction) of the reference's: the factor is in the line above. Something "
     "is added up, or divided, that many times where it should be once."),
    ("What in your script counts to that factor: the world size (ranks), the micro-batches, the buckets? Print "
     "one gradient's norm on each rank and on one process with the whole batch and compare."),
    ("Between backward() and optimizer.step() the gradient must be the mean over every sample of the global "
     "batch: one sum over the ranks, divided once by the world size (and losses divided by the micro-batches).")]


# Diagnoses whose first rung says where to look, not which kind of mistake it is (a crash or a hang not read
# further, a plain difference): the benchmark counts a first rung for one of them as "generic" (course.bench_checker).
GENERIC = frozenset({"crash", "hang", "differs", "loss-differs", "wrong-output", "wrong-weight-grad", "wrong-input-grad",
                     "outputs", "stage1", "later-step", "indices", "steps", "val-count", "params-differ"})


UNKNOWN = [("Read the line above: it says what the check measured. Compare that part of your script with the exercise's "
           "description (tests/test_exercises_api.py holds every diagnosis to a hint of its own, so this is a gap).")]


def hints_for(diagnosis: str, own: dict) -> list[str]:
    """The hints for a diagnosis: the exercise's own, else the common ones (never another exercise's)."""
    return own.get(diagnosis) or COMMON_HINTS.get(diagnosis) or UNKNOWN


def level(seen: int, extra: int, count: int) -> int:
    """The rung shown (1-based): one per check that saw the mistake plus one per hint() asked, at most all."""
    return max(1, min(seen + extra, count))


def filled(hint: str, detail: str | None) -> str:
    """A hint with the check's measured detail in place of ``{detail}``."""
    return hint.replace("{detail}", (detail or "").strip())
