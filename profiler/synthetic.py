"""Generated text for the ``synthetic`` and ``sweep`` workloads, all from seeded generators.

``synthetic`` prompts are ``system_prompt`` + ``variant_line`` + ``question``: a family's
system prompt (a persona and some rules) is the shared prefix, its variant lines (a style)
extend it, and each question (an ask about a topic) is new. ``sweep`` prompts are
``filler_text``, long enough to be cut to an exact number of tokens.
"""
from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------
# synthetic: shared-prefix families

_PERSONAS = (
    "a careful database administrator", "a friendly travel agent", "a patient math tutor",
    "a senior Python reviewer", "a concise legal assistant", "a helpful cooking coach",
    "an experienced network engineer", "a thoughtful history teacher", "a precise medical scribe",
    "a calm customer support agent", "a pragmatic product manager", "a curious science writer",
)
RULES = (
    "Answer in plain language.", "Cite the relevant rule when you can.", "Prefer short numbered steps.",
    "Ask one clarifying question if the request is ambiguous.", "Never invent facts.",
    "Keep every answer under one hundred words.", "Show a small example when it helps.",
    "State your assumptions first.", "Point out common mistakes.", "End with a one-line summary.",
)
_STYLES = (
    "Write formally.", "Write casually.", "Use bullet points.", "Use a table when comparing things.",
    "Explain it to a beginner.", "Explain it to an expert.", "Answer in two sentences.", "Be playful.",
)
_TOPICS = (
    "indexes", "itineraries", "fractions", "decorators", "contracts", "bread dough", "routing tables",
    "the printing press", "allergy notes", "refund requests", "roadmaps", "black holes", "caching",
    "sorting", "vaccines", "budgets",
)
_ASKS = (
    "How do I get started with {topic}?", "What are the trade-offs of {topic}?",
    "Give me a checklist for {topic}.", "What goes wrong most often with {topic}?",
    "Summarize {topic} for a newcomer.", "Compare two approaches to {topic}.",
)


def system_prompt(family: int, rng: np.random.Generator, rules_per_prompt: int) -> str:
    """Family ``family``'s system prompt: a persona and ``rules_per_prompt`` distinct rules."""
    persona = _PERSONAS[int(rng.integers(len(_PERSONAS)))]
    rules = " ".join(RULES[i] for i in rng.permutation(len(RULES))[:rules_per_prompt])
    return f"[family {family}] System: You are {persona}. {rules}\n"


def variant_line(variant: int, rng: np.random.Generator) -> str:
    """A family's variant line ``variant``: a style instruction."""
    return f"Variant {variant}: {_STYLES[int(rng.integers(len(_STYLES)))]}\n"


def question(request: int, rng: np.random.Generator) -> str:
    """Request ``request``'s question, an ask about a topic, ending where the reply starts."""
    ask = _ASKS[int(rng.integers(len(_ASKS)))].format(topic=_TOPICS[int(rng.integers(len(_TOPICS)))])
    return f"User: {ask} (ticket {request})\nAssistant:"


# ---------------------------------------------------------------------------------------
# sweep: filler text

_FILLER_WORDS = (
    "the", "cache", "keeps", "keys", "and", "values", "of", "earlier", "tokens", "so", "that", "nothing",
    "is", "computed", "twice", "while", "a", "small", "draft", "model", "guesses", "next", "few", "words",
    "which", "large", "target", "checks", "in", "one", "pass", "river", "stone", "garden", "window",
    "morning", "quiet", "market", "letter", "bridge", "summer", "paper", "engine", "signal", "forest",
    "table", "number", "story", "light", "music",
)


def filler_text(num_words: int, rng: np.random.Generator) -> str:
    """``num_words`` seeded filler words: at least ``num_words`` tokens under any tokenizer
    that never merges across a space (byte-level, GPT-2/Llama/Qwen BPE, SentencePiece)."""
    words = [_FILLER_WORDS[i] for i in rng.integers(len(_FILLER_WORDS), size=num_words).tolist()]
    sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, num_words, 12)]
    return " ".join(sentences)
