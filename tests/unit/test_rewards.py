"""Reward functions, user reward loading, and failure reporting."""
import pytest

from portagrpo.rewards.functions import (
    RewardFunctionError,
    RewardResolver,
    RewardSpecError,
    extract_gsm8k_answer,
    gsm8k_reward,
    normalize_number,
    repeat_task_reward,
    score_responses,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("#### $42.00", "42"),
        ("#### -5", "-5"),
        ("The answer is 42.", "42"),
        ("the answer is: 3.50", "3.5"),
        ("first #### 3 then #### 4", "4"),
        ("no number here", None),
        ("I think 12 apples", None),  # strict: a bare number is not an answer
    ],
)
def test_gsm8k_extraction(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_normalize_number():
    assert normalize_number("1,000") == "1000"
    assert normalize_number("7.") == "7"
    assert normalize_number("0.250") == "0.25"
    assert normalize_number("abc") is None


def test_gsm8k_reward_scores():
    assert gsm8k_reward("openai/gsm8k", "#### 18", "18")["score"] == 1.0
    assert gsm8k_reward("openai/gsm8k", "the answer is 18.0", "18")["score"] == 1.0
    assert gsm8k_reward("openai/gsm8k", "#### 17", "18") == {"score": 0.0, "correct": False}


def test_repeat_reward_partial_credit():
    assert repeat_task_reward("", "77777777", "7")["score"] == 1.0
    assert repeat_task_reward("", "1111", "7")["score"] == pytest.approx(4 * 0.25 / 8)
    assert repeat_task_reward("", "7a7", "7")["score"] == pytest.approx(2 / 8)


def test_auto_resolution_by_data_source_and_unknown_source():
    r = RewardResolver("auto")
    r.check_sources({"openai/gsm8k", "portagrpo/repeat"})
    with pytest.raises(RewardSpecError, match="data_source 'mystery'"):
        r.check_sources({"mystery"})


def test_user_function(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(solution_str.strip() == ground_truth)\n")
    r = RewardResolver(f"{f}:score")
    out = score_responses(r, ["a", "b"], ["a", "a"], ["x", "x"], [0, 1])
    assert out.scores == [1.0, 0.0] and out.correct == [True, False]


def test_user_function_missing_name(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("x = 1\n")
    with pytest.raises(RewardSpecError, match="defines no function named 'score'"):
        RewardResolver(f"{f}:score")


def _resolver(tmp_path, body):
    f = tmp_path / "bad.py"
    f.write_text(body)
    return RewardResolver(f"{f}:score")


def test_raising_reward_stops_with_sample_and_prompt_id(tmp_path):
    r = _resolver(
        tmp_path,
        "def score(ds, s, gt, extra=None):\n    if s == 'boom':\n        raise RuntimeError('kaput')\n    return 1.0\n",
    )
    with pytest.raises(RewardFunctionError) as info:
        score_responses(r, ["ok", "boom", "ok"], ["1"] * 3, ["x"] * 3, [10, 11, 12])
    msg = str(info.value)
    assert "sample 1" in msg and "prompt id 11" in msg and "RuntimeError: kaput" in msg


def test_nan_reward_is_a_failure(tmp_path):
    r = _resolver(tmp_path, "def score(ds, s, gt, extra=None):\n    return float('nan')\n")
    with pytest.raises(RewardFunctionError, match="non-finite"):
        score_responses(r, ["a"], ["1"], ["x"], [0])


def test_tolerated_failures_are_counted_and_zeroed(tmp_path):
    r = _resolver(tmp_path, "def score(ds, s, gt, extra=None):\n    return 1.0 if s != 'bad' else None\n")
    out = score_responses(r, ["a", "bad", "c", "d"], ["1"] * 4, ["x"] * 4, [0, 1, 2, 3], max_error_frac=0.25)
    assert out.scores == [1.0, 0.0, 1.0, 1.0] and len(out.failures) == 1 and out.failures[0].sample == 1
    with pytest.raises(RewardFunctionError):
        score_responses(r, ["bad", "bad", "c", "d"], ["1"] * 4, ["x"] * 4, [0, 1, 2, 3], max_error_frac=0.25)
