"""Multi-turn rollouts on the vLLM engine, against the stand-in (tests/standins/fake_vllm.py) playing a GPU build with
sleep mode (vLLM 0.23.0; issue 45): all the turns of a step sample with the step's one push and one wake; a prompt is
measured with the tools' schemas it is sent with, and one that would not fit vLLM's context with a whole response is
refused in one sentence instead of ending its conversation early."""
import contextlib
import sys
import types
from pathlib import Path

import pytest
import torch

from portagrpo.agent.hermes import ToolTurns
from portagrpo.data.records import PromptRecord, filter_long_prompts, tokenize_prompts, truncate_long_prompts
from portagrpo.errors import UserError
from portagrpo.model.loading import build_char_tokenizer
from portagrpo.rollout.generators.conversation import Conversations
from portagrpo.rollout.settings import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402
from fake_vllm import FakeLLM  # noqa: E402

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
# a chat template that lists the tools for the model, as Qwen's does in its system message
TEMPLATE = ("{% if tools %}s:{% for t in tools %}{{ t['function']['name'] }}: {{ t['function']['description'] }}\n"
            "{% endfor %}{% endif %}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
WEIGHTS = [("model.embed_tokens.weight", torch.ones(4))]


class EveryTurnCallsATool:
    """A toolbox whose every turn called the calculator."""

    specs = {"calculator": types.SimpleNamespace(schema=SCHEMA)}

    def answer(self, turns, counts=None):
        from portagrpo.agent.sandbox import ToolResult

        return [[ToolResult("7")] for _ in turns]


@pytest.fixture()
def standin(monkeypatch):
    for name, module in fake_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances.clear()
    for attr, value in (("ascend", None), ("platform", "cuda"), ("vllm", None)):
        monkeypatch.setattr(FakeLLM, attr, value)
    return FakeLLM


def _tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _engine(tok, **kwargs):
    from portagrpo.rollout.vllm import VLLMRollout

    return VLLMRollout(None, tok, None, model_path="m", eos_ids=[tok.eos_token_id],
                       weights=lambda: contextlib.nullcontext(iter(WEIGHTS)), **kwargs)


RECORDS = [PromptRecord(i, [{"role": "user", "content": f"{i}+{i}="}], str(2 * i), "x") for i in range(2)]


def _pushes(llm) -> int:
    return sum(1 for e in llm.log if e[0] in ("reload", "load"))


def test_the_turns_of_a_step_share_its_one_push_and_one_wake(standin):
    """Issue 45: every turn used to sleep at level 2 (the weights discarded, the prefix cache dropped) and reload the
    policy at the next turn: 1 + (turns - 1) pushes and one wake per turn for a step. Now the step's push serves every
    turn, the engine wakes once and sleeps once."""
    tok = _tokenizer()
    engine = _engine(tok)
    (llm,) = standin.instances
    engine.update_weights(iter(WEIGHTS))  # the step's push, after the update
    loop = Conversations(tok, EveryTurnCallsATool(), ToolTurns(tok, 4), 4)
    start = len(llm.log)
    rb = loop.rollout(engine, RECORDS, 2, SamplingParams(40, 1.0), torch.device("cpu")).rollout
    events = [e[0] for e in llm.log[start:]]
    turns = events.count("generate")
    assert turns == 4 and rb.model_mask.sum() > 0  # every turn called the tool: max_assistant_turns turns
    print(f"stand-in, {turns} turns: pushes in the step {_pushes(llm)}, wakes in the rollout "
          f"{events.count('wake')}, sleeps {events.count('sleep')}")
    assert _pushes(llm) == 1  # the step's push only
    assert events.count("wake") == 1 and events.count("sleep") == 1 and "sleep-ignored" not in events
    assert engine.needs_weights  # asleep again at level 2 until the next push
    # a rollout outside a step's push (validation) loads the policy once for all its turns
    loop.rollout(engine, RECORDS, 2, SamplingParams(40, 1.0), torch.device("cpu"))
    assert _pushes(llm) == 2


def test_a_prompt_is_measured_with_the_tools_schemas_it_is_sent_with(standin):
    """Issue 45: the filter measured chat prompts without the tools' schemas, which multi-turn renders into them, and
    vLLM's context is data.max_prompt_length + data.max_response_length: a prompt could pass the filter and then have
    its conversation cut at vLLM's max_model_len, silently. Measured with them, the filter drops it (or truncation
    cuts it with its schemas); an engine whose context it would not fit refuses in one sentence."""
    tok = _tokenizer()
    schemas = [SCHEMA]
    plain, sent = tokenize_prompts(tok, RECORDS), tokenize_prompts(tok, RECORDS, schemas)
    small = _engine(tok, max_model_len=len(plain[0]) + 40)
    loop = Conversations(tok, EveryTurnCallsATool(), ToolTurns(tok, 4), 4)
    assert loop.prompts(RECORDS, 0, "cpu").ids == sent and len(sent[0]) > len(plain[0])
    limit = max(map(len, plain))
    assert filter_long_prompts(tok, RECORDS, limit) == (RECORDS, 0)
    assert filter_long_prompts(tok, RECORDS, limit, schemas) == ([], 2)
    cut, count = truncate_long_prompts(tok, RECORDS, limit, "left", "train", schemas)
    assert count == 2 and [len(r.token_ids) for r in cut] == [limit, limit]

    with pytest.raises(UserError, match=f"has {len(sent[0])} tokens.*rollout.vllm_max_model_len to at least "
                                        f"{len(sent[0]) + 40}") as err:
        loop.rollout(small, RECORDS, 2, SamplingParams(40, 1.0), torch.device("cpu"))
    assert "\n" not in str(err.value)
    loop.rollout(_engine(tok, max_model_len=len(sent[0]) + 40), RECORDS, 2, SamplingParams(40, 1.0),
                 torch.device("cpu"))


@pytest.mark.parametrize("filtered", [True, False])
def test_the_runs_data_filter_measures_prompts_with_the_tools_schemas(tmp_path, filtered):
    """The run's own prompt filter (train/build.py) renders a multi-turn run's chat prompts with the tool file's
    schemas, so a prompt that fits only without them is dropped (or cut with them) before any rollout."""
    import yaml

    from portagrpo.config import load_config
    from portagrpo.train.build import _fit_prompts

    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "calculator", "tool_schema": SCHEMA}]}))
    tok = _tokenizer()
    limit = max(map(len, tokenize_prompts(tok, RECORDS)))
    cfg = load_config(None, ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}",
                             f"data.max_prompt_length={limit}", f"data.filter_overlong_prompts={str(filtered).lower()}",
                             "data.truncation=left"], check_files=False)
    seen = []
    train, val = _fit_prompts(cfg, tok, RECORDS, RECORDS[:1], seen.append)
    if filtered:
        assert train == [] and val == [] and seen and seen[0].startswith("dropped 2 train and 1 val prompts")
    else:
        assert [len(r.token_ids) for r in train] == [limit, limit]
        assert train[0].token_ids == tokenize_prompts(tok, RECORDS, [SCHEMA])[0][-limit:]
