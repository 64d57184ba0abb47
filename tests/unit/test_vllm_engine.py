"""The vLLM engine's own logic, with vLLM replaced by a recording stand-in (vLLM cannot be
installed on these CPU machines): parameter mapping, weight names, bucketing, the
sleep/wake cycle and the weight push after every optimizer step."""
import math
import re
import sys
import types
from dataclasses import replace

import pytest
import torch

from portagrpo.rollout.engines import SamplingParams
from portagrpo.rollout.vllm import bucket_tensors, sampling_kwargs, vllm_weight_names


def test_sampling_parameter_mapping():
    kw = sampling_kwargs(SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05,
                                        repetition_penalty=1.2), seed=3, stop_token_ids=[2])
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.2,
                  "max_tokens": 12, "seed": 3, "stop_token_ids": [2], "detokenize": False,
                  "logprobs": 0}
    # off means off: every knob is explicit, so vLLM takes nothing from the model's generation_config
    off = sampling_kwargs(SamplingParams(max_tokens=4), seed=0, stop_token_ids=[2])
    assert off["top_k"] == 0 and off["min_p"] == 0.0 and off["repetition_penalty"] == 1.0 and off["top_p"] == 1.0
    greedy = sampling_kwargs(SamplingParams(max_tokens=4, temperature=0.0, top_p=0.5, top_k=0), seed=None,
                             stop_token_ids=[2, 7])
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["top_k"] == 0
    assert sampling_kwargs(SamplingParams(max_tokens=4, top_k=-1), seed=0, stop_token_ids=[])["top_k"] == 0


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
    def __init__(self, llm):
        self.llm = llm

    def load_weights(self, weights):
        if "weights" in self.llm.asleep:  # weights offloaded: loading into unmapped memory would fault
            raise RuntimeError("load_weights while the weights pool is asleep")
        self.llm.log.append(("load", [(n, t.clone()) for n, t in weights]))


