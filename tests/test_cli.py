"""The command line: text and JSON output, prompts files, one-line errors with exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rakv.generate import main

ROOT = Path(__file__).resolve().parents[1]


def run_main(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_fields(capsys):
    code, out, _ = run_main(capsys, "--pair", "tiny", "--policy", "joint-k4", "--max-new-tokens", "16",
                            "--json", "hello world", "hello world")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("policy", "action", "hit_tokens", "ttft_s", "e2e_s", "output_ids", "accepted_per_round"):
            assert key in row
        assert row["action"] == {"r": 1, "k": 4, "drafter": "draft"}
        assert len(row["output_ids"]) == 16
    assert rows[1]["hit_kind"] == "exact" and rows[1]["output_ids"] == rows[0]["output_ids"]


def test_prompts_files_share_one_store(tmp_path, capsys):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "The cat sat on the mat."}\n{"prompt": "The cat sat on the mat. Then"}\n')
    code, out, _ = run_main(capsys, "--prompts", str(jsonl), "--policy", "kv-only", "--json", "--max-new-tokens", "4")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["hit_kind"] for r in rows] == ["miss", "partial"]
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    code, out, _ = run_main(capsys, "--prompts", str(text), "--policy", "ar", "--max-new-tokens", "4")
    assert code == 0 and len(out.splitlines()) >= 2


def test_default_runs_the_demo(capsys):
    code, out, err = run_main(capsys)
    assert code == 0
    assert "exact" in err and "partial" in err


@pytest.mark.parametrize("argv, message", [
    (["--pair", "tiny", ""], "empty prompt"),
    (["--pair", "tiny", "x" * 400], "maximum is 256 positions"),
    (["--pair", "nope-not-a-model", "hi"], "cannot load 'nope-not-a-model'"),
    (["--policy", "spec-k3", "hi"], "unknown policy 'spec-k3'"),
    (["--policy", "fastest", "hi"], "unknown policy 'fastest'"),
    (["--store-budget-mib", "0", "hi"], "must be positive"),
    (["--store-budget-mib", "-5", "hi"], "must be positive"),
    (["--max-new-tokens", "0", "hi"], "at least 1"),
    (["--memory-limit-mib", "0.0001", "hi"], "no action fits the memory limit"),
    (["--prompts", "/nonexistent/prompts.txt"], "prompts file not found"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_weights_names_a_bad_mode_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--weights", "int8/int3", "hi"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("argument --weights: must be MODE or TARGET/DRAFT, each one of auto, fp32, int8, int4, "
                         "int4-pure; got 'int8/int3'")


@pytest.mark.parametrize("lines, message", [
    ('{"prompt": "ok"}\n{"text": "no prompt field"}\n',
     ":2: give exactly one of 'prompt' (text) and 'prompt_ids' (token ids)"),
    ('{"prompt": 42}\n', ":1: 'prompt' must be non-empty text, got 42"),
    ('["a list"]\n', ":1: expected a JSON object with a 'prompt' or 'prompt_ids' field, got list"),
    ('{"prompt": "ok", "max_new_tokens": 0}\n', ":1: 'max_new_tokens' must be an integer >= 1, got 0"),
    ('{"prompt": "ok"}\n{"prompt_ids": [300]}\n', ":2: token id 300 is outside the vocabulary of 258"),
    ("", ": no prompts (the file is empty)"),
    ("\n  \n", ": no prompts (the file is empty)"),
])
def test_bad_prompts_file_is_one_line_naming_the_line(tmp_path, capsys, lines, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines)
    code, out, err = run_main(capsys, "--prompts", str(bad))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [f"error: {bad}{message}"]


def test_prompt_ids_and_per_line_token_caps(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [256, 104, 105], "max_new_tokens": 3}\n{"prompt": "hi", "max_new_tokens": 5}\n')
    code, out, _ = run_main(capsys, "--prompts", str(prompts), "--policy", "ar", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [len(r["output_ids"]) for r in rows] == [3, 5]
    assert rows[0]["output_ids"] == rows[1]["output_ids"][:3]  # "hi" encodes to the same ids


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "rakv.generate", "--policy", "nope", "hi"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown policy 'nope'")
    assert "Traceback" not in proc.stderr


def test_probe_bench_runs_on_the_tiny_pair(capsys):
    """bench.probe times the same request again and again between probes: every output the
    same, and the report names both spreads and their correlation."""
    from bench.probe import main as probe
    assert probe(["--pair", "tiny", "--seconds", "0.2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "over the probes" in out and "correlation" in out and "checks failed 0" in out


def test_assisted_bench_and_profile_run_on_the_tiny_pair(capsys):
    """The speculation bench's two modes, end to end on the tiny pair (one prose prompt):
    every config's output equals ar's, and the profile splits the time of both requests."""
    import torch
    from bench.assisted import main as assisted
    threads = torch.get_num_threads()  # the bench runs at 1 thread; the tests after it should not
    try:
        assert assisted(["--pair", "tiny", "--code", "0", "--prose", "1", "--max-new-tokens", "8",
                         "--fixed", "spec-k4"]) == 0
        out = capsys.readouterr().out
        assert "rakv / hf assisted" in out and "hf assisted" in out
        assert assisted(["--pair", "tiny", "--code", "0", "--prose", "1", "--max-new-tokens", "8", "--profile"]) == 0
        out = capsys.readouterr().out
        assert assisted(["--pair", "tiny", "--code", "0", "--prose", "1", "--max-new-tokens", "8",
                         "--profile", "rakv"]) == 0
        assert "engine rakv" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert "engine joint-k4" in out and "target forward" in out and "draft forward" in out
