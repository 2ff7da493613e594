"""The `semoe` command line: parses arguments, calls the library, prints.

Exit codes: 0 success, 1 a check failed (e.g. `store verify` found damage), 2 bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Sequence

from semoe.kernels.loader import KernelABIError
from storage.errors import StorageError
from tools.cli_output import UsageError

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; each subcommand module adds its own parsers."""
    from tools import demo_cmd, env_cmd, eval_cmd, generate_cmd, plan_cmd, serve_cmd, store_cmd, train_cmd

    parser = argparse.ArgumentParser(
        prog="semoe",
        description="Train and serve Mixture-of-Experts models larger than GPU memory.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    store_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    eval_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    train_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    env_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `semoe` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except (StorageError, UsageError, ValueError) as e:
        # one line naming the file, tensor or flag; details with -v
        logging.getLogger("semoe").debug("error", exc_info=True)
        print(f"semoe: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2: bad input; 1: a check failed or the machine gave out
    except KernelABIError as e:  # an install whose kernels and their mirrors disagree
        print(f"semoe: error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"semoe: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, I/O error: the library has already rolled back its writes
        name = f"{e.filename}: " if e.filename else ""
        print(f"semoe: error: {name}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("semoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
