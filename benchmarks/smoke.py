"""`--smoke` for the benchmarks: tiny sizes and one repeat, so that a benchmark runs its whole code path in
seconds and prints its last-line JSON as it always does. A smoke run checks that the benchmark still works
(tests/benchmarks/test_benchmarks.py runs every one so); its figures measure nothing.

Each benchmark is run as a script (`python benchmarks/NAME.py`), which puts this folder on `sys.path`.
"""

from __future__ import annotations

import argparse


def parse_args(parser: argparse.ArgumentParser, **tiny: object) -> argparse.Namespace:
    """Adds `--smoke` to `parser` and parses the command line. With `--smoke` the arguments named in `tiny`
    (by their destination, e.g. `row_tokens`) default to those values; arguments given on the command line win."""
    sizes = ", ".join(f"{k}={v}" for k, v in tiny.items())
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny sizes and one repeat, to check that the benchmark runs (measures nothing): {sizes}",
    )
    args = parser.parse_args()
    unknown = sorted(set(tiny) - set(vars(args)))
    if unknown:  # a renamed argument must not leave the smoke run at full size unnoticed
        raise ValueError(f"smoke sizes name arguments the parser does not have: {unknown}")
    if args.smoke:
        parser.set_defaults(**tiny)
        args = parser.parse_args()
    return args
