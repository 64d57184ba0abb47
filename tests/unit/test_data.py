"""Dataset loading (JSONL, Parquet), chat templates, prompt padding and the resumable loader."""
import json

import pytest

from portagrpo.data.records import (
    DataError,
    PromptLoader,
    filter_long_prompts,
    left_pad,
    load_records,
    render_prompt,
    task_records,
    write_jsonl,
)
from portagrpo.data.tasks import gsm8k_style_rows


def test_jsonl_and_parquet_give_same_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gsm8k_style_rows(20, seed=1)
    j = write_jsonl(rows, tmp_path / "d.jsonl")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    a, b = load_records([str(j)]), load_records([str(p)])
    assert len(a) == len(b) == 20
    assert [(r.prompt, r.ground_truth, r.data_source) for r in a] == [
        (r.prompt, r.ground_truth, r.data_source) for r in b
    ]
    assert a[0].data_source == "openai/gsm8k" and a[0].prompt[0]["role"] == "user"


def test_string_prompts_are_accepted(tmp_path):
    j = write_jsonl(
        [{"prompt": "2+2=", "reward_model": {"ground_truth": "4"}, "data_source": "gsm8k"}], tmp_path / "s.jsonl"
    )
    (rec,) = load_records([str(j)])
    assert rec.prompt == "2+2=" and rec.ground_truth == "4"


def test_malformed_json_line_is_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "a", "reward_model": {"ground_truth": "1"}}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_records([str(f)])


def test_missing_fields_are_named(tmp_path):
    f = write_jsonl([{"question": "x"}], tmp_path / "q.jsonl")
    with pytest.raises(DataError, match="no 'prompt' field"):
        load_records([str(f)])
    f = write_jsonl([{"prompt": "x"}], tmp_path / "g.jsonl")
    with pytest.raises(DataError, match="reward_model.ground_truth"):
        load_records([str(f)])


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_records([str(tmp_path / "nope.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown extension"):
        load_records([str(tmp_path / "x.csv")])


def test_chat_template_applied(tokenizer):
    text = render_prompt(tokenizer, [{"role": "user", "content": "repeat 3"}])
    assert text == "u:repeat 3\na:"
    assert render_prompt(tokenizer, "raw") == "raw"


def test_long_prompts_are_dropped(tokenizer):
    recs = task_records("arith", 30, seed=0)
    kept, dropped = filter_long_prompts(tokenizer, recs, max_len=40)
    assert dropped == 30 - len(kept) and dropped > 0


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_loader_epochs_and_resume():
    recs = task_records("repeat", 10, seed=0)
    a = PromptLoader(recs, 3, seed=5)
    seen = [[r.index for r in a.next_batch()] for _ in range(3)]
    assert sorted(sum(seen, [])) == sorted(set(sum(seen, [])))  # no repeats within an epoch
    state = a.state_dict()
    rest = [[r.index for r in a.next_batch()] for _ in range(4)]
    b = PromptLoader(recs, 3, seed=5)
    b.load_state_dict(state)
    assert [[r.index for r in b.next_batch()] for _ in range(4)] == rest
    assert a.epoch == 2


def test_loader_too_small():
    with pytest.raises(DataError, match="fewer than data.train_batch_size=8"):
        PromptLoader(task_records("repeat", 4, seed=0), 8, seed=0)


def test_token_budget_groups_fit_balance_and_repeat():
    import random

    from portagrpo.batch import token_budget_groups

    rng = random.Random(4)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(40, 120)
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each row exactly once
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert max(loads) <= budget
        assert len(groups) >= -(-sum(lengths) // budget)  # never fewer than the budget needs
        assert groups == token_budget_groups(lengths, budget)  # deterministic
    # balanced: 8 equal rows under a budget for 3 go 3/3/2, not 3/3/1/1
    assert [len(g) for g in token_budget_groups([10] * 8, 30)] == [3, 3, 2]
    assert token_budget_groups([50, 5, 5], 20) == [[0], [1, 2]]  # a row over the budget goes alone
