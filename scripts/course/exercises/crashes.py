"""The kind of a crash, read from what the run saw: the crashing rank's error (its type and text). A crash
becomes ``crash-name`` (a name or attribute that does not exist), ``crash-none`` (None where a tensor belongs:
a .grad never filled), ``crash-not-tensor`` (a collective given a Python number), ``crash-json`` (a tensor
logged as a number), four refusals of backward(): ``crash-grad`` (a non-scalar output without its gradient),
``crash-no-graph`` (a tensor with no graph behind it), ``crash-graph-freed`` (a second backward through a freed
graph), ``crash-leaf-inplace`` (an in-place change of a leaf that requires grad); ``crash-device`` or
``crash-shape``; an error of no known kind stays ``crash``. Each kind has a hint ladder whose first rung names it
(``CRASH_HINTS``, merged into the common hints). ``named`` is applied by ``exercises.check`` after an exercise's
own reading of a crash (exercise 7's shapes, exercise 9's splits), which comes first.
"""

import re

KINDS = (  # (diagnosis, pattern over the error line): the first that matches names the kind
    ("crash-json", r"is not JSON serializable"),
    ("crash-none", r"NoneType"),
    ("crash-not-tensor", r"of type torch\.Tensor|Expected .*Tensor but got|must be (a )?Tensor"),
    ("crash-name", r"^(NameError|UnboundLocalError)\b|^AttributeError: .*has no attribute"),
    # backward() refused, in torch 2.14's words: each cause has its own kind, so that its hints name it
    ("crash-grad", r"implicitly created only for scalar"),
    ("crash-no-graph", r"does not require grad"),
    ("crash-graph-freed", r"backward through the graph a second time"),
    ("crash-leaf-inplace", r"leaf Variable that requires grad"),
    ("crash-device", r"device_ids|same device|\bCUDA\b|\bcuda\b|\bnccl\b|NCCL|No backend type associated"),
    ("crash-shape", (r"size mismatch|cannot be multiplied|must match the size|shape '\[.*\]' is invalid|Sizes of "
                    r"tensors must match|broadcast shape|mat1 and mat2|[Ee]xpected size|nbytes|size of tensor|"
                    r"[Ee]xpected input batch_size|to match target")),  # a loss given inputs and targets of other sizes
)


def kind(error: str) -> str | None:
    """The kind of a crash from the rank's error line ("TypeError: ..."), or None."""
    error = error.strip()
    return next((name for name, pattern in KINDS if re.search(pattern, error)), None)


def named(verdict):
    """A plain ``crash`` verdict renamed to its kind when the crashing rank's error shows one."""
    if verdict.diagnosis != "crash":
        return verdict
    errors = verdict.facts.get("errors") or {}
    error = errors.get(verdict.facts.get("rank"), "") or " ".join(errors.values())
    found = kind(error)
    if found:
        verdict.diagnosis = found
    return verdict


