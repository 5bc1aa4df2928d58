"""What ``python -m bench.serve`` sends and when: text prompts from a shipped workload or a
user's JSONL file, and the seeded arrival times of a load point. Imports no torch.

Shipped workloads are the profiler's own (``profiler.workloads``), built by the same
functions with the same seed, so a served benchmark sends the prompts a trace records:
``humaneval``, ``sharegpt`` (these two need the ``data`` extra), ``chat``, ``prose``,
``synthetic``, ``fixture-code``, ``fixture-chat``, and ``general`` (the 25 prompts of
``profiler/general_prompts.jsonl``). ``sweep`` is left out: its prompts are cut to exact
token counts by the pair's tokenizer, which a server's client does not have.

A ``chat`` revision turn continues the model's own answer: its prompt is the earlier
turn's prompt and that server's output, then its own text, so it is sent only once the
earlier turn has finished (``Prompt.continues``).
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

GENERAL_PROMPTS = Path(__file__).resolve().parent.parent / "profiler" / "general_prompts.jsonl"
SHIPPED = ("general", "chat", "prose", "humaneval", "sharegpt", "synthetic", "fixture-code", "fixture-chat")


class WorkloadFileError(ValueError):
    """A prompts file or workload that cannot be used; one line, naming FILE:LINE."""


@dataclass(frozen=True)
class Prompt:
    """One request's text and output budget. ``continues`` is the index of an earlier
    prompt whose text and output come before this one's ``text``."""

    index: int
    text: str
    max_tokens: int
    continues: int | None = None


def load_prompts(workload: str, num_prompts: int | None, seed: int, max_tokens: int) -> tuple[Prompt, ...]:
    """The first ``num_prompts`` prompts of a shipped workload (its default size when None)
    or of a ``.jsonl`` file, in order."""
    if workload not in SHIPPED:
        if Path(workload).suffix == ".jsonl" or Path(workload).is_file():
            return read_jsonl(Path(workload), num_prompts, max_tokens)
        raise WorkloadFileError(f"unknown workload {workload!r}: give one of {', '.join(SHIPPED)} "
                                f"or a .jsonl file")
    from profiler.workload_types import WorkloadError
    from profiler.workloads import load_workload, user_workload
    try:
        with warnings.catch_warnings():  # general_prompts.jsonl's 'id' and 'source' fields: known, not read
            warnings.simplefilter("ignore")
            if workload == "general":
                built = user_workload(GENERAL_PROMPTS, num_prompts, max_new_tokens=max_tokens)
            else:
                built = load_workload(workload, num_prompts, seed, max_new_tokens=max_tokens, rate_per_s=None)
    except WorkloadError as exc:
        raise WorkloadFileError(str(exc)) from None
    return tuple(Prompt(r.request_id, r.prompt, r.max_new_tokens, r.continues) for r in built.requests)


def read_jsonl(path: Path, num_prompts: int | None, max_tokens: int) -> tuple[Prompt, ...]:
    """``{"prompt": TEXT, "max_tokens": N}`` per line (``max_tokens`` optional, also read as
    ``max_new_tokens``, the project's prompt files' name; other fields ignored; blank lines
    skipped). The first bad line is a ``WorkloadFileError`` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadFileError(f"{path}: cannot read: {exc}") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadFileError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise WorkloadFileError(f"{where}: expected a JSON object with a 'prompt', got {type(row).__name__}")
        text = row.get("prompt")
        if not isinstance(text, str) or not text:
            raise WorkloadFileError(f"{where}: 'prompt' must be non-empty text")
        budget = row.get("max_tokens", row.get("max_new_tokens", max_tokens))
        if type(budget) is not int or budget < 1:
            raise WorkloadFileError(f"{where}: 'max_tokens' must be an integer >= 1, got {json.dumps(budget)}")
        prompts.append(Prompt(len(prompts), text, budget))
    if not prompts:
        raise WorkloadFileError(f"{path}: no prompts (the file is empty)")
    if num_prompts is not None:
        if num_prompts > len(prompts):
            raise WorkloadFileError(f"{path} has {len(prompts)} prompts; got --num-prompts {num_prompts}")
        prompts = prompts[:num_prompts]
    return tuple(prompts)
