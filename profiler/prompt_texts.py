"""Embedded prompt texts: the package-free fixtures, and the chat-revision and prose
workloads on which prompt lookup wins and loses. Benchmarks and recordings share them
through ``profiler.workloads``.
"""
from __future__ import annotations

# ---------------------------------------------------------------------------------------
# fixtures: a few embedded requests

FIXTURE_CODE_PROMPTS = (
    ("fib", 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'),
    ("stack", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"),
    ("logs", "# utilities for parsing log files\nimport re\n\ndef parse_line(line):\n"),
    ("logs", "# utilities for parsing log files\nimport re\n\ndef count_errors(lines):\n"),
    ("fib", 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'),
    ("sql", "-- top customers by revenue\nSELECT name, SUM(total) FROM orders GROUP BY name ORDER BY"),
)

FIXTURE_CHAT_CONVERSATIONS = (
    ("chat-kv", (
        ("human", "What is a KV cache?"),
        ("gpt", "It stores the keys and values of earlier tokens so they are not computed again."),
        ("human", "Why does that make decoding faster?"),
        ("gpt", "Each new token attends to the stored keys and values instead of recomputing them."),
        ("human", "What limits its size?"),
    )),
    ("chat-spec", (
        ("human", "Explain speculative decoding in one sentence."),
        ("gpt", "A small draft model proposes tokens that the large model verifies in one pass."),
        ("human", "When does it not pay off?"),
    )),
    ("chat-hello", (
        ("human", "Hi!"),
    )),
)


# ---------------------------------------------------------------------------------------
# prose (prompt lookup has little to copy) and chat revisions (a turn that quotes the
# model's own previous answer: prompt lookup's best case)

PROSE = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the city of Lisbon in the early morning, in vivid detail.",
    "Explain why the sky is blue to a curious ten-year-old.",
    "Write a letter from a gardener to the first frost of the year.",
    "Describe a busy train station from the point of view of a pigeon.",
    "Write a speech for the opening of a small public library.",
    "Tell the story of a violin maker and her last instrument.",
    "Describe a thunderstorm over the desert at night.",
    "Write a travel diary entry about crossing a mountain pass on foot.",
    "Explain how bread rises, as a baker would to an apprentice.",
)
CHAT = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me a three-day packing list for a rainy hiking trip.",
    "Write a SQL query that returns the ten customers with the most orders.",
    "Draft a polite email asking my manager for a day off next Friday.",
    "Write a bash one-liner that counts lines in all .py files in a folder.",
    "Summarize the rules of chess castling in a short list.",
    "Write a Python class for a simple bank account with deposit and withdraw.",
    "List five tips for writing clear commit messages.",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "Write a JavaScript function that debounces another function.",
)
REVISE = "\nUser: Please revise your answer above: fix any mistakes and keep everything else as it is.\nAssistant:"


def chat_prompt(question: str) -> str:
    """A one-turn chat prompt, laid out as ``profiler.sharegpt`` lays out a conversation."""
    return f"User: {question}\nAssistant:"
