"""Multi-turn rollouts: the conversation loop (scripted engine, real tools in the sandbox), and the loss that trains
only the model's own tokens (exact: zero gradient on tool tokens, equal to the hand-masked loss)."""
import contextlib
import json

import pytest
import torch

from portagrpo.agent.hermes import ToolTurns
from portagrpo.agent.sandbox import Limits
from portagrpo.agent.toolbox import Toolbox
from portagrpo.algo.losses import loss_normalizers
from portagrpo.algo.objective import Objective, Shaping, shape_and_advantage, total_loss
from portagrpo.batch import RolloutBatch
from portagrpo.config import load_config
from portagrpo.data.records import PromptRecord
from portagrpo.model.loading import build_char_tokenizer
from portagrpo.rollout.engines import Sampled
from portagrpo.rollout.generators.conversation import Conversations, tool_counts
from portagrpo.rollout.settings import SamplingParams
from portagrpo.train.experience import ExperienceMaker, ExperienceSettings

TOK = build_char_tokenizer()
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


class ScriptedEngine:
    """Replies by prompt: reply k after the k-th tool turn (the char template writes tool turns as "t:")."""

    holds_weights = False
    max_model_len = None

    def __init__(self, scripts: dict[str, list[str]]) -> None:
        self.scripts, self.pad_id, self.eos_ids = scripts, TOK.pad_token_id, [TOK.eos_token_id]
        self.calls = []

    def turns(self):
        return contextlib.nullcontext()

    def generate(self, prompt_ids, prompt_mask, params: SamplingParams) -> Sampled:
        rows, masks, logps = [], [], []
        self.calls.append(prompt_ids.shape[0])
        for ids, m in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            context = TOK.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True)
            prompt = next(p for p in self.scripts if context.startswith(p))
            reply = self.scripts[prompt][context.count("\nt:")]
            tokens = (TOK(reply, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id])[:params.max_tokens]
            pad = params.max_tokens - len(tokens)
            rows.append(tokens + [self.pad_id] * pad)
            masks.append([1.0] * len(tokens) + [0.0] * pad)
            logps.append([-0.5] * len(tokens) + [0.0] * pad)
        return Sampled(torch.tensor(rows), torch.tensor(masks), torch.tensor(logps))


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    schema = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    path.write_text(json.dumps({"tools": [{"class_name": "calculator", "tool_schema": schema}]}))
    box = Toolbox.from_file(str(path), Limits(timeout_s=5.0), workers=1)
    yield box
    box.close()


def _rollout(toolbox, scripts, max_tokens=200, max_turns=4):
    engine = ScriptedEngine(scripts)
    records = [PromptRecord(i, p, "0", "x") for i, p in enumerate(scripts)]
    loop = Conversations(TOK, toolbox, ToolTurns(TOK, 32), max_turns)
    made = loop.rollout(engine, records, 1, SamplingParams(max_tokens), torch.device("cpu"))
    return made.rollout, tool_counts(made.counts), engine


def test_turns_alternate_and_only_model_tokens_are_marked(toolbox):
    scripts = {"q1 ": [CALC % "12345*6789", "#### 83810205"],  # one tool turn, then an answer
               "q2 ": ["#### 7"],  # answers at once
               "q3 ": [CALC % "1+1"] * 9}  # calls tools until max_assistant_turns
    rb, counts, engine = _rollout(toolbox, scripts, max_turns=3)
    assert engine.calls == [3, 2, 1]  # each turn batched over the samples still going
    assert counts.calls == 1 + 2 and counts.errors == 0
    n_tok = [r for _, r in rb.host_lengths()]
    first = len(TOK(CALC % "12345*6789")["input_ids"]) + 1  # the model's turn, with its end token
    tool = TOK("\nt:83810205\na:", add_special_tokens=False)["input_ids"]
    answer = len(TOK("#### 83810205")["input_ids"]) + 1
    assert n_tok[0] == first + len(tool) + answer
    row = rb.responses[0].tolist()
    assert row[first:first + len(tool)] == tool  # the tool turn, appended as ids
    expected = [1.0] * first + [0.0] * len(tool) + [1.0] * answer
    assert rb.model_mask[0, :n_tok[0]].tolist() == expected and rb.model_mask[0, n_tok[0]:].sum() == 0
    assert rb.response_mask[0].sum() == n_tok[0]  # every token after the prompt is context
    assert torch.equal(rb.rollout_logp[0] != 0, rb.model_mask[0].bool())  # sampler log-probs: model tokens only
    assert rb.model_mask[1].sum() == n_tok[1] == len(TOK("#### 7")["input_ids"]) + 1
    assert rb.model_mask[2].diff(prepend=torch.zeros(1)).clamp(min=0).sum() == 3  # three model turns
    assert "83810205" in rb.response_text[0]


