"""The learned policy, live: the analytic ``rakv`` policy decides each request (r, and
whether to ready the draft model), and the learned round planner
(``rakv.learned_rounds``) plans each of its rounds. Imports no torch, and no lightgbm: the
models are compiled from their text (``rakv.trees``).

Why the request-level choice stays analytic: a learned per-request choice among 26 was
worth a few percent at best and ran at 0.97x of ``rakv`` live; the headroom is in each
round's drafter and k (the round oracle, ``simulator.round_oracle``).

A policy is a directory: per drafter and head, a LightGBM text model
``<drafter>.<head>.txt`` (``rakv.learned_rounds.HEADS``), and ``policy.json`` (the
sidecar: format version, features, the heads it has, the token priors, the draft model's
starting acceptance, the trace schema, the hardware and model fingerprints it was trained for, the
controller settings it was tuned with, its metrics and split). Never a pickle.
``load_policy`` checks every file; any problem is a one-line ``PolicyFileError``.
``policy.train`` writes the directory; ``rakv.policies`` resolves a name to it, and falls
back to the analytic controller with a warning (or fails under ``strict``) for a policy
trained for other models.

A learned policy runs with the controller settings it was tuned with (the sidecar's:
``LearnedPolicy.controller``), whatever the caller's are; only the memory limit, a
property of the machine, is the caller's. A drafter with heads has its rounds start each
request from fixed priors, not from the requests before (the model has learnt the
pair's), so where only such drafters are ready a request's rounds depend on the request
alone, and a replay computes them once per request (``memo_key``). A drafter without heads
(the store drafter, which ``policy.train`` leaves to the EWMA part; any drafter whose
training traces gave it too few rounds) has its rounds planned as ``rakv`` plans them:
from the policy's running estimate by signal, carried across requests, with geometric
runs. The store drafter's acceptance is what the store holds for this workload now (how
often requests repeat earlier ones), which no recorded trace shows and the running
estimate measures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from rakv.controller import ControllerConfig, CostModelPolicy, RequestOutcome
from rakv.cost_model import Action, PairTimings, RequestFeatures
from rakv.drafters import DRAFT_MODEL, DRAFTERS
from rakv.learned_rounds import HEADS, ROUND_FEATURES, LearnedRounds, RoundModel, repeat_share
from rakv.settings import settings_from_json, settings_to_json
from rakv.trees import compile_model

FORMAT = "rakv-learned-policy"
FORMAT_VERSION = 2  # 1: a per-request choice ranker (LightGBM over 26 choices)
SIDECAR_FILE = "policy.json"
SIDECAR_KEYS = ("format", "format_version", "features", "heads", "token_priors", "draft_prior", "schema_version",
                "hardware", "models", "controller", "metrics", "split")


def head_file(drafter: str, head: str) -> str:
    return f"{drafter}.{head}.txt"


class PolicyFileError(ValueError):
    """A policy directory that cannot be used; the message is one line."""


@dataclass(frozen=True)
class PolicyFile:
    path: Path
    model: RoundModel | None
    sidecar: dict

    @classmethod
    def in_memory(cls, model: RoundModel | None, controller: ControllerConfig, draft_prior: float) -> "PolicyFile":
        """A policy not written anywhere (a tuning trial's; model None: the analytic planner
        that logs the first pass of training data)."""
        return cls(Path("<in memory>"), model, {"controller": settings_to_json(controller), "draft_prior": draft_prior})

    @property
    def controller(self) -> ControllerConfig:
        return settings_from_json(ControllerConfig, self.sidecar["controller"])

    def trained_for(self, target_fingerprint: str | None, draft_fingerprint: str | None) -> bool:
        return any(m.get("target") == target_fingerprint and m.get("draft") == draft_fingerprint
                   for m in self.sidecar["models"])


def load_policy(path: str | Path) -> PolicyFile:
    path = Path(path)
    if not path.is_dir():
        raise PolicyFileError(f"{path}: no such policy directory (it holds {SIDECAR_FILE} and the round models)")
    sidecar_path = path / SIDECAR_FILE
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except FileNotFoundError:
        raise PolicyFileError(f"{path}: no {SIDECAR_FILE}") from None
    except (OSError, ValueError) as exc:
        raise PolicyFileError(f"{sidecar_path}: not valid JSON ({exc})") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise PolicyFileError(f"{sidecar_path}: not a {FORMAT} sidecar")
    if sidecar.get("format_version") != FORMAT_VERSION:
        raise PolicyFileError(f"{sidecar_path}: format version {sidecar.get('format_version')}, this version reads "
                              f"{FORMAT_VERSION}: retrain it (python -m policy.train)")
    missing = [k for k in SIDECAR_KEYS if k not in sidecar]
    if missing:
        raise PolicyFileError(f"{sidecar_path}: lacks {', '.join(missing)}")
    if sidecar["features"] != list(ROUND_FEATURES):
        raise PolicyFileError(f"{sidecar_path}: trained on other features than this version computes")
    heads = sidecar["heads"]
    if not isinstance(heads, list) or any(d not in DRAFTERS for d in heads):  # none: the EWMA plans every round
        raise PolicyFileError(f"{sidecar_path}: 'heads' must list drafters among {', '.join(DRAFTERS)}")
    try:
        settings_from_json(ControllerConfig, sidecar["controller"])
        draft_prior = float(sidecar["draft_prior"])
    except (TypeError, ValueError) as exc:
        raise PolicyFileError(f"{sidecar_path}: bad controller settings or draft prior ({exc})") from None
    compiled = {}
    for drafter in heads:
        pair = []
        for head in HEADS:
            file = path / head_file(drafter, head)
            try:
                pair.append(compile_model(file.read_text(), len(ROUND_FEATURES)))
            except FileNotFoundError:
                raise PolicyFileError(f"{path}: no {file.name}") from None
            except (OSError, ValueError, KeyError, IndexError, SyntaxError) as exc:
                raise PolicyFileError(f"{file}: not a LightGBM text model of {len(ROUND_FEATURES)} features "
                                      f"(truncated or corrupt): {exc}") from None
        compiled[drafter] = tuple(pair)
    if not 0 <= draft_prior <= 1:
        raise PolicyFileError(f"{sidecar_path}: draft_prior must be in [0, 1], got {draft_prior}")
    return PolicyFile(path, RoundModel(compiled, token_priors_from_json(sidecar["token_priors"], sidecar_path)),
                      sidecar)


def token_priors_to_json(priors: dict) -> dict:
    return {d: {"default": default, "by_token": {str(token): p for token, p in sorted(table.items())}}
            for d, (table, default) in priors.items()}


def token_priors_from_json(found, sidecar_path: Path) -> dict:
    try:
        return {d: ({int(token): float(p) for token, p in entry["by_token"].items()}, float(entry["default"]))
                for d, entry in found.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise PolicyFileError(f"{sidecar_path}: bad token_priors ({exc!r})") from None


class LearnedPolicy:
    """The analytic policy's request-level decisions (under the sidecar's controller
    settings and the caller's memory limit) and the learned round planner."""

    name = "learned"

    def __init__(self, policy_file: PolicyFile, timings: PairTimings, memory_limit_bytes: int | None = None):
        self.file = policy_file
        self.analytic = CostModelPolicy(timings, replace(policy_file.controller, memory_limit_bytes=memory_limit_bytes))
        # where each request's rounds start, whatever the requests before did (the
        # model-free drafters' from their priors by signal, ``initial_estimate``)
        self.start = {DRAFT_MODEL: float(policy_file.sidecar["draft_prior"])}

    @property
    def controller(self) -> ControllerConfig:
        """The controller settings this policy runs: the sidecar's, with the memory limit."""
        return self.analytic.config

    @property
    def acceptance(self) -> dict[str, float]:
        return self.analytic.acceptance

    def decide(self, features: RequestFeatures) -> Action:
        return self.analytic.decide(features)

    def planner(self, features: RequestFeatures, action: Action, log: list | None = None) -> LearnedRounds:
        """``log``: where the planner appends its decisions' features (training data). The
        drafters without heads start from the policy's running estimates by signal."""
        drafters, config, costs = self.analytic.planner_setup(features, action)
        heads = self.file.model.heads if self.file.model is not None else {}
        carried = {key: a for key, a in self.analytic.signal_acceptance.items()
                   if key[0] in drafters and key[0] not in heads}
        return LearnedRounds(drafters, carried, self.start, costs, config, self.file.model, features.num_prompt_tokens,
                             features.num_new_tokens, repeat_share(features.prompt_ids, 3), log)

    def observe(self, outcome: RequestOutcome) -> None:
        self.analytic.observe(outcome)
