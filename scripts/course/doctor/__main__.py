"""``python -m course.doctor [options] SCRIPT [ARGS...]``: check a torchrun-ready training script for data-parallel
mistakes. Exit status: 0 nothing wrong (cost notes allowed), 1 a mistake found, 2 could not check."""

import argparse
import sys

from course.args import nonnegative_int, positive_float, positive_int


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every bad input gets (no usage block)
        self.exit(2, f"error: {message} ({self.prog} --help)\n")


def main(argv=None) -> int:
    invoked = "ddp-doctor" if sys.argv and sys.argv[0].endswith("ddp-doctor") else "python -m course.doctor"
    parser = Parser(
        prog=invoked, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after SCRIPT goes to the script. Files it overwrites or deletes are restored afterwards; "
               "files it creates are moved to runs/doctor/<script>-<key>/files.")
    parser.add_argument("--nproc", type=positive_int, default=None, help="processes (default: 2, or one per GPU)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="simulated nodes (default: one per process on a CPU machine, 1 with GPUs)")
    parser.add_argument("--timeout", type=positive_float, default=180, help="seconds for the whole job")
    parser.add_argument("--hang-after", type=positive_float, default=30,
                        help="the process-group timeout the script gets: a hang ends after it")
    parser.add_argument("--steps", type=nonnegative_int, default=8, help="batches per pass over a DataLoader (0: all)")
    parser.add_argument("--compare-batch-arg", default=None, metavar="FLAG",
                        help="e.g. --batch-size: also run 1 process with FLAG's value and compare the first losses")
    parser.add_argument("--show-output", action="store_true", help="stream the script's own output")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    from course.doctor import check
    from course.rundir import RunDirBusy
    from course.train_utils import CourseError

    try:
        report = check(options.script, options.args, options.nproc, nodes=options.nodes, timeout=options.timeout,
                       hang_after=options.hang_after, steps=options.steps,
                       compare_batch_arg=options.compare_batch_arg,
                       on_line=(lambda line: print(line, end="", flush=True)) if options.show_output else None)
    except RunDirBusy:
        print(f"error: another doctor is checking {options.script} now: wait for it to end", file=sys.stderr)
        return 2
    except (ValueError, CourseError) as error:  # a bad argument, an unwritable folder
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted: every process of the job was ended and your files were put back", file=sys.stderr)
        return 2
    return report.status


if __name__ == "__main__":
    sys.exit(main())
