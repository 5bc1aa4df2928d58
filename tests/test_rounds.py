"""The shared decode-loop walk: rounds walked again give the same iterations, and the draft
cache's account is one."""
from __future__ import annotations

from rakv.acceptance import ReplayedRound, replay_request, run_lengths
from rakv.drafters import RunLengths
from rakv.round_planner import FixedRounds
from rakv.rounds import RecordedRounds, draft_cache_positions, tokens_appended, walk


def _walked(rounds, num_prompt, num_output, draft_reused):
    steps = []
    made = walk(RecordedRounds(rounds, num_output), num_prompt, draft_reused,
                lambda t, rnd, draft_seen: steps.append((t, rnd, draft_seen)))
    return made, steps


def test_recorded_rounds_walk_as_they_were_made():
    agree = [True, True, False, True, True, True, True, False, True, True]
    lengths = {"draft": RunLengths(run_lengths(agree, max_k=3), [3] * 10, [0] * 10)}
    rounds = replay_request(FixedRounds("draft", 2), lengths, 10, 10)
    made, steps = _walked(rounds, 5, 10, 2)
    assert made == rounds
    assert [(t, rnd is not None) for t, rnd, _ in steps] == [(1, True), (3, True), (6, True), (8, True)]
    # before each round the draft's cache holds the reused 2 positions, then what the last
    # round left: the sequence it drafted from and its proposal but the last token, cut
    # to the tokens that stand (at 3 both drafts stood: 5 + 3 + 2 - 1)
    assert [draft_seen for _, _, draft_seen in steps] == [2, 7, 9, 12]


def test_plain_steps_fill_the_gaps_and_an_accepted_eos_ends_the_walk():
    # a round at 2 accepts 3 of 4, the output's last 3 tokens (the last an EOS): no target token
    rounds = (ReplayedRound(2, "draft", 4, 4, 3),)
    assert tokens_appended(3, 2, 5) == 3
    made, steps = _walked(rounds, 10, 5, 0)
    assert made == list(rounds)
    assert [(t, rnd) for t, rnd, _ in steps] == [(1, None), (2, rounds[0])]
    assert [draft_seen for _, _, draft_seen in steps] == [0, 0]
    assert draft_cache_positions(10, 0, rounds, 5) == 10 + 2 + 3 - 1


def test_draft_positions_move_only_at_draft_rounds():
    rounds = (ReplayedRound(1, "ngram", 4, 2, 2), ReplayedRound(4, "draft", 2, 2, 0),
              ReplayedRound(5, "ngram", 3, 0, 0))
    made, steps = _walked(rounds, 7, 12, 3)
    starts = [t for t, rnd, _ in steps if rnd is not None]
    assert starts == [1, 4, 5]
    seen_after = {t: draft_seen for t, _, draft_seen in steps}
    assert seen_after[4] == 3 and seen_after[5] == 7 + 4 + 1 - 1  # proposed 2, appended 1 (the target's token)
    assert draft_cache_positions(7, 3, rounds, 12) == seen_after[5] == seen_after[11]
