"""The tool-use demo's parts: the `calc` task and its reward, the tokenizer that makes a Hermes call a few tokens, and
the warm start's examples (the call's format with a random operator: never the prompt's operator but by chance)."""
from collections import Counter

import pytest

from portagrpo.agent.hermes import ToolTurns, parse_tool_calls
from portagrpo.data.tasks import CALC_OPERATORS, TASKS
from portagrpo.errors import UserError
from portagrpo.rewards.functions import DATA_SOURCE_REWARDS, REWARDS
from portagrpo.rewards.tasks import calc_answer, calc_reward
from portagrpo.tools.warmstart import FormatExamples, build_tool_tokenizer, call_text, main_cli


def test_calc_rows_hold_the_exact_answer():
    rows = TASKS.get("calc")(300, 7)
    assert rows == TASKS.get("calc")(300, 7)
    assert {r["prompt"][0]["content"].split()[1] for r in rows} == set(CALC_OPERATORS)
    for r in rows:
        a, word, b = r["prompt"][0]["content"].split()
        assert len(a) == len(b) == 3
        assert r["reward_model"]["ground_truth"] == str(eval(f"{a}{CALC_OPERATORS[word]}{b}"))  # noqa: S307
        assert r["data_source"] == "portagrpo/calc"


def test_calc_reward_grades_the_policys_last_line_only():
    call = call_text("482*739")
    assert calc_answer(f"{call}\nt:356198\na:356198") == "356198"
    assert calc_reward(f"{call}\nt:356198\na:356198", "356198") == 1.0
    assert calc_reward("356198", "356198") == 1.0
    assert calc_reward(f"{call}\nt:356198\na:", "356198") == 0.0  # the tool's result is not the policy's answer
    assert calc_reward(f"{call}\nt:356198\na:356190", "356198") == 0.0  # no credit for a near miss
    assert calc_reward(f"{call}\nt:3561", "356198") == 0.0  # a tool turn cut by the length limit
    assert DATA_SOURCE_REWARDS["portagrpo/calc"] == "calc"
    assert REWARDS.get("calc")("portagrpo/calc", "-257", "-257", None) == {"score": 1.0, "correct": True}


def test_a_calculator_call_is_a_few_tokens_and_parses():
    tok = build_tool_tokenizer()
    text = call_text("482*739")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 + len("482*739")
    decoded = tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)
    assert decoded == text
    (call,) = parse_tool_calls(decoded)
    assert (call.name, call.arguments, call.problem) == ("calculator", {"expression": "482*739"}, None)
    prompt = tok.apply_chat_template([{"role": "user", "content": "482 times 739"}], tokenize=False,
                                     add_generation_prompt=True)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == 12  # the word is one token: one layout
    assert ToolTurns(tok, 16).render(["356198"]) == "\nt:356198\na:"


def test_warm_start_examples_teach_the_format_and_not_the_operator():
    tok = build_tool_tokenizer()
    examples = FormatExamples(tok, call_share=0.5, seed=3)
    pairs, calls = Counter(), 0
    for _ in range(600):
        ex = examples.one()
        text = tok.decode(ex.ids, skip_special_tokens=True)
        prompt, response = text.split("\na:", 1)
        a, word, b = prompt.removeprefix("u:").split()
        own = tok.decode([t for t, w in zip(ex.ids, ex.trained) if w], skip_special_tokens=True)
        found = parse_tool_calls(response)
        if not found:
            assert "\nt:" not in response and own == response  # a direct answer, every token trained
            assert response.split("\n")[0] == f"{a} {word} {b}"  # the question restated first, word included
            continue
        calls += 1
        expression = found[0].arguments["expression"]
        left, op, right = expression[:3], expression[3], expression[4:]
        assert (left, right) == (a, b)  # the prompt's numbers, in order
        pairs[(word, op)] += 1
        result = response.split("\nt:", 1)[1].split("\n", 1)[0]
        assert result == str(eval(expression))  # noqa: S307
        assert response.endswith(f"\na:{result}")  # the answer repeats the tool's result
        assert "\nt:" not in own  # the tool turn is never trained
    assert 240 < calls < 360
    for word in CALC_OPERATORS:  # every operator follows every word, about equally often
        counts = [pairs[(word, op)] for op in CALC_OPERATORS.values()]
        assert min(counts) > 0.5 * max(counts), (word, counts)


def test_warmstart_refuses_bad_arguments_in_one_sentence(tmp_path):
    with pytest.raises(UserError, match="--call-share"):
        main_cli(["--out", str(tmp_path / "w"), "--call-share", "1.5"])
    assert not (tmp_path / "w").exists()


def test_direct_answers_are_not_the_prompts_answer():
    tok = build_tool_tokenizer()
    examples = FormatExamples(tok, call_share=0.0, seed=5)
    right = 0
    for _ in range(200):
        text = tok.decode(examples.one().ids, skip_special_tokens=True)
        prompt, response = text.split("\na:", 1)
        a, word, b = prompt.removeprefix("u:").split()
        restated, answer = response.split("\n")  # the question, then the answer on the line the reward reads
        assert restated == f"{a} {word} {b}" and answer.lstrip("-").isdigit()
        right += answer == str(eval(f"{a}{CALC_OPERATORS[word]}{b}"))  # noqa: S307
    assert right <= 2