class _FakeLLM:
    """A stand-in for vllm.LLM (V1) that models what decides correctness, as vLLM's source defines it:

    - sleep mode (vllm/v1/executor/abstract.py + device_allocator/cumem.py): `sleep` while any pool is
      still asleep is ignored ("Executor is already sleeping"); `wake_up(tags)` remaps exactly those pools,
      and a tag-less `wake_up()` remaps every pool, so waking a pool that is mapped faults;
    - sampling: each request's generator is seeded from its own SamplingParams.seed (same seed, same
      prompt -> same tokens); seed=None draws from the engine's generator seeded by LLM(seed=);
    - V1 multiprocessing (the default) keeps the model in another process: `apply_model` with a closure
      fails in msgpack, and the model runner is reachable only with VLLM_ENABLE_V1_MULTIPROCESSING=0;
    - placement: the uni executor uses device 0; external_launcher uses the launcher's LOCAL_RANK;
    - vllm-ascend (when `ascend` names its version): `wake_up` raises ValueError while the FRACTAL_NZ
      weight format is on. 0.11.0 (worker_v1.py: `is_enable_nz()`, utils.py) reads VLLM_ASCEND_ENABLE_NZ
      (int, default 1) once when the worker is built; 0.20+ (worker.py: `get_ascend_config().weight_nz_mode`,
      ascend_config.py) read additional_config["weight_nz_mode"] and fall back to that variable.
    """

    instances = []
    ascend: str | None = None  # the vllm-ascend version the stand-in plays, or None for plain vLLM

    def __init__(self, **kwargs):
        import os

        self.kwargs, self.log = kwargs, []
        self.asleep: set = set()
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        launcher = kwargs.get("distributed_executor_backend") == "external_launcher"
        self.device_index = int(os.environ.get("LOCAL_RANK", "0")) if launcher else 0
        self.rng = torch.Generator().manual_seed(kwargs.get("seed", 0))
        model = _FakeModel(self)
        runner = types.SimpleNamespace(model=types.SimpleNamespace(wrapped=model))  # a graph wrapper in vLLM
        executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=types.SimpleNamespace(
            model_runner=runner, get_model=lambda: model)))
        self.nz = None
        if _FakeLLM.ascend is not None:
            env_nz = int(os.environ.get("VLLM_ASCEND_ENABLE_NZ", 1))
            new = tuple(int(x) for x in _FakeLLM.ascend.split(".")[:2]) >= (0, 20)
            self.nz = kwargs.get("additional_config", {}).get("weight_nz_mode", env_nz) if new else env_nz
        self.llm_engine = types.SimpleNamespace() if self.multiprocessing else types.SimpleNamespace(
            model_executor=executor)
        _FakeLLM.instances.append(self)

    def sleep(self, level):
        if self.asleep:
            self.log.append(("sleep-ignored", level))
            return
        self.asleep = {"weights", "kv_cache"}
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        if self.nz:
            raise ValueError("FRACTAL_NZ mode is enabled. This may cause model parameter precision issues in the "
                             "RL scenarios. Please set VLLM_ASCEND_ENABLE_NZ=0.")
        wanted = set(tags) if tags else {"weights", "kv_cache"}
        mapped = wanted - self.asleep
        if mapped:
            raise RuntimeError(f"cuMemMap on already-mapped memory ({sorted(mapped)})")
        self.asleep -= wanted
        self.log.append(("wake", tuple(tags) if tags else None))

    def apply_model(self, fn):
        if self.multiprocessing:
            raise TypeError("Object of type function is not msgpack serializable")
        return fn(self.llm_engine.model_executor.driver_worker.worker.get_model())

    def generate(self, prompts, sampling, use_tqdm=False):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        assert len(params) == len(prompts)
        self.log.append(("generate", len(prompts), params[0].kwargs, [p.kwargs["seed"] for p in params]))
        out = []
        for p, sp in zip(prompts, params):
            seed = sp.kwargs["seed"]
            g = self.rng if seed is None else torch.Generator().manual_seed(seed + sum(p["prompt_token_ids"]))
            n = int(torch.randint(1, 6, (1,), generator=g))
            ids = torch.randint(5, 15, (n,), generator=g).tolist() + [2]
            logprobs = None
            if sp.kwargs.get("logprobs") is not None:  # the sampled token is always among the returned ones
                lp = self._logprob(sp.kwargs)
                logprobs = [{t: types.SimpleNamespace(logprob=lp, rank=1)} for t in ids]
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return out

    def _logprob(self, sampling) -> float:
        """Tokens are drawn uniformly from 11 kept ids (5..14 and EOS) of a 22-token model distribution
        (uniform over 22 before truncation): vLLM's default logprobs_mode reports the raw distribution's
        log-prob, "processed_logprobs" the one the token was drawn from (vllm/v1/sample/sampler.py)."""
        processed = self.kwargs.get("logprobs_mode", "raw_logprobs") == "processed_logprobs"
        return -math.log(11) if processed else -math.log(22)


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
    monkeypatch.setattr(_FakeLLM, "ascend", None)
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    return _FakeLLM


def _trainer(tmp_path, *extra):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", "trainer.test_freq=0", "data.train_batch_size=4", "rollout.n=4",
                             "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.train_size=32",
                             "rollout.vllm_weight_bucket_mb=0", "rollout.temperature=0.8", "rollout.top_k=20", *extra])
    return Trainer(cfg, run_dir=tmp_path, log=lambda m: None).setup()


