"""Policy names, resolved one way for the engine (``rakv.generate``) and the simulator
(``simulator.replay``). Imports no torch; LightGBM only when a learned policy loads.

A name is one of:
- a fixed policy (``rakv.choices``: ``ar``, ``kv-only``, ``spec-k4``, ...);
- ``rakv``, the analytic controller, with the caller's controller settings;
- ``learned``: the shipped learned policy of the pair, ``policies/<pair>``;
- ``learned=PATH``, or PATH itself (it holds a ``/`` or a ``policy.json``): the learned
  policy in that directory (``policy.train``'s ``--out``). It runs with its sidecar's
  controller settings (``rakv.learned``); trained for other models, it warns and falls
  back to ``rakv`` with the caller's settings, or under ``strict`` fails.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rakv.choices import ADAPTIVE_NAME, FIXED_POLICY_HELP, fixed_action
from rakv.controller import ControllerConfig, Policy, make_policy
from rakv.cost_model import PairTimings
from rakv.drafters import DRAFT_MODEL
from rakv.learned import SIDECAR_FILE, LearnedPolicy, PolicyFileError, load_policy

SHIPPED_POLICIES = Path(__file__).resolve().parents[1] / "policies"  # one directory per pair name
LEARNED = "learned"
POLICY_HELP = (f"{FIXED_POLICY_HELP}, {LEARNED} (the pair's shipped learned policy), "
               f"{LEARNED}=PATH or PATH (a policy.train directory)")


def policy_path(name: str, pair: str | None) -> Path | None:
    """The learned policy directory ``name`` names, or None for a built-in policy."""
    if fixed_action(name) is not None or name == ADAPTIVE_NAME:
        return None
    if name == LEARNED:
        shipped = shipped_policy(pair)
        if shipped is None:
            raise PolicyFileError(f"policy {LEARNED!r}: no learned policy is shipped for pair {pair!r} "
                                  f"(in {SHIPPED_POLICIES}); name one with {LEARNED}=PATH")
        return shipped
    if name.startswith(LEARNED + "="):
        return Path(name.split("=", 1)[1])
    if "/" in name or (Path(name) / SIDECAR_FILE).is_file():
        return Path(name)
    return None


def shipped_policy(pair: str | None) -> Path | None:
    """``policies/<pair>`` if it exists."""
    path = SHIPPED_POLICIES / str(pair)
    return path if pair is not None and path.is_dir() else None


def check_policy(name: str, pair: str | None, draft_model: bool = True) -> None:
    """Fail before any model loads or any replay: an unknown name, a fixed policy that needs
    the draft model a pair lacks, or a learned policy whose files are bad (they are loaded)."""
    path = policy_path(name, pair)
    if path is not None:
        load_policy(path)
    else:
        _built_in(name, pair, draft_model)


def _built_in(name: str, pair: str | None, draft_model: bool) -> None:
    action = fixed_action(name)
    if action is None and name != ADAPTIVE_NAME:
        raise ValueError(f"unknown policy {name!r}; choose one of: {POLICY_HELP}")
    if action is not None and action.k and action.drafter == DRAFT_MODEL and not draft_model:
        raise ValueError(f"policy {name!r} needs a draft model; pair {pair!r} has none (the ngram policies need none)")


def resolve_policy(name: str, timings: PairTimings | None, config: ControllerConfig, target_fingerprint: str | None,
                   draft_fingerprint: str | None, pair: str | None, strict: bool = False) -> Policy:
    """The policy ``name`` names (see the module docstring), for the pair ``pair`` whose
    models have these fingerprints (``draft_fingerprint`` None: no draft model) and whose
    calibration is ``timings`` (None will do for a fixed policy). ``config`` is the
    caller's controller settings: ``rakv`` runs them, a learned policy only their memory
    limit. Raises ValueError (a ``PolicyFileError`` for a policy directory) in one line."""
    path = policy_path(name, pair)
    if path is None:
        _built_in(name, pair, draft_fingerprint is not None)
        return make_policy(name, timings, config)
    policy_file = load_policy(path)
    if timings is None:
        raise ValueError(f"policy {name!r} needs timing statistics (calibrate the pair first)")
    if policy_file.trained_for(target_fingerprint, draft_fingerprint):
        return LearnedPolicy(policy_file, timings, config.memory_limit_bytes)
    message = f"{path}: trained for other models than these; "
    if strict:
        raise PolicyFileError(message + "refusing under --strict")
    print(f"warning: {message}falling back to the analytic rakv policy", file=sys.stderr)
    return make_policy(ADAPTIVE_NAME, timings, config)
