"""Read the flight recorder's dumps (one file per rank) and name the first collective the ranks did not match.

torch 2.14's analyzer (``python -m torch.distributed.flight_recorder.fr_trace``) looks each entry's process
group up in the dump's ``pg_config``; ProcessGroupNCCL fills that in, gloo's groups do not (it holds one
unnamed ``''`` entry), so on gloo dumps the analyzer stops with ``KeyError: ('0', 0)``. ``analyzer`` runs it
and reports what it said; ``first_mismatch`` does the comparison it would have done, for collectives.
"""

import pickle
import subprocess
import sys
from pathlib import Path


def read_dumps(folder: Path, prefix: str = "trace_") -> dict[int, dict]:
    """{rank: the unpickled dump} for every file ``<prefix><rank>`` in ``folder``."""
    dumps = {}
    for path in sorted(Path(folder).glob(f"{prefix}*")):
        suffix = path.name[len(prefix):]
        if suffix.isdigit():
            dumps[int(suffix)] = pickle.loads(path.read_bytes())
    return dumps


def collectives(dump: dict) -> dict[tuple[str, int], dict]:
    """{(process group, collective sequence number): entry} of one rank's dump (point-to-point left out)."""
    return {(e["process_group"][0], e["collective_seq_id"]): e for e in dump.get("entries", []) if not e["is_p2p"]}


def signature(entry: dict) -> tuple:
    """What every rank must agree on for one collective: its operation and its tensors' sizes and types."""
    return entry["profiling_name"], str(entry["input_sizes"]), str(entry["input_dtypes"])


def table(dumps: dict[int, dict]) -> list[str]:
    """One line per rank and collective: sequence number, operation, sizes, state."""
    lines = []
    for rank, dump in sorted(dumps.items()):
        for (group, seq), e in sorted(collectives(dump).items(), key=lambda item: item[0][1]):
            lines.append(f"rank {rank}  group {group}  #{seq:<3} {e['profiling_name']:<18} "
                         f"sizes {e['input_sizes']}  {e['state']}")
    return lines


def first_mismatch(dumps: dict[int, dict]) -> dict | None:
    """The first (group, sequence number) at which the ranks' collectives differ, or that some rank lacks.

    Returns {"group", "seq", "by_rank": {rank: (operation, sizes, dtypes) or None}} or None when all match.
    """
    per_rank = {rank: collectives(dump) for rank, dump in dumps.items()}
    keys = sorted({key for entries in per_rank.values() for key in entries}, key=lambda k: (k[1], k[0]))
    for key in keys:
        by_rank = {rank: signature(entries[key]) if key in entries else None for rank, entries in per_rank.items()}
        if len(set(by_rank.values())) > 1:
            return {"group": key[0], "seq": key[1], "by_rank": by_rank}
    return None


def describe(mismatch: dict | None) -> str:
    """One sentence for a mismatch found by first_mismatch."""
    if mismatch is None:
        return "every rank recorded the same collectives: no mismatch in the dumps"
    said = "; ".join(f"rank {rank} " + (f"called {sig[0]} {sig[1]}" if sig else "never called it")
                     for rank, sig in sorted(mismatch["by_rank"].items()))
    return f"collective #{mismatch['seq']} of process group {mismatch['group']} does not match: {said}"


def analyzer(folder: Path, prefix: str = "trace_", timeout: float = 120) -> tuple[int, str]:
    """Run torch's flight recorder analyzer on ``folder``: (its exit code, its last line of output)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                           "--prefix", prefix], check=False, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else ""
