"""The user's prompts file, read once for ``rakv.generate --prompts`` and
``profiler.record --workload``. Imports no torch.

Two formats, by suffix:
- ``.jsonl``: one JSON object per line with ``prompt`` (text) or ``prompt_ids`` (token ids
  of the pair's tokenizer), and optionally ``group`` (a conversation or prefix family),
  ``arrival_s`` (seconds, non-decreasing) and ``max_new_tokens``. Blank lines are skipped.
  Other fields (a data set's ``id``, ``source``, ...) are ignored, with one warning per file.
- anything else: one prompt per line, ``\\n`` standing for a newline; blank lines skipped.

Any problem is a ``PromptFileError`` whose one-line message names the file and line.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("prompt", "prompt_ids", "group", "arrival_s", "max_new_tokens")


class PromptFileError(ValueError):
    """A prompts file that cannot be used; the message is one line naming the line."""


@dataclass(frozen=True)
class PromptLine:
    line: int  # 1-based line number in the file
    prompt: str | None  # exactly one of prompt and prompt_ids is set
    prompt_ids: tuple[int, ...] | None
    group: str | None = None
    arrival_s: float | None = None
    max_new_tokens: int | None = None


def read_prompt_file(path: Path) -> list[PromptLine]:
    """Every prompt of the file, in order; at least one."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"{path}: cannot read: {exc}") from None
    jsonl = path.suffix == ".jsonl"
    ignored: set[str] = set()
    prompts = [_json_line(path, number, line, ignored) if jsonl else _text_line(path, number, line)
               for number, line in enumerate(lines, 1) if line.strip()]
    if ignored:
        warnings.warn(f"{path}: ignoring field{'s' if len(ignored) > 1 else ''} "
                      f"{', '.join(repr(f) for f in sorted(ignored))}; the fields read are {', '.join(FIELDS)}",
                      stacklevel=2)
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    arrivals = [p for p in prompts if p.arrival_s is not None]
    if arrivals and len(arrivals) != len(prompts):
        missing = next(p for p in prompts if p.arrival_s is None)
        raise PromptFileError(f"{path}:{missing.line}: no 'arrival_s', though other lines have one")
    for before, after in zip(arrivals, arrivals[1:]):
        if after.arrival_s < before.arrival_s:
            raise PromptFileError(f"{path}:{after.line}: 'arrival_s' {after.arrival_s} is earlier than "
                                  f"line {before.line}'s {before.arrival_s}")
    return prompts


def _text_line(path: Path, number: int, line: str) -> PromptLine:
    return PromptLine(number, line.replace("\\n", "\n"), None)


def _json_line(path: Path, number: int, line: str, ignored: set[str]) -> PromptLine:
    """The line's prompt; the names of fields it does not read go into ``ignored``."""
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object with a 'prompt' or 'prompt_ids' field, "
                              f"got {type(row).__name__}")
    ignored.update(set(row) - set(FIELDS))
    prompt, ids = row.get("prompt"), row.get("prompt_ids")
    if (prompt is None) == (ids is None):
        raise PromptFileError(f"{where}: give exactly one of 'prompt' (text) and 'prompt_ids' (token ids)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise PromptFileError(f"{where}: 'prompt' must be non-empty text, got {json.dumps(prompt)[:40]}")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise PromptFileError(f"{where}: 'prompt_ids' must be a non-empty list of token ids (integers >= 0)")
        ids = tuple(ids)
    group = row.get("group")
    if group is not None and (type(group) not in (str, int) or group == ""):
        raise PromptFileError(f"{where}: 'group' must be a non-empty string or an integer")
    arrival = row.get("arrival_s")
    if arrival is not None and (type(arrival) not in (int, float) or not math.isfinite(arrival) or arrival < 0):
        raise PromptFileError(f"{where}: 'arrival_s' must be a number >= 0, got {json.dumps(arrival)}")
    max_new = row.get("max_new_tokens")
    if max_new is not None and (type(max_new) is not int or max_new < 1):
        raise PromptFileError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {json.dumps(max_new)}")
    return PromptLine(number, prompt, ids, None if group is None else str(group),
                      None if arrival is None else float(arrival), max_new)