def test_the_length_budget_counts_every_token_after_the_prompt(toolbox):
    rb, counts, _ = _rollout(toolbox, {"q ": [CALC % "2*3"] * 9}, max_tokens=120, max_turns=9)
    assert rb.responses.shape[1] == 120 and rb.host_lengths()[0][1] == 120
    assert counts.calls >= 1


# ---------------------------------------------------------------- the loss trains model tokens only

def _two_turn_batch(dtype=torch.float64):
    """Two groups of two; row 0: model 3, tool 4, model 2 tokens; the others single-turn."""
    g = torch.Generator().manual_seed(0)
    b, t = 4, 10
    lengths = [9, 6, 10, 4]
    response_mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).float()
    model_mask = response_mask.clone()
    model_mask[0, 3:7] = 0
    model_mask[2, 5:8] = 0
    sampled = torch.where(model_mask.bool(), -torch.rand(b, t, generator=g, dtype=torch.float64), 0.0)
    rb = RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                      responses=torch.randint(3, 20, (b, t), generator=g), response_mask=response_mask,
                      uid=torch.tensor([0, 0, 1, 1]), prompt_index=torch.tensor([0, 0, 1, 1]), response_text=[],
                      ground_truth=[], data_source=[], extra_info=[], lengths=[(2, n) for n in lengths],
                      rollout_logp=sampled.float(), model_mask=model_mask)
    logits = torch.randn(b, t, 20, generator=g, dtype=dtype, requires_grad=True)
    old = (sampled + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)) * response_mask
    return rb, logits, old.to(dtype), torch.tensor([1.0, 0.0, 0.3, 0.9])


def _loss(logits, rb, adv, mask, old, spec, weights=None):
    logp = torch.log_softmax(logits, -1).gather(-1, rb.responses.unsqueeze(-1)).squeeze(-1)
    n_tok, n_seq = loss_normalizers(mask)
    return total_loss(logp, old, adv, mask, spec, num_tokens=n_tok, num_seqs=n_seq, is_weights=weights)[0]


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("correction", [[], ["algorithm.rollout_correction.rollout_rs=token_k1",
                                             "algorithm.rollout_correction.rollout_rs_threshold=0.9_1.1",
                                             "algorithm.rollout_correction.rollout_is=token"]])
def test_tool_tokens_get_no_gradient_and_the_loss_is_the_hand_masked_one(mode, correction):
    cfg = load_config(None, ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                             "actor.ppo_epochs=2", f"actor.loss_agg_mode={mode}"] + correction)
    settings = ExperienceSettings.from_config(cfg)
    spec = Objective(0.2, 0.2, 3.0, loss_agg_mode=mode, loss_scale_factor=10.0, entropy_coeff=0.0)
    rb, logits, old, scores = _two_turn_batch()
    tb, _, _ = ExperienceMaker(settings, Shaping()).train_batch(rb, scores, old, None)
    loss = _loss(logits, rb, tb.advantages, tb.mask, old, spec, tb.is_weights)
    loss.backward()
    tool = rb.response_mask.bool() & ~rb.model_mask.bool()
    assert tool.sum() == 7
    assert torch.all(logits.grad[tool] == 0)  # exactly: no tool token's logit moves
    assert torch.any(logits.grad[rb.model_mask.bool()] != 0)

    # the same tokens as a single-turn batch whose tool span is masked by hand
    hand = rb.response_mask * (1 - tool.double())
    plain = RolloutBatch(**{**rb.tensors(), "model_mask": None})
    if correction:
        from portagrpo.algo.rollout_correction import correct_rollout

        weights, hand, _ = correct_rollout(old, plain.rollout_logp, hand, settings.correction)
    else:
        weights = None
    _, adv = shape_and_advantage(scores, plain.uid, hand, Shaping(), old_logp=old)
    expected = _loss(logits.detach(), plain, adv, hand, old, spec, weights)
    assert torch.equal(tb.mask, hand.to(tb.mask.dtype))
    assert loss.detach().item() == expected.item()


def test_chat_prompts_list_the_tools(toolbox):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% if tools %}s:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
                         + tok.chat_template)
    loop = Conversations(tok, toolbox, ToolTurns(tok, 32), 2)
    chat = PromptRecord(0, [{"role": "user", "content": "2+2?"}], "4", "x")
    [ids] = loop.prompts([chat], 0, "cpu").ids
    assert tok.decode(ids) == "s:calculator;u:2+2?\na:"  # the template environment trims the block newline
    [plain] = loop.prompts([PromptRecord(1, "2+2?", "4", "x")], 0, "cpu").ids
    assert tok.decode(plain) == "2+2?"


