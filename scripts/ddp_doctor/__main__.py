"""``ddp-doctor [options] SCRIPT [ARGS...]`` (or ``python -m ddp_doctor``): check a torchrun-ready training script
for data-parallel mistakes. Exit status: 0 nothing wrong (cost notes allowed), 1 a mistake found, 2 could not check."""

import argparse
import math
import sys


def _number(kind, low: float, strict: bool = True):
    """An argparse type: a finite ``kind`` > ``low`` (>= if not ``strict``), else one error line."""
    def parse(text):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
        return value
    return parse


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every bad input gets (no usage block)
        self.exit(2, f"error: {message} ({self.prog} --help)\n")


def main(argv=None) -> int:
    invoked = "ddp-doctor" if sys.argv and sys.argv[0].endswith("ddp-doctor") else "python -m ddp_doctor"
    parser = Parser(
        prog=invoked, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after SCRIPT goes to the script. Files it overwrites or deletes are restored afterwards; "
               "files it creates are moved to runs/doctor/<script>-<key>/files in the current folder (or --out).")
    parser.add_argument("--nproc", type=_number(int, 0), default=None, help="processes (default: 2, or one per GPU)")
    parser.add_argument("--nodes", type=_number(int, 0), default=None,
                        help="simulated nodes (default: one per process on a CPU machine, 1 with GPUs)")
    parser.add_argument("--timeout", type=_number(float, 0), default=180, help="seconds for the whole job")
    parser.add_argument("--hang-after", type=_number(float, 0), default=30,
                        help="the process-group timeout the script gets: a hang ends after it")
    parser.add_argument("--steps", type=_number(int, 0, strict=False), default=8,
                        help="batches per pass over a DataLoader (0: all)")
    parser.add_argument("--compare-batch-arg", default=None, metavar="FLAG",
                        help="e.g. --batch-size: also run 1 process with FLAG's value and compare the first losses")
    parser.add_argument("--launch", choices=("torchrun", "spawn"), default=None,
                        help="how the script is started: under torchrun, or once as `python SCRIPT` (it starts its "
                             "own processes); default: read from the script, then from its first try")
    parser.add_argument("--pretend-gpus", action="store_true",
                        help="on a machine without enough GPUs, tell the script it has one per process (its GPU "
                             "path runs on the CPU stand-in)")
    parser.add_argument("--show-output", action="store_true", help="stream the script's own output")
    parser.add_argument("--out", default=None, metavar="FOLDER",
                        help="the doctor's folder for this check (records, report, moved files)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    from ddp_doctor.doctor import check
    from ddp_doctor.rundir import RunDirBusy, RunDirError

    try:
        report = check(options.script, options.args, options.nproc, nodes=options.nodes, timeout=options.timeout,
                       hang_after=options.hang_after, steps=options.steps,
                       compare_batch_arg=options.compare_batch_arg, folder=options.out, launch=options.launch,
                       pretend_gpus=options.pretend_gpus,
                       on_line=(lambda line: print(line, end="", flush=True)) if options.show_output else None)
    except RunDirBusy:
        print(f"error: another doctor is checking {options.script} now: wait for it to end", file=sys.stderr)
        return 2
    except (ValueError, RunDirError) as error:  # a bad argument, an unwritable folder
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted: every process of the job was ended and your files were put back", file=sys.stderr)
        return 2
    return report.status


if __name__ == "__main__":
    sys.exit(main())
