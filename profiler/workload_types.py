"""What a workload is: requests in trace order, and the one error a workload raises.
Imports no torch and no data package.

A request's prompt is text, which the profiler encodes with the pair's tokenizer, or the
token ids themselves (a user's ``prompt_ids``). A request that ``continues`` an earlier one
is a conversation's next turn on the model's own answer: its prompt is the earlier
request's prompt and greedy output, then its own text (encoded without a BOS), so it is
built at recording time, once that output exists.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

DATA_EXTRA_HINT = "pip install -e '.[data]'"


class WorkloadError(ValueError):
    """A workload that cannot be built; the message is one line and says what to do."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request. ``group_id`` names requests expected to share a prefix (a conversation,
    a prompt family); ``turn`` is the request's position within its group. ``prompt[:history_chars]``
    is the conversation so far (0 for single-turn requests). ``prompt_ids``, when set, is
    the prompt as token ids (``prompt`` is then empty). ``continues`` names an earlier
    request whose prompt and output come before this one's ``prompt`` text."""

    request_id: int
    group_id: str
    turn: int
    arrival_s: float
    prompt: str
    max_new_tokens: int
    num_prompt_tokens: int | None = None
    history_chars: int = 0
    prompt_ids: tuple[int, ...] | None = None
    continues: int | None = None

    def __post_init__(self):
        if (self.prompt_ids is None) == (self.prompt == "" and self.continues is None):
            raise WorkloadError(f"request {self.request_id}: needs exactly one of prompt text and prompt_ids")
        if self.continues is not None and not 0 <= self.continues < self.request_id:
            raise WorkloadError(f"request {self.request_id}: continues {self.continues}, not an earlier request")
        if self.turn < 0:
            raise WorkloadError(f"request {self.request_id}: turn must be >= 0, got {self.turn}")
        if not (self.arrival_s >= 0.0 and math.isfinite(self.arrival_s)):
            raise WorkloadError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.max_new_tokens < 1:
            raise WorkloadError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_prompt_tokens is not None and self.num_prompt_tokens < 1:
            raise WorkloadError(
                f"request {self.request_id}: num_prompt_tokens must be None or >= 1, got {self.num_prompt_tokens}")
        if not 0 <= self.history_chars <= len(self.prompt):
            raise WorkloadError(
                f"request {self.request_id}: history_chars {self.history_chars} outside the prompt's {len(self.prompt)} chars")

    @property
    def history(self) -> str:
        return self.prompt[: self.history_chars]


@dataclass(frozen=True)
class Workload:
    """Requests in trace order (``request_id`` = position, ``arrival_s`` non-decreasing) and
    the resolved options that built them (JSON-serializable, for the profiler's records)."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.requests:
            raise WorkloadError(f"workload {self.name!r} has no requests")
        for i, req in enumerate(self.requests):
            if req.request_id != i:
                raise WorkloadError(f"workload {self.name!r}: request at position {i} has request_id {req.request_id}")
            if i and req.arrival_s < self.requests[i - 1].arrival_s:
                raise WorkloadError(f"workload {self.name!r}: arrival_s decreases at request {i}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)


def package_data_file(package: str, dist: str, relative: str, workload: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location, relative)
        if path.is_file():
            return path
    if not locations:
        raise WorkloadError(f"workload {workload!r} needs the {dist!r} package: {DATA_EXTRA_HINT} "
                            f"(or pip install {dist})")
    raise WorkloadError(f"package {dist!r} is installed but has no {relative}: reinstall it with {DATA_EXTRA_HINT}")
