"""How greedy answers are compared across hosts (tests/greedy.py): a step's margin, the decided steps, the check."""

from __future__ import annotations

import pytest

from tests.greedy import DECIDED_MARGIN, OBSERVED_SPREAD, assert_same_greedy, decided_steps, margin


def test_a_margin_is_the_chosen_tokens_lead_over_the_best_other() -> None:
    assert margin({5: -1.0, 7: -1.25, 9: -3.0}, 5) == 0.25
    assert margin({5: -1.0, 7: -1.0}, 7) == 0.0  # a tie decides nothing


def test_the_logit_bias_the_choice_saw_counts_and_an_unseen_token_scores_at_most_the_lowest_seen() -> None:
    top = {5: -1.0, 7: -2.0, 9: -4.0}
    assert margin(top, 9, {9: 100.0}) == pytest.approx(97.0)
    assert margin(top, 5, {7: 0.5}) == pytest.approx(0.5)
    # token 11 is not among the top: at most -4.0 before its bias, which may have brought it close, or past
    assert margin(top, 5, {11: 2.5}) == pytest.approx(0.5)
    assert margin(top, 5, {11: 3.5}) < 0


def test_steps_are_decided_up_to_the_first_one_that_is_not() -> None:
    big = DECIDED_MARGIN + OBSERVED_SPREAD
    assert decided_steps([big, big, DECIDED_MARGIN / 2, big]) == 2
    assert decided_steps([big, big]) == 2
    assert decided_steps([]) == 0


def test_answers_are_compared_as_far_as_the_reference_decided() -> None:
    decided, undecided = DECIDED_MARGIN * 2, DECIDED_MARGIN / 2
    assert_same_greedy([1, 2, 3, 4], [decided, decided, decided, undecided], [1, 2, 3, 9])
    with pytest.raises(AssertionError, match="differ"):
        assert_same_greedy([1, 2, 3, 4], [decided, decided, decided, undecided], [1, 2, 8, 4])
    with pytest.raises(AssertionError, match="choose another prompt"):
        assert_same_greedy([1, 2, 3, 4], [decided, undecided, decided, decided], [1, 2, 3, 4])
