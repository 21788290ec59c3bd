"""What the names on a failing line held when the rank died (recorded on the ranks' side, read by the checker):
each name's type, and for a tensor its shape, dtype, device and requires_grad; for None, None; for a number or a
short string its value. ``misfit`` says in one sentence which of them does not fit the error."""

import ast
import io
import keyword
import re
import tokenize

MAX_NAMES = 8


PURE = (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Slice, ast.Load, ast.Tuple, ast.UnaryOp, ast.USub)


def _parsed(line: str):
    """The line as an expression or statement (a block header gets a body), or None."""
    code = line.strip().split("  #")[0].rstrip()
    for text in (code, code + " pass" if code.endswith(":") else None, code.removesuffix(":") if code.endswith(":") else None):
        if text:
            try:
                return ast.parse(text)
            except SyntaxError:
                continue
    return None


def _pure(node) -> bool:  # names, attributes, subscripts and constants only: reading it calls nothing of the script's
    return all(isinstance(n, PURE) for n in ast.walk(node))


def expressions_on(line: str) -> list[str]:
    """The largest call-free expressions a line reads (``inputs[i].grad``, ``batch.x``, ``out``), in order."""
    tree = _parsed(line)
    if tree is None:
        return names_on(line)
    found = []

    def visit(node):
        if isinstance(node, ast.Attribute | ast.Subscript | ast.Name) and _pure(node) and \
                isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
            for sub in ast.walk(node):  # and what it indexes with: `i` of `inputs[i].grad`
                if isinstance(sub, ast.Subscript):
                    found.extend((n.lineno, n.col_offset, n.id) for n in ast.walk(sub.slice) if isinstance(n, ast.Name))
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return list(dict.fromkeys(text for *_, text in sorted(found)))


def names_on(line: str) -> list[str]:
    """The names (and dotted attribute chains such as ``batch.x``) a line of code reads, in order, once each."""
    found, chain = [], []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
    previous = None
    for token in tokens:
        if token.type == tokenize.NAME and not keyword.iskeyword(token.string):
            if chain and previous == ".":
                chain.append(token.string)
            else:
                if chain:
                    found.append(".".join(chain))
                chain = [token.string] if previous != "." else []
        elif not (token.type == tokenize.OP and token.string == "." and chain):
            if chain:
                found.append(".".join(chain))
            chain = []
        previous = token.string
    if chain:
        found.append(".".join(chain))
    return list(dict.fromkeys(n for n in found if n))


