"""Issue 55: a crash is read from the learner's own line. The recorder keeps, where a rank dies in the script, what
the names on the failing line held (recorder_failing_line, on the ranks' side); the checker's first hint quotes the
line, those values and one sentence on which of them does not fit. Here the reading itself, on frames made in this
process; tests/test_exercises_launched.py checks it on every launched crash of the test set."""

import sys
from pathlib import Path

import torch

from ddp_doctor.recorder import ENTRY

sys.path.insert(0, str(Path(ENTRY).parent))  # the recorder's modules import by their plain names, as in a rank
import recorder_failing_line as failing


class Frame:  # what held() reads of a frame: its locals, globals and builtins
    def __init__(self, **values):
        self.f_locals, self.f_globals, self.f_builtins = values, {}, __builtins__ if isinstance(__builtins__, dict) \
            else vars(__builtins__)


def test_the_expressions_a_line_reads_are_found_without_calling_anything():
    assert failing.expressions_on("dist.send(inputs[i].grad, dst=0)  # back to stage 0") == [
        "dist.send", "inputs[i].grad", "i"]
    assert failing.expressions_on("loss = F.cross_entropy(model(x), batch.y[:, 0])") == [
        "F.cross_entropy", "model", "x", "batch.y[:, 0]"]
    assert failing.expressions_on("for images, labels in loader:") == ["loader"]


def test_what_the_names_held_tensors_none_numbers_and_methods():
    frame = Frame(out=None, labels=torch.zeros(32, 1, dtype=torch.long), w=torch.ones(3, device="meta"),
                  inputs=[torch.zeros(2)], i=0, device=torch.device("cpu"))
    held = failing.held(frame, "loss = cross_entropy(out, labels) + w.sum() + inputs[i].grad + len(device)")
    assert held == {"out": "None", "labels": "tensor of shape [32, 1], int64, on cpu",
                    "w": "tensor of shape [3], float32, on meta", "inputs[i].grad": "None", "i": "int 0",
                    "device": "device cpu"}, held


def test_one_sentence_says_which_name_does_not_fit():
    source = "import torch.distributed as dist\n\ndef f(x):\n    out = dist.all_reduce(x)\n    return out.sum()\n"
    # Issue 55's two misleading first hints: None for another reason than a tensor that did not require grad.
    assert failing.misfit("AttributeError: 'NoneType' object has no attribute 'sum'", {"out": "None"}, source, 5) == (
        "`out` is None: it was assigned `dist.all_reduce(x)` on line 4, which returned None.")
    assert failing.misfit("TypeError: unsupported operand type(s) for /=: 'NoneType' and 'int'", {"p.grad": "None"}).startswith(
        "`p.grad` is None: no backward() reached `p`")
    assert failing.misfit("RuntimeError: 0D or 1D target tensor expected, multi-target not supported",
                          {"out": "tensor of shape [32, 10], float32, on cpu, requires grad",
                           "labels": "tensor of shape [32, 1], int64, on cpu"}) == (
        "`labels` has shape [32, 1]; the loss wants one class index per sample, shape [32].")
    assert failing.misfit("RuntimeError: Tensor on device meta is not on the expected device cpu!",
                          {"w": "tensor of shape [3], float32, on meta",
                           "x": "tensor of shape [4, 3], float32, on cpu"}) == "`w` is on meta, `x` on cpu."
    assert failing.misfit("TypeError: all_reduce(): argument 'tensor' must be Tensor, not float",
                          {"summed": "float 1.4"}) == "`summed` is a Python float, not a tensor."
    assert failing.misfit("TypeError: Object of type Tensor is not JSON serializable",
                          {"record": "dict of 2 whose 'loss' is a tensor"}) == (
        "`record` holds a tensor where JSON needs a number.")


def test_a_misspelt_name_gets_the_closest_that_exists():
    world_size = 2  # noqa: F841 - read through the frame
    frame = sys._getframe()
    assert failing.did_you_mean("NameError: name 'world_sise' is not defined", frame) == (
        "`world_sise` is not defined here: did you mean `world_size`?")
    assert failing.did_you_mean("AttributeError: 'int' object has no attribute 'bit_lenght'", Frame(n=3)) == (
        "`int` objects have no `bit_lenght`: did you mean `bit_length`?")
