"""The DDP doctor: runs a data-parallel training script of yours for a few steps on several processes under a
recorder and names its mistakes, each with the run's evidence, the fix and the lesson that teaches it.

    ddp-doctor train.py --epochs 2                 # or python -m ddp_doctor; exit status 0 / 1 / 2
    from ddp_doctor import check                   # in a notebook: the same report as a table
    report = check("train.py", args=["--epochs", "2"])

A package of its own, installed alone (``make doctor-wheel``: torch its only requirement); it imports nothing of
the course that teaches it, and its folders are relative to where it runs (``runs/doctor/...``). The course's
helpers (``course``) build on it, never the reverse. One module per concern:
- ``doctor``      ``check`` and ``diagnose``: a run, the rules, the report; ``__main__`` the command
- ``unchecked``   why a check is not complete: a rank's own failure, a job still running, nothing checked
- ``running``     a learner's script as a job: its launch style read from the code, bounded, files put back
- ``rules_data`` / ``rules_sync`` / ``rules_ddp``  what the run did, turned into findings; ``report`` formats them
- ``recorder``    a package: what runs inside the ranks (the recorder, its CPU stand-in for CUDA and NCCL, the
  processes a script starts itself); shared with the course's exercise checker
- ``runner``      a package: start, bound, watch and stop a torchrun job and name the failing rank; shared with
  the course's notebook launcher
- ``hardware``    which device and backend a job's processes use: one rule, for every accelerator
- ``rundir``      one live run per folder (an atomic claim), results replaced all at once

Importing the package is light: ``check`` and the rest load on first use.
"""

__all__ = ["Finding", "Job", "Report", "Run", "check", "diagnose", "doctor_folder"]


def __getattr__(name: str):
    if name in __all__:
        from ddp_doctor import doctor

        return getattr(doctor, name)
    raise AttributeError(f"module 'ddp_doctor' has no attribute {name!r}")