def describe(value) -> str | None:
    """One short phrase for a value, or None where it says nothing useful (a module, a function, a class)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the ranks always have torch
        torch = None
    if value is None:
        return "None"
    if torch is not None and isinstance(value, torch.device):
        return f"device {value}"
    if torch is not None and isinstance(value, torch.Tensor):
        shape = list(value.shape)
        grad = ", requires grad" if value.requires_grad else ""
        dtype = str(value.dtype).removeprefix("torch.")
        return f"tensor of shape {shape}, {dtype}, on {value.device}{grad}"
    if isinstance(value, bool | int | float):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:40]!r}"
    if isinstance(value, list | tuple):
        inner = f" of {type(value[0]).__name__}" if value else ""
        return f"{type(value).__name__} of {len(value)}{inner}"
    if isinstance(value, dict):
        tensors = [k for k, v in value.items() if torch is not None and isinstance(v, torch.Tensor)]
        return f"dict of {len(value)}" + (f" whose {tensors[0]!r} is a tensor" if tensors else "")
    if callable(value) or type(value).__name__ == "module":
        return None
    if torch is not None and isinstance(value, torch.nn.Module):
        return None
    return type(value).__name__


def _lookup(name: str, frame):
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):  # a subscript: evaluated, call-free (checked by _pure)
        tree = _parsed(name)
        if tree is None or not isinstance(tree.body[0], ast.Expr) or not _pure(tree.body[0].value):
            return False, None
        try:
            return True, eval(compile(ast.Expression(tree.body[0].value), "<line>", "eval"),
                              frame.f_globals, frame.f_locals)
        except Exception:  # noqa: BLE001 - not readable at this point: nothing to show
            return False, None
    head, *rest = name.split(".")
    scopes = (frame.f_locals, frame.f_globals, frame.f_builtins)
    for scope in scopes:
        if head in scope:
            value = scope[head]
            break
    else:
        return False, None
    for attr in rest:
        try:
            value = getattr(value, attr)
        except Exception:  # noqa: BLE001 - a property that raises: nothing to show
            return False, None
    return True, value


def held(frame, line: str) -> dict[str, str]:
    """What each name on ``line`` held in ``frame``: {name: phrase}, at most MAX_NAMES, skipping modules,
    functions and classes (the call's target is not what went wrong)."""
    shown = {}
    for name in expressions_on(line):
        while name:  # `w.sum` or `outputs[i].backward` is a method: show `w`, `outputs[i]`
            ok, value = _lookup(name, frame)
            phrase = describe(value) if ok else None
            if phrase is not None:
                shown.setdefault(name, phrase)
                break
            name = name.rsplit(".", 1)[0] if re.search(r"\.\w+$", name) else ""
        if len(shown) >= MAX_NAMES:
            break
    return shown


def _assigned_from(name: str, source: str, lineno: int) -> tuple[int, str] | None:
    """The last assignment ``name = <call>`` above ``lineno`` in ``source``: (its line, the call's text)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.lineno < lineno and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (any(ast.unparse(t) == name for t in targets) and isinstance(node.value, ast.Call)
                    and (best is None or node.lineno > best[0])):
                best = (node.lineno, ast.unparse(node.value))
    return best


def _tensors(shown: dict) -> dict:
    return {n: p for n, p in shown.items() if p.startswith("tensor of shape")}


def _field(phrase: str, key: str) -> str:
    shape, dtype, device = re.match(r"tensor of shape (\[[^\]]*\]), (\w+), on (\S+?)(?:,|$)", phrase).groups()
    return {"shape": shape, "dtype": dtype, "device": device}[key]


def did_you_mean(error: str, frame) -> str:
    """For a NameError or an AttributeError: the unknown name and the closest one that exists, in one sentence."""
    import difflib

    missing = re.match(r"NameError: name '(\w+)' is not defined", error)
    if missing:
        known = set(frame.f_locals) | set(frame.f_globals) | set(dir(frame.f_builtins))
        what = f"`{missing[1]}` is not defined here"
    else:
        missing = re.match(r"AttributeError: '(\w+)' object has no attribute '(\w+)'", error)
        if not missing:
            return ""
        owner = next((v for v in list(frame.f_locals.values()) + list(frame.f_globals.values())
                      if type(v).__name__ == missing[1]), None)
        known = set(dir(owner)) if owner is not None else set()
        what = f"`{missing[1]}` objects have no `{missing[2]}`"
    close = difflib.get_close_matches(missing.groups()[-1], sorted(known), n=1)
    return what + (f": did you mean `{close[0]}`?" if close else ".")


def misfit(error: str, shown: dict, source: str = "", lineno: int = 0) -> str:
    """One sentence: which of the names on the failing line does not fit the error, from what they held."""
    if "device_ids" in error:
        cpu = [n for n, p in shown.items() if p == "device cpu"]
        if cpu:
            return (f"`{cpu[0]}` is the CPU: device_ids is for a model on one GPU per process; leave it out on the "
                    "CPU.")
    nones = [n for n, p in shown.items() if p == "None"]
    if nones and ("NoneType" in error or "None" in error):
        name = nones[0]
        origin = _assigned_from(name, source, lineno) if source else None
        if origin:
            return (f"`{name}` is None: it was assigned `{origin[1][:60]}` on line {origin[0]}, "
                    "which returned None.")
        if name.endswith(".grad"):
            return (f"`{name}` is None: no backward() reached `{name[:-5]}` (it did not require grad before the "
                    "forward, or the loss does not depend on it).")
        return f"`{name}` is None where the call needs a value."
    tensors = _tensors(shown)
    devices = {n: _field(p, "device") for n, p in tensors.items()}
    if len(set(devices.values())) > 1:
        first, *others = devices.items()
        return f"`{first[0]}` is on {first[1]}, " + ", ".join(f"`{n}` on {d}" for n, d in others) + "."
    dtype_error = re.search(r"expected scalar type (\w+) but found (\w+)|expected .*dtype|dtype", error)
    if dtype_error and tensors:
        return "The dtypes on that line: " + ", ".join(f"`{n}` {_field(p, 'dtype')}" for n, p in tensors.items()) + "."
    if re.search(r"size|shape|dimension|target|batch_size|mat1|broadcast", error) and tensors:
        if re.search(r"(0D or )?1D target tensor expected|multi-target not supported", error):
            wrong = [n for n, p in tensors.items() if _field(p, "dtype").startswith("int") and
                     _field(p, "shape").count(",") >= 1]
            if wrong:
                shape = _field(tensors[wrong[0]], "shape")
                return (f"`{wrong[0]}` has shape {shape}; the loss wants one class index per sample, "
                        f"shape [{shape[1:].split(',')[0]}].")
        return "The shapes on that line: " + ", ".join(f"`{n}` {_field(p, 'shape')}" for n, p in tensors.items()) + "."
    if "JSON serializable" in error:
        holders = [n for n, p in shown.items() if "is a tensor" in p or p.startswith("tensor")]
        if holders:
            return f"`{holders[0]}` {'holds' if 'is a tensor' in shown[holders[0]] else 'is'} a tensor where JSON needs a number."
    numbers = [n for n, p in shown.items() if p.startswith(("int ", "float "))]
    if numbers and "Tensor" in error:
        return f"`{numbers[0]}` is a Python {shown[numbers[0]].split()[0]}, not a tensor."
    return ""


def add_reading(entry: dict, error: BaseException, script: str) -> None:
    """Add ``names`` and ``misfit`` to a script error's record entry, from the deepest frame of ``script`` in the
    error's traceback; never lets the reading hide the script's own error (a failure is noted as ``names_error``)."""
    import traceback

    live = [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__) if frame.f_code.co_filename == script]
    if not live:
        return
    try:
        with open(script, encoding="utf-8") as file:
            source = file.read()
        entry["names"] = held(live[-1][0], entry["code"])
        entry["misfit"] = did_you_mean(entry["error"], live[-1][0]) or misfit(entry["error"], entry["names"], source,
                                                                               live[-1][1])
    except Exception as reading_failed:  # noqa: BLE001 - the learner's error comes first
        entry["names_error"] = repr(reading_failed)[:200]