def test_trainer_drives_the_engine(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    t = _trainer(tmp_path)
    (llm,) = fake_vllm.instances
    assert llm.kwargs["model"] == str(tmp_path / "init_model") and llm.kwargs["enable_sleep_mode"] is True
    assert not llm.multiprocessing  # the engine core runs in-process, so weights can be loaded directly
    assert llm.kwargs["max_model_len"] == t.cfg.data.max_prompt_length + t.cfg.data.max_response_length
    assert llm.log == [("sleep", 1)]  # asleep until the first rollout
    metrics = t.step().metrics
    kinds = [e[0] for e in llm.log]
    # wake everything, generate, sleep; after the optimizer step the weights pool alone wakes and is loaded
    assert kinds[:4] == ["sleep", "wake", "generate", "sleep"] and llm.log[4] == ("wake", ("weights",))
    assert "sleep-ignored" not in kinds
    gen = next(e for e in llm.log if e[0] == "generate")
    assert gen[1] == 16 and gen[2]["temperature"] == 0.8 and gen[2]["top_k"] == 20 and gen[2]["max_tokens"] == 10
    assert len(set(gen[3])) == 16  # one seed per request
    loads = [e[1] for e in llm.log if e[0] == "load"]
    assert all(len(b) == 1 for b in loads)  # 0 MiB buckets: one tensor each
    pushed = dict(pair for b in loads for pair in b)
    state = t.models.policy.state_dict()
    assert "lm_head.weight" not in pushed  # tied embeddings
    for name, tensor in pushed.items():
        assert torch.equal(tensor, state[name]), name  # the weights after the update
    assert llm.asleep == {"kv_cache"} and metrics["response_len_mean"] > 1
    t.step()  # the next rollout wakes only the KV cache (a tag-less wake would remap the weights and fault)
    assert [e for e in llm.log if e[0] == "wake"][2] == ("wake", ("kv_cache",))
    assert sum(1 for e in llm.log if e[0] == "generate") == 2


def test_samples_of_a_group_differ(tmp_path, fake_vllm):
    """The trainer repeats each prompt n times; with one seed for all requests vLLM returns n identical
    samples and GRPO sees zero advantage. Each request now carries its own seed."""
    t = _trainer(tmp_path)
    rb = t.experience.rollout(t.parts.data.loader.next_batch(), 4, SamplingParams(8, 0.8), uid_base=0)
    groups = rb.responses.view(4, 4, -1)
    for g in groups:
        assert len({tuple(r.tolist()) for r in g}) > 1


def test_sampler_logprobs_are_the_processed_ones_vllm_drew_with(tmp_path, fake_vllm):
    """The engine asks each request for the sampled token's log-prob and the engine for
    logprobs_mode=processed_logprobs (the distribution after truncation); the stand-in returns the raw
    one otherwise, so a missing mode would show here as log(1/22) instead of log(1/11)."""
    t = _trainer(tmp_path)
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    rb = t.experience.rollout(t.parts.data.loader.next_batch(), 4, SamplingParams(8, 0.8), uid_base=0)
    mask = rb.response_mask.bool()
    assert torch.allclose(rb.rollout_logp[mask], torch.full_like(rb.rollout_logp[mask], -math.log(11)))
    assert torch.all(rb.rollout_logp[~mask] == 0)
    metrics = t.step().metrics  # and the step measures the sampler against the trainer
    assert metrics["rollout_corr/abs_logp_diff_mean"] > 0


def test_engine_lands_on_the_ranks_device(tmp_path, fake_vllm, monkeypatch):
    from portagrpo.rollout.vllm import VLLMRollout

    monkeypatch.setenv("LOCAL_RANK", "1")
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    VLLMRollout(None, tok, None, model_path="m", world_size=2)
    VLLMRollout(None, tok, None, model_path="m", world_size=1)
    assert [llm.device_index for llm in fake_vllm.instances] == [1, 0]


def test_waking_empties_the_training_cache_first(fake_vllm):
    from portagrpo.rollout.vllm import VLLMRollout

    events = []
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = VLLMRollout(None, tok, None, model_path="m", empty_cache=lambda: events.append("empty"))
    real_wake = engine.llm.wake_up
    engine.llm.wake_up = lambda tags=None: (events.append(("wake", tuple(tags))), real_wake(tags))
    engine.update_weights({"model.embed_tokens.weight": torch.zeros(2)})
    assert events == ["empty", ("wake", ("weights",))]


def test_missing_vllm_is_one_sentence(tmp_path, monkeypatch):
    from portagrpo.rollout.vllm import VLLMRollout

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(Exception, match="rollout.engine=vllm needs vLLM, which is not installed"):
        VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="x")


def test_cpu_refuses_vllm(capsys):
    from portagrpo.cli import main

    assert main(["train", "--device", "cpu", "rollout.engine=vllm"]) == 2
    assert "rollout.engine='vllm' does not run on --device cpu" in capsys.readouterr().err


