"""``torch.multiprocessing.spawn`` from a notebook (pitfall 11): bounded in time, the children's output captured.

Spawned children write to the file descriptors they inherit (the kernel's, not the cell's), so
``output_of_children`` points fds 1 and 2 at a file while they run; ``spawn_bounded`` ends every
child before it returns.
"""

import contextlib
import os
import tempfile
import time

import torch.multiprocessing as mp


@contextlib.contextmanager
def output_of_children():
    """Point this process's stdout/stderr file descriptors, which child processes inherit, at a file.
    Yields a list that holds the captured text once the block has ended."""
    with tempfile.TemporaryFile(mode="w+") as file:
        saved = os.dup(1), os.dup(2)
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        text = []
        try:
            yield text
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            file.seek(0)
            text.append(file.read())


def spawn_bounded(fn, args=(), nprocs: int = 2, timeout: float = 60) -> list[int | None]:
    """mp.spawn with a deadline; every child is ended before this returns. Returns the exit codes."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawned processes still running after {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [process.exitcode for process in context.processes]
