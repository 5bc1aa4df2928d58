"""Settings and facts: what the engine is told to do, and what it measured. Imports no torch.

A request's fate depends on its tokens and on ``DecisionInputs``:

- **settings** (``Settings``): the store's mode and budget, the n-gram config, the
  controller's and planner's knobs. Today's defaults are the dataclass defaults; a user
  changes any of them (``override``: ``planner.min_gain=0.2``).
- **facts**: the calibrated timings the adaptive policy prices with, the models' bytes
  per token, the position limit. A trace records them, and they stay true when the
  decision code changes.

A trace records both, so a replay can decide with today's settings over its facts (the
default) or exactly as the recording did (``--as-recorded``).

``settings_to_json`` and ``settings_from_json`` convert frozen dataclasses, possibly
nested, to and from plain JSON objects. Unknown keys are refused, and so, in settings,
are missing ones: a setting this version does not know, or one written before it
existed, would be replayed wrong, silently. A setting added later may name the value that
reproduces the engines before it (``field(metadata={"before": ...})``): a file without it
takes that. A fact a file lacks takes its field's default, which says "not measured"
(``ModelTimings.verify_tokens``: ``()``).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field, replace

from rakv.controller import ControllerConfig
from rakv.cost_model import PairTimings
from rakv.drafters import NgramConfig
from rakv.store_model import ModelSizes, StoreConfig
from rakv.suffix_drafter import SuffixConfig


@dataclass(frozen=True)
class EngineConfig:
    store: StoreConfig = StoreConfig()
    ngram: NgramConfig = NgramConfig()
    # before it existed the store drafter never ran, so any values reproduce those engines
    suffix: SuffixConfig = field(default=SuffixConfig(), metadata={"before": dataclasses.asdict(SuffixConfig())})


@dataclass(frozen=True)
class Settings:
    """What the engine is told: today's defaults unless asked otherwise."""

    engine: EngineConfig = EngineConfig()
    controller: ControllerConfig = ControllerConfig()


@dataclass(frozen=True)
class DecisionInputs:
    """What, besides a request's tokens and the store, the engine's choices depend on:
    the settings (``engine``, ``controller``) and the facts (the rest)."""

    engine: EngineConfig
    controller: ControllerConfig
    timings: PairTimings | None  # the calibration the adaptive policy priced actions with
    target_sizes: ModelSizes
    draft_sizes: ModelSizes | None
    max_positions: int  # the engine's position limit: a request generates at most this minus its prompt

    @property
    def settings(self) -> Settings:
        return Settings(self.engine, self.controller)

    def with_settings(self, settings: Settings) -> "DecisionInputs":
        return replace(self, engine=settings.engine, controller=settings.controller)


# ``override``'s section names: where each lives in ``Settings``
SECTIONS = {"store": ("engine", "store"), "ngram": ("engine", "ngram"), "suffix": ("engine", "suffix"),
            "controller": ("controller",),
            "planner": ("controller", "rounds")}


def override(settings: Settings, assignment: str) -> Settings:
    """``settings`` with one ``SECTION.KEY=VALUE`` applied (sections: ``SECTIONS``, or a
    full path such as ``controller.rounds.min_gain``). VALUE is JSON (``0.2``, ``true``,
    ``null``) or else a string; a bad key or value is a one-line ``ValueError``."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"a setting is SECTION.KEY=VALUE, got {assignment!r}")
    names = key.strip().split(".")
    path = SECTIONS.get(names[0], (names[0],)) + tuple(names[1:])
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    try:
        return _set(settings, path, value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"setting {key.strip()}: {exc}") from None


def _set(obj, path: tuple[str, ...], value):
    """``obj`` with the leaf at ``path`` (two names or more) set to ``value``."""
    names = [f.name for f in dataclasses.fields(obj)]
    if len(path) < 2 or path[0] not in names or not dataclasses.is_dataclass(getattr(obj, path[0])):
        known = ", ".join(sorted(SECTIONS)) if isinstance(obj, Settings) else ", ".join(names)
        raise ValueError(f"no such setting (choose among {known})")
    inner = getattr(obj, path[0])
    return replace(obj, **{path[0]: _set(inner, path[1:], value) if len(path) > 2 else _leaf(inner, path[1], value)})


def _leaf(obj, name: str, value):
    hints = typing.get_type_hints(type(obj))
    if name not in {f.name for f in dataclasses.fields(obj)} or dataclasses.is_dataclass(getattr(obj, name)):
        choices = ", ".join(f.name for f in dataclasses.fields(obj) if not dataclasses.is_dataclass(getattr(obj, f.name)))
        raise ValueError(f"no such setting (choose among {choices})")
    return replace(obj, **{name: _checked(hints[name], value)})


def _checked(hint, value):
    """``value`` as the field's type wants it (an int where a float is asked is fine)."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if value is None:
        if type(None) in typing.get_args(hint):
            return None
        raise ValueError("may not be null")
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (bool, str) and isinstance(value, option):
            return value
    names = [getattr(o, '__name__', str(o)) for o in options] + (["null"] if type(None) in typing.get_args(hint) else [])
    raise ValueError(f"expected {' or '.join(names)}, got {value!r}")


