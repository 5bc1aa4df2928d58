"""The learned policy, live: the exported LightGBM model ranks every choice of a request
in one ``Booster.predict`` call; the analytic ``rakv`` policy inside keeps the running
acceptance estimates, makes the adaptive planners and is the fallback. Imports no torch.

A policy is a directory: ``model.txt`` (LightGBM's text format) and ``policy.json`` (the
sidecar: format version, feature list, choices, model kind, the trace schema, the
hardware and model fingerprints it was trained for, the controller settings it was tuned
with, its training metrics and split). Never a pickle. ``load_policy`` checks both files;
any problem is a one-line ``PolicyFileError``. ``policy.train`` writes the directory;
``rakv.policies`` resolves a name to it, and falls back to the analytic controller with a
warning (or fails under ``strict``) for a policy trained for other models.

A learned policy runs with the controller settings it was tuned with (the sidecar's:
``LearnedPolicy.controller``), whatever the caller's are; only the memory limit, a
property of the machine, is the caller's.

What it decides: r, and either a fixed (drafter, k) for every round or the adaptive
planner with or without the draft model readied (``rakv.choices``). What it leaves to the
planner, when it picks an adaptive choice: each round's drafter and k.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from rakv.choices import Choice, all_choices
from rakv.controller import ControllerConfig, CostModelPolicy, RequestOutcome, make_planner
from rakv.cost_model import Action, PairTimings, RequestFeatures, action_bytes
from rakv.learned_features import ANALYTIC_COLUMN, FEATURES, feature_rows
from rakv.settings import settings_from_json

FORMAT = "rakv-learned-policy"
FORMAT_VERSION = 1
MODEL_FILE, SIDECAR_FILE = "model.txt", "policy.json"  # policy.train writes them; the keys below are checked here
SIDECAR_KEYS = ("format", "format_version", "kind", "features", "choices", "schema_version", "hardware", "models",
                "controller", "metrics", "split")


class PolicyFileError(ValueError):
    """A policy directory that cannot be used; the message is one line."""


@dataclass(frozen=True)
class PolicyFile:
    path: Path
    booster: object  # lightgbm.Booster
    sidecar: dict

    @property
    def kind(self) -> str:
        return self.sidecar["kind"]

    @property
    def controller(self) -> ControllerConfig:
        return settings_from_json(ControllerConfig, self.sidecar["controller"])

    def trained_for(self, target_fingerprint: str | None, draft_fingerprint: str | None) -> bool:
        return any(m.get("target") == target_fingerprint and m.get("draft") == draft_fingerprint
                   for m in self.sidecar["models"])


def load_policy(path: str | Path) -> PolicyFile:
    path = Path(path)
    if not path.is_dir():
        raise PolicyFileError(f"{path}: no such policy directory (it holds {MODEL_FILE} and {SIDECAR_FILE})")
    try:
        sidecar = json.loads((path / SIDECAR_FILE).read_text())
    except FileNotFoundError:
        raise PolicyFileError(f"{path}: no {SIDECAR_FILE}") from None
    except (OSError, ValueError) as exc:
        raise PolicyFileError(f"{path / SIDECAR_FILE}: not valid JSON ({exc})") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise PolicyFileError(f"{path / SIDECAR_FILE}: not a {FORMAT} sidecar")
    if sidecar.get("format_version") != FORMAT_VERSION:
        raise PolicyFileError(f"{path / SIDECAR_FILE}: format version {sidecar.get('format_version')}, "
                              f"this version reads {FORMAT_VERSION}")
    missing = [k for k in SIDECAR_KEYS if k not in sidecar]
    if missing:
        raise PolicyFileError(f"{path / SIDECAR_FILE}: lacks {', '.join(missing)}")
    if sidecar["features"] != list(FEATURES):
        raise PolicyFileError(f"{path / SIDECAR_FILE}: trained on other features than this version computes")
    if sidecar["kind"] not in ("regression", "lambdarank"):
        raise PolicyFileError(f"{path / SIDECAR_FILE}: unknown model kind {sidecar['kind']!r}")
    offered = {str(c) for c in all_choices(True)}
    unknown = [c for c in sidecar["choices"] if c not in offered]
    if unknown:  # the choices are named as rakv.choices names them; a renamed one would be ranked as another
        raise PolicyFileError(f"{path / SIDECAR_FILE}: trained on choices this version does not offer: {unknown[0]}")
    try:
        settings_from_json(ControllerConfig, sidecar["controller"])
    except (TypeError, ValueError) as exc:
        raise PolicyFileError(f"{path / SIDECAR_FILE}: bad controller settings ({exc})") from None
    import lightgbm as lgb
    try:
        text = (path / MODEL_FILE).read_text()
        booster = lgb.Booster(model_str=text)
    except FileNotFoundError:
        raise PolicyFileError(f"{path}: no {MODEL_FILE}") from None
    except (OSError, ValueError, lgb.basic.LightGBMError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PolicyFileError(f"{path / MODEL_FILE}: not a LightGBM text model (truncated or corrupt): {first}") from None
    if booster.num_feature() != len(FEATURES):
        raise PolicyFileError(f"{path / MODEL_FILE}: has {booster.num_feature()} features, the sidecar {len(FEATURES)}")
    return PolicyFile(path, booster, sidecar)


def scores(kind: str, outputs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The model's outputs for one request's choices as scores, lower better: the log
    predicted cost (regression: the analytic price corrected), or minus the rank score."""
    return outputs + rows[:, ANALYTIC_COLUMN] if kind == "regression" else -outputs


class LearnedPolicy:
    """Ranks every choice with the model; plans adaptive rounds and keeps estimates with the
    analytic policy inside it, which runs the sidecar's controller settings (the features
    and the planners were tuned with them) under the caller's memory limit."""

    name = "learned"

    def __init__(self, policy_file: PolicyFile, timings: PairTimings, memory_limit_bytes: int | None = None):
        self.file = policy_file
        self.analytic = CostModelPolicy(timings, replace(policy_file.controller, memory_limit_bytes=memory_limit_bytes))
        self.choices = all_choices(timings.draft is not None)
        self.kind = policy_file.kind
        self._choice: Choice | None = None

    @property
    def controller(self) -> ControllerConfig:
        """The controller settings this policy runs: the sidecar's, with the memory limit."""
        return self.analytic.config

    @property
    def acceptance(self) -> dict[str, float]:
        return self.analytic.acceptance

    def decide(self, features: RequestFeatures) -> Action:
        rows = feature_rows(features, self.analytic, self.choices)  # [choices, features]
        outputs = self.file.booster.predict(rows)  # every choice in one call
        ranked = scores(self.kind, outputs, rows)
        limit = self.controller.memory_limit_bytes
        if limit is not None:  # choices whose working KV would not fit are out
            fits = [action_bytes(c.action, features, self.analytic.timings) <= limit for c in self.choices]
            if not any(fits):
                raise ValueError(f"no action fits the memory limit of {limit} bytes for a "
                                 f"{features.num_prompt_tokens}-token prompt")
            ranked = np.where(fits, ranked, np.inf)
        self._choice = self.choices[int(np.argmin(ranked))]
        return self._choice.action

    def planner(self, features: RequestFeatures, action: Action):
        if self._choice is None or self._choice.action != action:
            raise ValueError("the learned policy plans only the action it decided")
        return make_planner(self._choice, features, self.analytic)

    def observe(self, outcome: RequestOutcome) -> None:
        self.analytic.observe(outcome)
