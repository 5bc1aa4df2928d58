"""A LightGBM model, compiled to one plain Python function. Imports no torch, and no lightgbm.

The round planner asks its model on every decode-loop iteration, and a SmolLM2 step is
about 50 ms, so a decision must take microseconds: ``Booster.predict`` costs about 100 us
per call in Python, a nested ``if`` over local variables about 40 ns per split. So each
tree of the model's text (LightGBM's own format, never a pickle) becomes nested ``if``s in
the source of one function of the features, and the function returns the sum of the
trees' leaves: the raw score, as ``Booster.predict(raw_score=True)`` gives it.

Only what the round model uses is read: numerical splits with no missing values
(``x <= threshold`` goes left). Anything else is a ``ValueError``. The source is made from
numbers parsed as ``float`` and ``int`` and from identifiers of our own, so a model file
cannot inject code.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Sequence

CATEGORICAL, MISSING_MASK = 1, 0b1100  # decision_type bits: a categorical split; the missing-value type


def _trees(text: str) -> list[dict[str, list[str]]]:
    trees, current, ended = [], None, False
    for line in text.splitlines():
        if line.startswith("Tree="):
            current = {}
            trees.append(current)
        elif line.startswith("end of trees"):
            ended = True
            break
        elif current is not None and "=" in line:
            key, _, value = line.partition("=")
            current[key] = value.split()
    if not trees or not ended:
        raise ValueError("no trees, or no end of trees (truncated)")
    return trees


def _tree_source(tree: dict[str, list[str]], names: Sequence[str], indent: int) -> list[str]:
    leaves = [float(v) for v in tree["leaf_value"]]
    if int(tree["num_leaves"][0]) == 1:
        return [" " * indent + f"s += {leaves[0]!r}"]
    features = [int(v) for v in tree["split_feature"]]
    thresholds = [float(v) for v in tree["threshold"]]
    kinds = [int(v) for v in tree["decision_type"]]
    left, right = [int(v) for v in tree["left_child"]], [int(v) for v in tree["right_child"]]
    if any(kind & CATEGORICAL or kind & MISSING_MASK for kind in kinds):
        raise ValueError("the model has categorical splits or missing values; the round model has neither")
    if any(not 0 <= f < len(names) for f in features) or not all(map(math.isfinite, thresholds + leaves)):
        raise ValueError("the model's splits name features it was not given, or hold non-finite numbers")
    lines = []

    def node(i: int, depth: int) -> None:
        pad = " " * (indent + 4 * depth)
        if i < 0:
            lines.append(f"{pad}s += {leaves[~i]!r}")
            return
        lines.append(f"{pad}if {names[features[i]]} <= {thresholds[i]!r}:")
        node(left[i], depth + 1)
        lines.append(f"{pad}else:")
        node(right[i], depth + 1)

    node(0, 0)
    return lines


@lru_cache(maxsize=32)  # a replay loads a policy's files afresh for every run; compiling is what costs
def compile_model(text: str, num_features: int) -> Callable[..., float]:
    """The raw score of a LightGBM text model as a function of ``num_features`` positional
    floats, bit for bit the sum LightGBM adds up (trees in order, from 0.0). A pure
    function: the same text gives the same function, compiled once."""
    names = [f"x{i}" for i in range(num_features)]
    source = [f"def predict({', '.join(names)}):", "    s = 0.0"]
    for tree in _trees(text):
        source += _tree_source(tree, names, 4)
    source.append("    return s")
    scope: dict = {}
    exec(compile("\n".join(source), "<lightgbm model>", "exec"), scope)
    return scope["predict"]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0
