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


def add_pair_arguments(parser, default_pair: str) -> None:
    """What a command line runs (``rakv.generate``, ``rakv.serve``): ``--pair``, ``--policy``,
    ``--strict``, ``--store``, ``--store-budget-mib``, ``--no-store-drafter``, ``--max-context``,
    the precision arguments and ``--draft-layers``. Imports no torch."""
    from rakv.models import BUILTIN_PAIRS
    from rakv.policies import POLICY_HELP
    from rakv.store_model import STORE_MODES
    parser.add_argument("--pair", default=default_pair,
                        help=f"{', '.join(BUILTIN_PAIRS)}, or TARGET[,DRAFT] (HF name, directory or .gguf) "
                             f"(default: {default_pair})")
    parser.add_argument("--policy", default="rakv", help=f"{POLICY_HELP} (default: rakv)")
    parser.add_argument("--strict", action="store_true",
                        help="a learned policy trained for other models is an error, not a fallback to rakv")
    parser.add_argument("--store", choices=STORE_MODES, default="full",
                        help="what to keep for later requests: full sequence (default), prompt only (the paper), "
                             "or off")
    parser.add_argument("--store-budget-mib", type=float, default=512,
                        help="prefix store byte budget (default: 512 MiB)")
    parser.add_argument("--no-store-drafter", action="store_true",
                        help="rakv: do not draft from earlier requests' outputs held by the store")
    parser.add_argument("--max-context", type=int, default=None, help="cap on positions below the model's maximum")
    add_precision_arguments(parser)
    parser.add_argument("--draft-layers", type=int, default=4,
                        help="smollm2: layers of the self-speculative draft; 0: no draft model (default: 4)")


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"