class PairComm:
    """Two ranks in two threads: all_reduce_max through a shared slot and a barrier."""

    world_size = 2

    def __init__(self, rank, shared):
        self.rank, self.shared = rank, shared

    def all_reduce_max(self, tensor):
        barrier, slots = self.shared
        slots[self.rank] = tensor.clone()
        barrier.wait()
        out = torch.maximum(slots[0], slots[1])
        barrier.wait()
        return out


class LockstepEngine(ScriptedEngine):
    """An engine that spans ranks (as vLLM's tensor-parallel group does): every rank must be in every generate."""

    def __init__(self, scripts, barrier):
        super().__init__(scripts)
        self.barrier = barrier

    def generate(self, prompt_ids, prompt_mask, params):
        self.barrier.wait()  # a rank that stops generating early leaves the other waiting: BrokenBarrierError
        return super().generate(prompt_ids, prompt_mask, params)


class InProcessTools:
    specs = {}

    def answer(self, turns, counts=None):
        from portagrpo.agent.hermes import parse_tool_calls
        from portagrpo.agent.sandbox import ToolResult
        from portagrpo.agent.tools import calculator

        return [[ToolResult(calculator(c.arguments["expression"])) for c in parse_tool_calls(text)] or None
                for text, _ in turns]


def test_ranks_generate_each_turn_together():
    import threading

    engine_barrier = threading.Barrier(2, timeout=20)
    shared = (threading.Barrier(2, timeout=20), [None, None])
    scripts = [{"p0 ": [CALC % "1+1", CALC % "2+2", "#### 4"]}, {"p1 ": ["#### 1"]}]  # 3 turns, and 1
    out, errors = [None, None], []

    def rank(r):
        try:
            engine = LockstepEngine(scripts[r], engine_barrier)
            loop = Conversations(TOK, InProcessTools(), ToolTurns(TOK, 32), 4, lockstep=PairComm(r, shared))
            records = [PromptRecord(r, p, "0", "x") for p in scripts[r]]
            out[r] = (loop.rollout(engine, records, 1, SamplingParams(200), torch.device("cpu")).rollout,
                      engine.calls)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
            engine_barrier.abort()
            shared[0].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert out[0][1] == out[1][1] == [1, 1, 1]  # rank 1 took part in every turn, with a spare row
    assert out[1][0].model_mask[0].sum() == len(TOK("#### 1")["input_ids"]) + 1  # and kept only its own answer
    assert out[0][0].model_mask[0].diff(prepend=torch.zeros(1)).clamp(min=0).sum() == 3


# ---------------------------------------------------------------- the same exact checks on other devices

def check_on(device_name: str) -> None:
    """The zero-gradient and hand-masked-loss checks on a backend's device (run in a process of its own for the
    emulated device and the simulated Ascend: their device is process-global)."""
    from portagrpo.backends import get_backend

    dev = get_backend(device_name).device(0)
    cfg = load_config(None, ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                             "actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-sum-norm"])
    settings = ExperienceSettings.from_config(cfg)
    spec = Objective(0.2, 0.2, 3.0, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=10.0)
    rb, logits, old, scores = _two_turn_batch(torch.float32)
    rb, old, scores = rb.to(dev), old.to(dev), scores.to(dev)
    logits = logits.detach().to(dev).requires_grad_(True)
    tb, _, _ = ExperienceMaker(settings, Shaping()).train_batch(rb, scores, old, None)
    loss = _loss(logits, rb, tb.advantages, tb.mask, old, spec)
    loss.backward()
    tool = (rb.response_mask.bool() & ~rb.model_mask.bool()).cpu()
    assert torch.all(logits.grad.cpu()[tool] == 0)
    hand = rb.response_mask * (1 - tool.to(dev).float())
    plain = RolloutBatch(**{**rb.tensors(), "model_mask": None})
    _, adv = shape_and_advantage(scores, plain.uid, hand, Shaping(), old_logp=old)
    assert loss.detach().cpu().item() == _loss(logits.detach(), plain, adv, hand, old, spec).cpu().item()


@pytest.mark.parametrize("device_name", ["cpu", "emu", "npu"])
def test_the_mask_checks_hold_on_every_backend(device_name, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    if device_name == "cpu":
        check_on("cpu")
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device_name == "npu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "emulated"))
        from npu_sim_env import npu_sim_env

        env = npu_sim_env(tmp_path)
    res = subprocess.run([sys.executable, __file__, device_name], env=env, capture_output=True, text=True,
                         timeout=600)
    if res.returncode == 3:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]


if __name__ == "__main__":
    import sys

    import torch.utils.backend_registration as _registration

    if not hasattr(_registration, "_setup_privateuseone_for_python_backend"):
        print(f"torch {torch.__version__} has no Python device API, which the emulated devices need")
        sys.exit(3)
    check_on(sys.argv[1])
    print(f"{sys.argv[1]}: ok")
