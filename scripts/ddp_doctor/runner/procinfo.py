"""The process table without psutil, for ``processes`` where psutil is not installed (the doctor taken home:
``ddp-doctor`` requires torch alone). Only what ``processes`` uses of psutil's ``Process``: its creation time,
whether it is a zombie, its descendants, SIGTERM/SIGKILL (never to a process that has since reused the pid).

Linux reads ``/proc``; elsewhere (macOS) ``ps`` tells the same. The course's own environment has psutil.
"""

import os
import signal
import subprocess
import time

STATUS_ZOMBIE = "zombie"


class Error(Exception):
    pass


class NoSuchProcess(Error):
    pass


_PROC = os.path.isdir("/proc/self")
_BOOT: list = []


def _boot_time() -> float:
    if not _BOOT:
        with open("/proc/stat") as f:
            _BOOT.append(next(float(line.split()[1]) for line in f if line.startswith("btime ")))
    return _BOOT[0]


def _linux(pid: int):
    """(ppid, state letter, creation time) of one process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command name)": the name may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _ps(pid: int | None = None) -> dict:
    """pid -> (ppid, state letter, creation time) from ``ps`` (one process, or all)."""
    which = ["-p", str(pid)] if pid else ["-A"]
    try:
        out = subprocess.run(["ps", *which, "-o", "pid=,ppid=,stat=,lstart="], check=False, capture_output=True,
                             text=True, env={**os.environ, "LC_ALL": "C"}, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    table = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4:
            try:
                started = time.mktime(time.strptime(" ".join(parts[3].split()), "%a %b %d %H:%M:%S %Y"))
            except ValueError:
                continue
            table[int(parts[0])] = (int(parts[1]), parts[2][:1], started)
    return table


def _info(pid: int):
    return _linux(pid) if _PROC else _ps(pid).get(pid)


def _table() -> dict:
    if not _PROC:
        return _ps()
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := _linux(int(name))):
            table[int(name)] = info
    return table


class Process:
    def __init__(self, pid: int | None = None):
        self.pid = os.getpid() if pid is None else pid
        info = _info(self.pid)
        if info is None:
            raise NoSuchProcess(self.pid)
        self._created = info[2]

    def _now(self):
        info = _info(self.pid)
        if info is None or abs(info[2] - self._created) > 1:  # gone, or the pid now names another process
            raise NoSuchProcess(self.pid)
        return info

    def create_time(self) -> float:
        return self._created

    def status(self) -> str:
        return STATUS_ZOMBIE if self._now()[1] == "Z" else "running"

    def is_running(self) -> bool:
        try:
            self._now()
            return True
        except NoSuchProcess:
            return False

    def children(self, recursive: bool = False) -> list:
        table, found, todo = _table(), [], [self.pid]
        while todo:
            parent = todo.pop()
            for pid, (ppid, _, _) in table.items():
                if ppid == parent and pid != parent:
                    try:
                        found.append(Process(pid))
                    except NoSuchProcess:
                        continue
                    if recursive:
                        todo.append(pid)
        return found

    def _signal(self, sig) -> None:
        self._now()
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            raise NoSuchProcess(self.pid) from None
        except PermissionError as error:
            raise Error(str(error)) from None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout=None) -> None:
        """Reap it if it is this process's own child and has ended (``timeout`` 0 only, as ``processes`` uses)."""
        os.waitpid(self.pid, os.WNOHANG)  # ChildProcessError for another's child: the caller expects it
