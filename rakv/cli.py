"""The command-line contract shared by the project's CLIs: a known error is one line on
stderr and exit status 2, a warning is one line (``warning: ...``), Ctrl-C is one line
and status 130, never a traceback."""
from __future__ import annotations

import sys
import warnings
from typing import Callable


def run_cli(run: Callable[[object], int], args, errors: tuple[type[BaseException], ...],
            interrupted: str = "interrupted") -> int:
    """``run(args)``'s status; ``errors`` become ``error: <message>`` and status 2."""
    warnings.formatwarning = _one_line
    try:
        return run(args)
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def weights_spec(text: str) -> str:
    """argparse's type for ``--weights``: MODE or TARGET/DRAFT (``rakv.weights.split_modes``)."""
    import argparse
    from rakv.weights import split_modes
    try:
        split_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--weights ")) from None  # argparse names it
    return text


def add_precision_arguments(parser) -> None:
    """``--weights`` (``rakv.weights``) and ``--linear-kernels`` (``rakv.cpu_linear``), for
    every command line that loads a pair. Neither module loads torch on import."""
    from rakv.cpu_linear import LINEAR_KERNELS, LINEAR_KERNELS_HELP
    from rakv.weights import DEFAULT_WEIGHTS, WEIGHTS_HELP
    parser.add_argument("--weights", type=weights_spec, default=DEFAULT_WEIGHTS, metavar="MODE[/DRAFT_MODE]",
                        help=WEIGHTS_HELP)
    parser.add_argument("--linear-kernels", choices=LINEAR_KERNELS, default="auto", help=LINEAR_KERNELS_HELP)


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"