CRASH_HINTS = {
    "crash-name": [
        ("The error is a name Python does not know (NameError, or an AttributeError: the object has no such "
         "attribute) on the line shown: a misspelt variable, function or method, or one used before it is defined."),
        ("Compare that name, letter by letter, with where it is defined: the imports at the top, the variables above "
         "the line, the object's own methods (`dir(obj)` lists them)."),
        "Correct the name (or define it before the line), run the `%%writefile` cell again, then check."],
    "crash-none": [
        ("A value was None where a tensor belongs, on the line shown. Three things give None: a `.grad` that no "
         "backward() filled (its tensor did not require grad before the forward, or it is not the tensor the "
         "backward went through); a variable assigned the result of a call that returns None (dist.all_reduce and "
         "the other collectives work in place and return None; so do in-place methods such as list.append); a "
         "function that ends without `return`."),
        ("Which name on that line is None (the line above says what each held), and where was it last assigned? "
         "A `.grad`: did that very tensor require grad *before* the forward that used it? A call's result: does "
         "that call return anything?"),
        ("A .grad: requires_grad_() on that tensor before its forward, and read it after backward(). A collective: "
         "call it on the tensor and use the tensor (`dist.all_reduce(t)`, then `t`). A function: return the value.")],
    "crash-not-tensor": [
        ("A collective was given a Python number (or another object), not a tensor: torch.distributed works in place "
         "on tensors, and `.item()` turned one into a number too early."),
        "Look at the argument of the dist.* call on the line shown: print(type(x)).",
        "Pass a tensor (for a loss: loss.detach().clone()), all-reduce it, then call .item() on the result."],
    "crash-json": [
        "A tensor was logged where JSON needs a plain number: json.dumps cannot write a torch.Tensor.",
        "Which value of the record is a tensor? print(type(v)) for each.",
        "Turn it into a number with .item() (after the all_reduce) before putting it in the record."],
    "crash-grad": [
        ("backward() was refused: it was called on a tensor that is not a scalar (more than one number), without "
         "the gradient to start from."),
        ("backward() of a non-scalar output needs the gradient of that output: output.backward(grad). Only a scalar "
         "(a loss) can start a backward on its own."),
        ("Call loss.backward() on the scalar loss; an earlier pipeline stage calls output.backward(grad) with the "
         "gradient it received for that output.")],
    "crash-no-graph": [
        ("backward() was refused: the tensor it was called on has no graph behind it, because nothing that requires "
         "grad went into it (a `.detach()` or `.item()` on the way, a forward under `torch.no_grad()`, or "
         "parameters that were all frozen)."),
        ("print(t.requires_grad, t.grad_fn) for the tensor backward() is called on, then for the tensors it was "
         "computed from: where does grad_fn become None?"),
        ("Compute the loss from the model's output in the training step, outside `torch.no_grad()` and without "
         "`.detach()` or `.item()` on the way, and call backward() on it.")],
    "crash-graph-freed": [
        ("backward() ran a second time through a graph that the first backward() had already freed: one forward's "
         "result went into two backward() calls (the same loss twice, or a tensor kept from an earlier step)."),
        ("Count the backward() calls per forward: each needs a forward of its own. A tensor carried from one step "
         "to the next (a running loss, a hidden state) carries that step's graph with it."),
        ("Run a new forward before each backward(), or `.detach()` what you carry from one step to the next "
         "(retain_graph=True only where two backward passes really share one forward).")],
    "crash-leaf-inplace": [
        ("An in-place operation (`add_`, `mul_`, `+=`, a slice assignment) changed a leaf that requires grad (a "
         "parameter, or a tensor created with requires_grad=True) while autograd was recording."),
        ("Which tensor does the in-place call on the line shown change? Is it a parameter, or was it created with "
         "requires_grad=True?"),
        ("Change parameters by hand inside `with torch.no_grad():`, as optimizers do, or compute a new tensor "
         "(x = x + 1) instead of changing one in place.")],
    "crash-device": [
        ("The error is about devices: a tensor or a module on another device than the one asked for (DDP's "
         "device_ids with a model on the CPU, a CUDA call on a machine without one)."),
        ("print(x.device, next(model.parameters()).device) on the line shown. DDP(model, device_ids=[i]) is for a "
         "model on one GPU per process only."),
        "Pick the device once, move the model there, and wrap it: DDP(model) on the CPU, device_ids=[local_rank] on a GPU."],
    "crash-shape": [
        ("The error is about shapes: two tensors whose sizes do not fit (a product, a broadcast, a receive buffer) "
         "on the line shown."),
        "Print the .shape of each tensor on that line, and say which sizes should be equal.",
        ("Make the shapes agree: add the missing axis (gate[:, None]), split along the right dimension, or receive "
         "into a buffer of the sent tensor's shape.")],
}


def reading(record: dict | None, frame: tuple | None) -> str:
    """The failing line of the learner's script and what its names held when the rank died, from the rank's
    record (the recorder keeps them: ``names`` and ``misfit`` of its error), in a sentence or two; "" if the
    record has no such error (a crash outside the learner's script, or no record)."""
    if not record or not frame:
        return ""
    line, _, code = frame
    error = next((e for e in reversed(record.get("errors", [])) if e.get("in") == "script"
                  and e.get("where", "").endswith(f":{line}")), None)
    if not error or not error.get("names"):
        return ""
    held = "; ".join(f"`{name}` {phrase}" for name, phrase in error["names"].items())
    code = code.split("  #")[0].rstrip()
    return f"Line {line} of your script, `{code}`, failed. Its names held: {held}." + (
        f" {error['misfit']}" if error.get("misfit") else "")


def first_hint(verdict, hint: str) -> str:
    """The first rung of a crash's ladder, led by the reading of the failing line where there is one."""
    text = verdict.facts.get("reading") or ""
    return f"{text} {hint}" if text and verdict.diagnosis.startswith("crash") else hint