def overrides_from_json(data: dict) -> list[str]:
    """A settings file (nested sections, e.g. ``{"planner": {"min_gain": 0.2}}``) as
    ``override`` assignments, in file order."""
    if not isinstance(data, dict):
        raise ValueError("a settings file holds a JSON object of sections")
    return [f"{key}={json.dumps(value)}" for key, value in _leaves(data).items()]


def differences(settings: Settings, reference: Settings) -> list[str]:
    """``KEY=VALUE`` for every leaf of ``settings`` that differs from ``reference``, by the
    short section names of ``SECTIONS``."""
    ours, theirs = _leaves(settings_to_json(settings)), _leaves(settings_to_json(reference))
    short = {".".join(path): name for name, path in SECTIONS.items()}
    out = []
    for key, value in ours.items():
        if theirs.get(key, object()) != value:
            section, _, leaf = key.rpartition(".")
            out.append(f"{short.get(section, section)}.{leaf}={json.dumps(value)}")
    return out


def _leaves(data: dict, prefix: str = "") -> dict:
    """``{"a.b": value}`` for every leaf of a nested JSON object, in its order."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def settings_to_json(settings) -> dict:
    return dataclasses.asdict(settings)


def inputs_from_json(data: dict) -> tuple[DecisionInputs, str | None]:
    """The recorded ``DecisionInputs``, and why its settings cannot be read (then they are
    today's defaults), or None. Facts that cannot be read are a ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"decision inputs must be a JSON object, got {type(data).__name__}")
    facts = settings_from_json(DecisionInputs, {**data, "engine": None, "controller": None}, strict=False)
    try:
        settings = Settings(settings_from_json(EngineConfig, data.get("engine")),
                            settings_from_json(ControllerConfig, data.get("controller")))
        problem = None
    except (TypeError, ValueError) as exc:
        settings, problem = Settings(), str(exc)
    return facts.with_settings(settings), problem


def settings_from_json(cls: type, data: dict, strict: bool = True):
    """An instance of the frozen dataclass ``cls`` from ``settings_to_json``'s output; a
    key it does not know, or (``strict``) lacks, is a ``ValueError`` naming it; not
    ``strict``, a lacking key takes the field's default."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} settings must be a JSON object, got {type(data).__name__}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} setting {unknown[0]!r}")
    # a setting added later names the value that reproduces the engines written before it
    data = {**{f.name: f.metadata["before"] for f in fields if "before" in f.metadata and f.name not in data}, **data}
    missing = [name for name in names if name not in data]
    if missing and strict:
        raise ValueError(f"{cls.__name__} setting {missing[0]!r} is missing (written by an older version)")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _value(hints[name], value, strict) for name, value in data.items()})


def _value(hint, value, strict: bool):
    if value is None:
        return None
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for option in options:
        if dataclasses.is_dataclass(option):
            return settings_from_json(option, value, strict)
    if typing.get_origin(hint) is tuple or tuple in options:
        return tuple(value)
    return value
