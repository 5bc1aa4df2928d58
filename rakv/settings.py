"""The engine's settings, and everything besides the tokens that decides what it does with
a request (``DecisionInputs``): a trace records these, so that a replay decides, reuses
and evicts exactly as the engine did. Imports no torch.

Settings are frozen dataclasses, possibly nested; ``settings_to_json`` and
``settings_from_json`` convert them to and from plain JSON objects, refusing unknown keys
(a setting this version does not know would be replayed wrong, silently).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from rakv.controller import ControllerConfig
from rakv.cost_model import PairTimings
from rakv.drafters import NgramConfig
from rakv.store_model import ModelSizes, StoreConfig


@dataclass(frozen=True)
class EngineConfig:
    store: StoreConfig = StoreConfig()
    ngram: NgramConfig = NgramConfig()


@dataclass(frozen=True)
class DecisionInputs:
    """What, besides a request's tokens and the store, the engine's choices depend on."""

    engine: EngineConfig
    controller: ControllerConfig
    timings: PairTimings | None  # the calibration the adaptive policy priced actions with
    target_sizes: ModelSizes
    draft_sizes: ModelSizes | None
    max_positions: int  # the engine's position limit: a request generates at most this minus its prompt


def settings_to_json(settings) -> dict:
    return dataclasses.asdict(settings)


def settings_from_json(cls: type, data: dict):
    """An instance of the frozen dataclass ``cls`` from ``settings_to_json``'s output; a
    missing key takes ``cls.ABSENT_MEANS[key]`` where the class has one (what a setting
    written before it existed behaved as), else the field's default."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} settings must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting {unknown[0]!r}")
    hints = typing.get_type_hints(cls)
    absent = {name: value for name, value in getattr(cls, "ABSENT_MEANS", {}).items() if name not in data}
    return cls(**absent, **{name: _value(hints[name], value) for name, value in data.items()})


def _value(hint, value):
    if value is None:
        return None
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for option in options:
        if dataclasses.is_dataclass(option):
            return settings_from_json(option, value)
    if typing.get_origin(hint) is tuple or tuple in options:
        return tuple(value)
    return value