def test_weight_push_holds_one_bucket_of_gathered_weights_at_a_time(fake_vllm):
    """The push consumes a stream that gathers one tensor when asked (FSDP2's `full_tensors`): each
    bucket is loaded and dropped before the next is gathered."""
    import gc
    import weakref

    from portagrpo.rollout.vllm import VLLMRollout

    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = VLLMRollout(None, tok, None, model_path="m", bucket_mb=1)  # 1 MiB buckets
    alive: list[weakref.ref] = []
    most_alive = []

    def gathered():
        for i in range(6):
            gc.collect()
            most_alive.append(sum(r() is not None for r in alive))
            t = torch.zeros(2**17)  # 0.5 MiB: two per bucket
            alive.append(weakref.ref(t))
            yield f"model.layers.{i}.mlp.weight", t

    engine.llm.log.clear()
    assert engine.update_weights(gathered()) == 3
    loaded = [n for kind, bucket in engine.llm.log if kind == "load" for n, _ in bucket]  # the stand-in keeps clones
    assert loaded == [f"model.layers.{i}.mlp.weight" for i in range(6)]
    # When a tensor is gathered at most one bucket is alive (the bucket is closed by the tensor that does
    # not fit, so that one bucket plus it is the peak), never the whole model (6 tensors).
    assert max(most_alive) == 2


def _installed(versions):
    return lambda dist: versions.get(dist)


@pytest.mark.parametrize("ascend", ["0.11.0", "0.23.0"])
def test_vllm_ascend_wakes_because_nz_is_turned_off_its_way(fake_vllm, monkeypatch, ascend):
    import portagrpo.rollout.vllm as engine_mod

    monkeypatch.setattr(fake_vllm, "ascend", ascend)
    monkeypatch.setattr(engine_mod, "_installed", _installed({"vllm": ascend, "vllm-ascend": ascend}))
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = engine_mod.VLLMRollout(None, tok, None, model_path="m", plugin="vllm-ascend")
    engine.update_weights({"model.embed_tokens.weight": torch.zeros(2)})  # wakes the weights pool
    assert ("wake", ("weights",)) in engine.llm.log
    # without the plugin's settings the same stand-in refuses, as vllm-ascend does
    monkeypatch.setattr(engine_mod, "PLUGIN_SETTINGS", {"vllm-ascend": (engine_mod.SUPPORTED_VLLM_ASCEND,
                                                                        lambda version: ({}, {}))})
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    bare = engine_mod.VLLMRollout(None, tok, None, model_path="m", plugin="vllm-ascend")
    with pytest.raises(ValueError, match="FRACTAL_NZ mode is enabled"):
        bare.update_weights({"model.embed_tokens.weight": torch.zeros(2)})


@pytest.mark.parametrize("versions,plugin,expected", [
    ({"vllm": "0.10.2"}, None, "vLLM 0.10.2 is installed; portagrpo supports vLLM >=0.11,<0.34"),
    ({"vllm": "0.34.0"}, None, "vLLM 0.34.0 is installed"),
    ({"vllm": "0.11.0"}, "vllm-ascend", "runs through vllm-ascend, which is not installed"),
    ({"vllm": "0.11.0", "vllm-ascend": "0.9.1"}, "vllm-ascend", "vllm-ascend 0.9.1 is installed"),
])
def test_unsupported_vllm_versions_are_one_sentence(fake_vllm, monkeypatch, versions, plugin, expected):
    import portagrpo.rollout.vllm as engine_mod
    from portagrpo.errors import UserError

    monkeypatch.setattr(engine_mod, "_installed", _installed(versions))
    with pytest.raises(UserError, match=re.escape(expected)):
        engine_mod.VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="m",
                               plugin=plugin)
    assert not fake_vllm.instances  # refused before an engine was built


def test_supported_versions_pass(fake_vllm, monkeypatch):
    import portagrpo.rollout.vllm as engine_mod

    for version in ("0.11.0", "0.22.1rc1+rocm714", "0.33.0+rocm100"):
        monkeypatch.setattr(engine_mod, "_installed", _installed({"vllm": version}))
        engine_mod.VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="m")
    assert len(fake_vllm.instances) == 3
