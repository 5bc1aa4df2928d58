"""The learned policies a directory of traces served, held once. Imports no torch.

A serving trace keeps a copy of each learned policy it served (``policies/NAME/``,
``profiler.schema.policy_copy_dir``), about 290 KiB of model text, so that its replays
decide with the files it ran after the shipped policy is trained again. Traces recorded
with one shipped policy hold the same files: the shipped traces held 15 copies of two
policies, 4.4 MiB. ``share`` moves each copy into ``<traces>/policy-copies/<digest>/``
(the digest of its files' names and bytes) and leaves a relative symlink in its place,
so every trace that served the same files points at one copy. A reader follows the link
as it reads the directory (``simulator.session.trace_policy``), and a copy kept
elsewhere (a trace recorded outside the directory) stays whole.

    python -m profiler.policy_copies traces       # after recording into traces/
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path

from profiler.schema import POLICY_COPIES

SHARED = "policy-copies"  # in a directory of traces: the copies its traces share, one per digest


def digest(copy: Path) -> str:
    """Of a policy copy's files, by relative name and bytes (16 hex digits)."""
    h = hashlib.sha256()
    for path in sorted(p for p in copy.rglob("*") if p.is_file()):
        data = path.read_bytes()
        h.update(f"{path.relative_to(copy).as_posix()}\0{len(data)}\0".encode() + data)
    return h.hexdigest()[:16]


def share(traces_dir: str | os.PathLike) -> int:
    """Each trace's policy copies under ``traces_dir`` (not in-progress ``.NAME.partial``
    ones, nor links already) moved into ``SHARED/<digest>`` and linked back; an identical
    copy already there is kept and the trace's dropped. Returns the copies linked."""
    root = Path(traces_dir)
    linked = 0
    for copy in sorted(root.glob(f"[!.]*/{POLICY_COPIES}/*")):
        if copy.is_symlink() or not copy.is_dir() or copy.name.endswith(".partial"):
            continue
        target = root / SHARED / digest(copy)
        if target.is_dir():
            shutil.rmtree(copy)
        else:
            target.parent.mkdir(exist_ok=True)
            copy.rename(target)
        copy.symlink_to(os.path.relpath(target, copy.parent), target_is_directory=True)
        linked += 1
    return linked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.policy_copies", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", type=Path, help="a directory of traces (traces/)")
    args = p.parse_args(argv)
    if not args.traces.is_dir():
        print(f"error: {args.traces} is not a directory", file=sys.stderr)
        return 2
    print(f"{share(args.traces)} policy copies linked to {args.traces / SHARED}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
