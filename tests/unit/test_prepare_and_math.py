"""Data preparation for GSM8K/MATH files and the hard cases of answer checking."""
import json

import pytest

from portagrpo.cli import main
from portagrpo.data.prepare import convert
from portagrpo.data.records import DataError, load_records
from portagrpo.rewards.functions import (
    RewardResolver,
    extract_gsm8k_answer,
    gsm8k_flexible_reward,
    math_reward,
    score_responses,
)
from portagrpo.rewards.math_answers import extract_boxed, is_equivalent


def _gsm8k_file(tmp_path):
    lines = [
        json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}),
        "{this is not json",
        json.dumps({"question": "Big?", "answer": "so\n#### 1,234"}),
        json.dumps({"question": "No marker", "answer": "just 5"}),
        "",
        json.dumps({"question": "Debt?", "answer": "#### -12"}),
    ]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


def test_gsm8k_conversion_skips_and_reports_malformed_lines(tmp_path):
    logs = []
    out, n, problems = convert("gsm8k", _gsm8k_file(tmp_path), tmp_path / "out", log=logs.append)
    assert out.name == "train.parquet" and n == 3
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in problems] == ["2", "4"]
    assert "not valid JSON" in problems[0] and "no '#### <final answer>'" in problems[1]
    records = load_records([str(out)])
    assert [r.ground_truth for r in records] == ["7", "1234", "-12"]
    assert records[0].data_source == "openai/gsm8k" and records[0].prompt[0]["role"] == "user"
    assert "####" in records[0].prompt[0]["content"] and records[0].extra_info["split"] == "train"


def test_gsm8k_conversion_can_reject(tmp_path):
    with pytest.raises(DataError, match=r"train.jsonl:2: not valid JSON"):
        convert("gsm8k", _gsm8k_file(tmp_path), tmp_path / "out", on_error="fail")


def test_math_conversion_from_folder_and_jsonl(tmp_path):
    folder = tmp_path / "MATH" / "test" / "algebra"
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(json.dumps({"problem": "Solve $x+1=3$.", "solution": "So $x=\\boxed{2}$.",
                                               "level": "Level 1", "type": "Algebra"}))
    (folder / "2.json").write_text(json.dumps({"problem": "Half?", "solution": "It is \\boxed{\\frac{1}{2}}."}))
    (folder / "3.json").write_text(json.dumps({"problem": "Bad", "solution": "no box"}))
    out, n, problems = convert("math", tmp_path / "MATH" / "test", tmp_path / "out", fmt="jsonl")
    assert n == 2 and len(problems) == 1 and "3.json" in problems[0]
    recs = load_records([str(out)])
    assert [r.ground_truth for r in recs] == ["2", "\\frac{1}{2}"] and recs[0].data_source == "hendrycks/math"
    assert recs[0].extra_info["level"] == "Level 1"


def test_data_cli(tmp_path, capsys):
    assert main(["data", "gsm8k", "--input", str(_gsm8k_file(tmp_path)), "--output", str(tmp_path / "o"),
                 "--format", "jsonl"]) == 0
    assert "wrote 3 rows" in capsys.readouterr().out
    assert main(["data", "gsm8k", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")]) == 2


@pytest.mark.parametrize("text,truth,flexible_ok", [
    ("#### -3", "-3", True),                      # negative numbers
    ("The answer is 1,250.", "1250", True),        # commas
    ("she pays $18.00 in total", "18", True),      # units, trailing zeros (flexible form)
    ("#### 3/4", "0.75", True),                    # fractions
    ("I don't know", "5", False),                  # no answer
    ("first 12 then 15 apples", "15", True),       # last number
])
def test_gsm8k_hard_cases(text, truth, flexible_ok):
    assert gsm8k_flexible_reward("gsm8k", text, truth)["correct"] is flexible_ok


def test_strict_form_ignores_bare_numbers():
    assert extract_gsm8k_answer("I think it is 15") is None
    assert extract_gsm8k_answer("I think it is 15", flexible=True) == "15"


@pytest.mark.parametrize("response,truth,ok", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", True),
    ("\\boxed{-\\frac{2}{3}}", "-\\frac{2}{3}", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\boxed{10\\%}", "10", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{\\text{(B)}}", "(B)", True),
    ("\\boxed{3}", "4", False),
    ("no boxed answer, 4", "4", False),
])
def test_math_hard_cases(response, truth, ok):
    assert math_reward("math", response, truth)["correct"] is ok


def test_boxed_extraction_takes_the_last_balanced_one():
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert extract_boxed("none") is None
    assert is_equivalent("2x+1", "1+2x")


def test_weighted_sum_and_format_rewards():
    r = RewardResolver("gsm8k_flexible*1.0+format_answer*0.5")
    out = score_responses(r, ["The answer is 4", "4", "The answer is 5"], ["4"] * 3, ["x"] * 3, [0, 1, 2])
    assert out.scores == [1.5, 1.0, 0.5] and out.correct == [True, True, False]
    think = RewardResolver("format_think")
    assert score_responses(think, ["<think>hm</think> 4", "4"], ["4"] * 2, ["x"] * 2, [0, 1]).scores == [1.0, 0.0]


def test_slow_reward_times_out_in_the_pool(tmp_path):
    from portagrpo.rewards.functions import RewardFunctionError
    from portagrpo.rewards.pool import RewardPool

    f = tmp_path / "slow.py"
    f.write_text("import time\ndef score(ds, s, gt, extra=None):\n    if s == 'hang':\n        time.sleep(60)\n"
                 "    return 1.0\n")
    spec = f"{f}:score"
    pool = RewardPool(spec, num_workers=1, timeout_s=2.0)
    try:
        out = score_responses(RewardResolver(spec), ["a", "hang", "b", "c"], ["1"] * 4, ["x"] * 4, [0, 1, 2, 3],
                              max_error_frac=0.5, pool=pool)
        assert out.scores == [1.0, 0.0, 1.0, 1.0]
        assert len(out.failures) == 1 and "TimeoutError" in out.failures[0].message and out.failures[0].sample == 1
        with pytest.raises(RewardFunctionError, match="took longer than reward.timeout_s=2s"):
            score_responses(RewardResolver(spec), ["hang"], ["1"], ["x"], [7], pool=pool)
    finally:
        pool.close()
