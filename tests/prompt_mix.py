"""A prompt mix that exercises the store: cold starts, partial hits, exact repeats, prompts
under 16 tokens (prefixes of stored sequences and fresh ones), extensions of earlier
prompts, and prompts within a few tokens of the maximum length. Order matters: the
engine sees them in this order, with one store."""
from __future__ import annotations

TEXTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins in the fifteenth century, when",
    "import numpy as np\n\ndef normalize(x):\n    return",
    "Dear team, thank you for the meeting yesterday. As discussed,",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "In a small village by the sea there lived an old fisherman who",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY",
    "The three laws of thermodynamics state that",
)
SYSTEM = "System: You are a concise assistant. Answer in one sentence.\nUser: "
QUESTIONS = (
    "What is a KV cache?", "Why is greedy decoding deterministic?", "What does a draft model do?",
    "How does LRU eviction work?", "What is a hash collision?", "Why batch requests?",
    "What is speculative decoding?", "What limits decoding speed on a CPU?",
    "What is a prefix tree?", "Why measure time per token?", "What is a token?", "What is a tensor?",
)
CODE_PREFIX = "# utilities for parsing log files\nimport re\n\n"
CODE_TAILS = ("def parse_line(line):", "def count_errors(lines):", "def top_ips(lines, n):",
              "def to_json(records):", "def main():", "PATTERN = re.compile(")
SHORT = ("Hi", "def f(x):", "Once upon", "2 + 2 =", "x =")
FILLER = "the cache keeps keys and values of earlier tokens so that nothing is computed twice; "


def prompt_mix(encode, max_positions: int) -> list[list[int]]:
    prompts = [encode(t) for t in TEXTS]  # cold starts
    prompts += [encode(SYSTEM + q) for q in QUESTIONS]  # shared system prompt: partial hits
    prompts += [encode(CODE_PREFIX + t) for t in CODE_TAILS]
    prompts += [list(prompts[i]) for i in (0, 3, 9, 12, 20, 25)]  # exact repeats
    prompts += [list(p[:n]) for p, n in zip(prompts[:6], (3, 5, 8, 11, 14, 15))]  # short, prefixing stored ones
    prompts += [encode(s) for s in SHORT]  # short and cold
    prompts += [encode(TEXTS[i] + " and then, after a pause, it went on") for i in (1, 3, 5)]  # extensions
    filler = encode(FILLER * (max_positions // 8 + 1))
    prompts += [filler[: max_positions - d] for d in (9, 4, 2)]  # near the maximum length
    prompts += [filler[: max_positions - 6]]  # a partial hit near the maximum
    prompts += [list(prompts[-3])]  # an exact repeat near the maximum
    return prompts
