"""The vLLM engine's own logic, with vLLM replaced by a recording stand-in (vLLM cannot be
installed on these CPU machines): parameter mapping, weight names, bucketing, the
sleep/wake cycle and the weight push after every optimizer step."""
import sys
import types
from dataclasses import replace

import pytest
import torch

from portagrpo.rollout import SamplingParams
from portagrpo.rollout_vllm import bucket_tensors, sampling_kwargs, vllm_weight_names


def test_sampling_parameter_mapping():
    kw = sampling_kwargs(SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, top_k=50), seed=3,
                         stop_token_ids=[2])
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_tokens": 12, "seed": 3,
                  "stop_token_ids": [2], "detokenize": False}
    greedy = sampling_kwargs(SamplingParams(max_tokens=4, temperature=0.0, top_p=0.5, top_k=0), seed=None,
                             stop_token_ids=[2, 7])
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["top_k"] == -1
    assert sampling_kwargs(SamplingParams(max_tokens=4, top_k=-1), seed=0, stop_token_ids=[])["top_k"] == -1


def test_weight_names():
    t = torch.zeros(1)
    state = {"lm.model.embed_tokens.weight": t, "model.layers.0.self_attn.q_proj.weight": t,
             "base_model.model.model.layers.0.self_attn.v_proj.base_layer.weight": t,
             "base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight": t, "lm_head.weight": t}
    names = [n for n, _ in vllm_weight_names(state, tied_embeddings=True)]
    assert names == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.v_proj.weight"]
    assert "lm_head.weight" in [n for n, _ in vllm_weight_names(state, tied_embeddings=False)]


def test_bucketing_respects_the_limit():
    named = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]  # fp32: 4 bytes each
    buckets = list(bucket_tensors(named, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]


class _FakeModel:
    def __init__(self, log):
        self.log = log

    def load_weights(self, weights):
        self.log.append(("load", [(n, t.clone()) for n, t in weights]))


class _FakeLLM:
    """Records what portagrpo asks of vllm.LLM; generates digits then EOS."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.log = kwargs, []
        _FakeLLM.instances.append(self)

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake", tuple(tags) if tags else None))

    def apply_model(self, fn):
        return fn(_FakeModel(self.log))

    def generate(self, prompts, sampling, use_tqdm=False):
        self.log.append(("generate", len(prompts), sampling.kwargs))
        out = []
        for i, p in enumerate(prompts):
            n = 1 + (len(p["prompt_token_ids"]) + i) % 5
            ids = [5 + i % 10] * n + [2]
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids)]))
        return out


@pytest.fixture()
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = _FakeLLM
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(kwargs=kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    from portagrpo.backends import cpu

    monkeypatch.setattr(cpu.CPUBackend, "__init__", lambda self: cpu.BaseBackend.__init__(
        self, replace(cpu.SPEC, rollout_engines=("hf", "fixed", "vllm"))))
    _FakeLLM.instances.clear()
    return _FakeLLM


def test_trainer_drives_the_engine(tmp_path, fake_vllm):
    from portagrpo.config import load_config
    from portagrpo.trainer import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", "trainer.test_freq=0", "data.train_batch_size=4", "rollout.n=4",
                             "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.train_size=32",
                             "rollout.vllm_weight_bucket_mb=0", "rollout.temperature=0.8", "rollout.top_k=20"])
    t = Trainer(cfg, run_dir=tmp_path, log=lambda m: None).setup()
    (llm,) = fake_vllm.instances
    assert llm.kwargs["model"] == str(tmp_path / "init_model") and llm.kwargs["enable_sleep_mode"] is True
    assert llm.log == [("sleep", 1)]  # asleep until the first rollout
    metrics = t.step().metrics
    kinds = [e[0] for e in llm.log]
    # wake, generate, sleep, then after the optimizer step: wake weights only, load, sleep
    assert kinds[:4] == ["sleep", "wake", "generate", "sleep"] and llm.log[4] == ("wake", ("weights",))
    gen = next(e for e in llm.log if e[0] == "generate")
    assert gen[1] == 16 and gen[2]["temperature"] == 0.8 and gen[2]["top_k"] == 20 and gen[2]["max_tokens"] == 10
    loads = [e[1] for e in llm.log if e[0] == "load"]
    assert all(len(b) == 1 for b in loads)  # 0 MiB buckets: one tensor each
    pushed = dict(pair for b in loads for pair in b)
    state = t.policy.state_dict()
    assert "lm_head.weight" not in pushed  # tied embeddings
    for name, tensor in pushed.items():
        assert torch.equal(tensor, state[name]), name  # the weights after the update
    assert kinds[-1] == "sleep" and metrics["response_len_mean"] > 1
    t.step()
    assert sum(1 for e in llm.log if e[0] == "generate") == 2


def test_missing_vllm_is_one_sentence(tmp_path, monkeypatch):
    from portagrpo.rollout_vllm import VLLMRollout

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(Exception, match="rollout.engine=vllm needs vLLM, which is not installed"):
        VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="x")


def test_cpu_refuses_vllm(capsys):
    from portagrpo.cli import main

    assert main(["train", "--device", "cpu", "rollout.engine=vllm"]) == 2
    assert "rollout.engine='vllm' does not run on --device cpu" in capsys.readouterr().err
