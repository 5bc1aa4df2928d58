"""The OpenAI protocol as ``rakv.serve`` speaks it: request bodies, the checks that keep a
request greedy, prompts and chat messages to token ids, a response's text as its tokens
arrive, and the shapes of responses and streamed chunks.

Greedy only: the engine's output is exact (token-identical to plain greedy decoding of
the target) and nothing else is, so any setting that would sample or bend the
distribution (temperature > 0, n > 1, penalties, a logit bias) is refused with a 400
rather than ignored. ``seed``, ``user`` and ``top_p`` change nothing under greedy decoding
and are accepted. ``stop`` strings are supported: the text ends before the first match.
``return_token_ids`` (vLLM's extension) adds each choice's and chunk's token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

GREEDY_ONLY = "this server decodes greedily (the engine is exact for greedy only): temperature must be 0"
EMPTY_PROMPT = "empty prompt: nothing to condition on"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """A request answered with an error status and OpenAI's error body; one-line message."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    return_token_ids: bool = False


class CompletionRequest(_Request):
    prompt: Any  # one prompt: text or token ids (``prompt_ids`` checks it, with messages of its own)
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None


@dataclass(frozen=True)
class Decoding:
    """What a checked request asks of the engine and of its response."""

    max_new_tokens: int | None  # None: as many as the context allows
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


def check_request(body: _Request, model_name: str) -> Decoding:
    """``body``'s decoding, or an ``ApiError`` for anything this server cannot do exactly."""
    if body.model is not None and body.model != model_name:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")
    if body.temperature not in (None, 0):
        raise ApiError(400, GREEDY_ONLY, "temperature")
    for name in ("n", "best_of"):
        if getattr(body, name, None) not in (None, 1):
            raise ApiError(400, f"{name} must be 1: greedy decoding has one completion per prompt", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported: it would change the greedy output", name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported: it would change the greedy output", "logit_bias")
    for name in ("logprobs", "echo", "suffix"):
        if getattr(body, name, None) not in (None, False, 0):
            raise ApiError(400, f"{name} is not supported by this server", name)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must not be empty", "stop")
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        max_new, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_new, param = body.max_tokens, "max_tokens"
    if isinstance(body, CompletionRequest) and max_new is None:
        max_new = COMPLETION_DEFAULT_MAX_TOKENS
    if max_new is not None and max_new < 1:
        raise ApiError(400, f"{param} must be at least 1, got {max_new}", param)
    return Decoding(max_new, stop, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                    body.return_token_ids)


def prompt_ids(prompt: Any, pair) -> list[int]:
    """One completion prompt (text, token ids, or a list holding one of either) as ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:  # a tokenizer may still give a BOS: a prompt nonetheless empty
            raise ApiError(400, EMPTY_PROMPT, "prompt")
        return pair.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise ApiError(400, EMPTY_PROMPT, "prompt")
        vocab = pair.target.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary of {vocab}", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request: a batch of prompts is not supported", "prompt")
    raise ApiError(400, f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def chat_prompt_ids(messages: list[ChatMessage], pair) -> list[int]:
    """The messages as prompt ids: the tokenizer's chat template where the pair has a Hugging
    Face tokenizer with one, else ``role: content`` lines ending in ``assistant:``."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
    hf = getattr(pair.tokenizer, "tokenizer", None)
    if hf is None or not getattr(hf, "chat_template", None):
        return pair.encode("".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:")
    from jinja2 import TemplateError
    try:
        ids = hf.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError, TypeError, KeyError) as exc:  # a template's raise_exception, a bad role
        raise ApiError(400, f"the chat template refused the messages: {str(exc).strip().splitlines()[0]}",
                       "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def _content_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" for part in content):
        raise ApiError(400, "only text content parts are supported", "messages")
    return "".join(part.text or "" for part in content)


class OutputText:
    """A response's text as its tokens arrive.

    Invariant: the pieces ``add`` and ``finish`` return, joined, are the text of the whole
    output (a final EOS left out), cut before the first stop string: a stream never takes
    back what it sent. So ``add`` holds back a tail of U+FFFD (a character whose bytes
    are still to come) and a tail that may begin a stop string. It decodes all the output
    so far each time: a tokenizer's text for some ids is not always the join of its text
    per id (byte pieces, leading spaces). This assumes that the text of a prefix of the ids
    is a prefix of the text of all of them, but for a U+FFFD tail (true of byte-level
    tokenizers; a decoder that rewrites earlier text, such as a clean-up of spaces before
    punctuation, would leave the stream's text behind the whole decode's)."""

    def __init__(self, decode: Callable[[list[int]], str], eos_ids, stop: tuple[str, ...] = ()):
        self.token_ids: list[int] = []
        self.text = ""  # sent so far
        self.stopped = False  # a stop string matched; the text ends before it
        self._decode, self._eos, self._stop = decode, frozenset(eos_ids), stop

    @property
    def ended_by_eos(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] in self._eos

    def add(self, token_ids) -> str:
        """The text that became final with ``token_ids``; sets ``stopped`` on a stop string."""
        self.token_ids += token_ids
        full = self._full()
        # a match cannot start inside the text already sent: its start would have been held back
        found = [i for i in (full.find(s, len(self.text)) for s in self._stop) if i >= 0]
        if found:
            self.stopped = True
            return self._send(full[:min(found)])
        ready = full.rstrip("\ufffd")
        room = len(ready) - len(self.text)
        hold = max((n for s in self._stop for n in range(1, min(len(s) - 1, room) + 1)
                    if ready.endswith(s[:n])), default=0)
        return self._send(ready[:len(ready) - hold])

    def finish(self) -> str:
        """The rest of the text, held back or not, at the request's finish."""
        return "" if self.stopped else self._send(self._full())

    def _full(self) -> str:
        ids = self.token_ids[:-1] if self.ended_by_eos else self.token_ids
        return self._decode(ids)

    def _send(self, ready: str) -> str:
        piece = ready[len(self.text):]
        self.text += piece
        return piece


@dataclass(frozen=True)
class Shape:
    """How one endpoint writes its choice: ``/v1/completions`` as ``text``, chat as a
    ``message`` (a ``delta`` when streamed)."""

    chat: bool
    id: str
    created: int
    model: str
    token_ids: bool  # add the choice's token ids

    def chunk(self, text: str | None, token_ids, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def response(self, text: str, token_ids, finish_reason: str, usage: dict) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        return self._wrap("chat.completion" if self.chat else "text_completion", [choice], usage=usage)

    def _wrap(self, kind: str, choices: list, **more) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **more}


def usage(num_prompt: int, num_output: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}
