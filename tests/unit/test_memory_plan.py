"""`portagrpo plan` (plan/memory.py, tools/plan.py): every GPU and NPU recipe fits its stated cluster, the shipped
model shapes count what the models have, verl's 32B FSDP command plans to fit on 2 x 8 x 80 GB with its offload keys
honoured, and the largest dense model one 8 x 80 GB node admits with the 7B recipe's batch shapes is at least 32B
with offload. The plan's agreement with measured peaks is tests/emulated/test_memory_plan_measured.py."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.config import load_config
from portagrpo.errors import UserError
from portagrpo.plan.gate import plan_config, refusal
from portagrpo.plan.memory import GIB, Cluster, plan

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.stem.rsplit("-", 1)[-1] in ("cuda", "rocm", "npu"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_fits_its_stated_cluster(recipe):
    cfg = load_config(recipe, check_files=False)
    assert cfg.trainer.device_memory_gb, f"{recipe.name} states no trainer.device_memory_gb"
    p, source = plan_config(cfg)
    assert p.fits, (recipe.name, p.peak.name, p.peak.total / GIB)
    assert "shipped shape" in source or "config.json" in source


def test_the_scale_recipes_exist_and_plan_as_described():
    for name, world, offload in (("qwen2.5-32b-gsm8k-cuda", 16, False), ("qwen2.5-32b-gsm8k-npu", 16, False),
                                 ("qwen2.5-72b-gsm8k-cuda", 32, True)):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", check_files=False)
        p, _ = plan_config(cfg)
        assert p.cluster.world == world and p.run.offload == offload and p.run.ref_offload
        assert p.fits


@pytest.mark.parametrize("name,billions,active", [("Qwen2.5-0.5B-Instruct", 0.494, None),
                                                  ("Qwen2.5-7B-Instruct", 7.62, None),
                                                  ("Qwen2.5-32B-Instruct", 32.76, None),
                                                  ("Qwen2.5-72B-Instruct", 72.71, None),
                                                  ("Qwen2.5-VL-7B-Instruct", 8.29, None),
                                                  ("Qwen3-30B-A3B", 30.53, 3.35)])
def test_shipped_shapes_count_the_published_sizes(name, billions, active):
    cfg = load_config(None, [f"model.path=/nowhere/{name}", "trainer.device_memory_gb=80"], check_files=False)
    p, source = plan_config(cfg)
    assert "shipped shape" in source
    assert p.model.params / 1e9 == pytest.approx(billions, rel=0.01)
    if active:
        assert p.model.is_moe and p.model.active_params / 1e9 == pytest.approx(active, rel=0.03)
    if "VL" in name:
        assert p.model.vision_params / 1e9 == pytest.approx(0.67, rel=0.02)


VERL_32B = [  # verl's 32B FSDP GRPO command line, its keys with paths and sizes as given
    "algorithm.adv_estimator=grpo", "data.train_files=data/gsm8k/train.parquet",
    "data.val_files=data/gsm8k/test.parquet", "data.train_batch_size=1024", "data.max_prompt_length=512",
    "data.max_response_length=1024", "actor_rollout_ref.model.path=/models/Qwen2.5-32B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=2", "trainer.total_epochs=15",
]


def test_verls_32b_command_translates_honours_offload_and_fits_two_nodes():
    notices: list[str] = []
    cfg = load_config(None, [*VERL_32B, "trainer.device=cuda"], check_files=False, notices=notices)
    assert cfg.actor.ref_offload and not cfg.actor.offload
    assert not any("no effect" in n and "offload" in n for n in notices)
    cluster = Cluster(nodes=2, devices_per_node=8, device_memory_gb=80, host_memory_gb=2048, usable_fraction=0.99)
    cfg = replace(cfg, trainer=replace(cfg.trainer, device_memory_gb=80.0, host_memory_gb=2048.0))
    p, _ = plan_config(cfg)
    assert p.cluster == cluster and p.run.strategy == "fsdp2" and p.run.shard_group == 16
    assert p.fits, (p.peak.name, p.peak.total / GIB)
    on_one_node = plan(p.model, replace(cluster, nodes=1), replace(p.run, shard_group=8))
    assert p.peak.total < on_one_node.peak.total  # the states shard over 16 ranks, not 8


def test_one_node_admits_32b_with_offload_and_says_what_admits_72b():
    """The 7B recipe's batch shapes on one 8 x 80 GB node: the largest shipped dense model whose plan fits (32B with
    vLLM at its recipe's tensor-parallel size 4, so that its weights fit vLLM's share: they are 61 GiB at size 1;
    72B at size 1 holds 145 GiB of weights a device)."""
    base = load_config(ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml", check_files=False)
    fits = {}
    for name, tp in (("Qwen2.5-7B-Instruct", 1), ("Qwen2.5-32B-Instruct", 4), ("Qwen2.5-72B-Instruct", 1)):
        for offload in (False, True):
            cfg = replace(base, model=replace(base.model, path=f"/models/{name}"),
                          actor=replace(base.actor, offload=offload, ref_offload=offload),
                          rollout=replace(base.rollout, tensor_model_parallel_size=tp))
            fits[(name, offload)] = plan_config(cfg)[0].fits
    assert fits[("Qwen2.5-7B-Instruct", False)] and fits[("Qwen2.5-32B-Instruct", True)]
    assert not fits[("Qwen2.5-32B-Instruct", False)]  # without offload 32B needs two nodes (the 32B recipe)
    assert not fits[("Qwen2.5-72B-Instruct", True)]  # vLLM alone at size 1 cannot hold 72B
    wide = load_config(ROOT / "configs" / "qwen2.5-72b-gsm8k-cuda.yaml", check_files=False)
    assert plan_config(wide)[0].fits  # four nodes with offload do (docs/memory.md)


def test_a_plan_that_does_not_fit_names_the_settings_that_would(tmp_path, capsys):
    recipe = ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml"
    out = tmp_path / "plan.json"
    rc = main(["plan", "--config", str(recipe), "--json", str(out), "model.gradient_checkpointing=false",
               "actor.micro_batch_size=32"])
    text = capsys.readouterr().out
    assert rc == 1 and "does NOT fit" in text and "would fit with: model.gradient_checkpointing=true" in text
    data = json.loads(out.read_text())
    assert data["fits"] is False and data["peak_phase"] == "update"
    assert set(data["phases"]) == {"load", "push", "rollout", "scoring", "update", "checkpoint"}
    assert data["phases"]["update"]["peak_gib"] > 80


def test_cluster_flags_override_the_config_and_dry_run_shows_the_plan(capsys):
    recipe = ROOT / "configs" / "qwen2.5-7b-gsm8k-npu.yaml"
    assert main(["plan", "--config", str(recipe), "--nodes", "2", "--device-memory-gb", "32"]) in (0, 1)
    assert "2 node(s) x 8 device(s) of 32 GiB" in capsys.readouterr().out
    assert main(["train", "--config", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: Qwen2.5-7B-Instruct" in out and "fits: peak" in out
    assert main(["train", "--config", str(recipe), "--dry-run", "actor.micro_batch_size=64",
                 "model.gradient_checkpointing=false"]) == 2
    err = capsys.readouterr().err
    assert "the memory plan does not fit (peak" in err and "trainer.device_memory_gb=64" in err


def test_a_run_whose_plan_does_not_fit_stops_before_any_rank_starts(tmp_path, capsys):
    rc = main(["train", "--output-dir", str(tmp_path / "run"), "trainer.device=cpu", "trainer.nproc_per_node=2",
               "trainer.device_memory_gb=0.001", "trainer.total_steps=1"])
    assert rc == 2 and "the memory plan does not fit" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_an_moe_model_that_only_expert_parallelism_would_fit_is_told_so():
    """Qwen3-30B-A3B in fp32 with the hf engine on 8 x 100 GiB: FSDP2 gathers the whole model to sample (173 GiB),
    offloaded or not; under trainer.parallel=ep every rank keeps its 16 of each layer's 128 experts (78 GiB)."""
    cfg = load_config(None, ["model.path=/models/Qwen3-30B-A3B", "trainer.device_memory_gb=100",
                             "trainer.nproc_per_node=8", "trainer.device=cuda", "trainer.parallel=fsdp2"],
                      check_files=False)
    p, _ = plan_config(cfg)
    assert not p.fits and p.model.experts == 128
    assert [line for line in p.advice if line.startswith("trainer.parallel=ep (peak ")], p.advice
    ep, _ = plan_config(replace(cfg, trainer=replace(cfg.trainer, parallel="ep")))
    assert ep.fits and ep.run.ep == 8 and ep.model.expert_params > 0.9 * ep.model.params
    fsdp2_rollout = next(ph for ph in p.phases if ph.name == "rollout").total
    ep_rollout = next(ph for ph in ep.phases if ph.name == "rollout").total
    # the hf engine gathers every unit but the experts, which stay 1/8 on each rank
    gathered = p.run.compute_bytes * ep.model.expert_params * (1 - 1 / 8)
    assert fsdp2_rollout - ep_rollout == pytest.approx(gathered, rel=0.02)


def test_a_model_whose_weights_outgrow_vllm_on_a_node_is_refused_in_one_sentence():
    """DeepSeek-V3 (671B) with vLLM at tensor-parallel 8: 156 GiB of bf16 weights a device, whatever the ranks. The
    sentence names vLLM's expert parallelism over every rank, which the plan checked: with it the weights are 14 GiB a
    device (the routed experts over 128 ranks, the rest over the tensor group) and the run fits. Where the experts do
    not divide over the ranks (96) it is not offered. A share too small for the weights (vLLM would stop at start) is
    said with the share that holds them."""
    common = ["model.path=/models/DeepSeek-V3", "trainer.device_memory_gb=80", "trainer.devices_per_node=8",
              "trainer.nproc_per_node=8", "trainer.device=cuda", "trainer.parallel=ep", "rollout.engine=vllm",
              "rollout.tensor_model_parallel_size=8", "model.dtype=bf16", "actor.offload=true",
              "data.train_batch_size=384", "actor.ppo_mini_batch_size=384", "actor.router_replay=R2"]
    p, _ = plan_config(load_config(None, [*common, "trainer.nnodes=16"], check_files=False))
    assert not p.fits and p.model.experts == 256
    sentence = refusal(p)
    assert "vLLM's weights, 156 GiB a device" in sentence and sentence.count(". ") == 0
    assert p.advice[0].startswith("rollout.expert_parallel_size=128 rollout.data_parallel_size=16 (vLLM's expert "
                                  "parallelism: its weights 14 GiB a device"), p.advice
    split, _ = plan_config(load_config(None, [*common, "trainer.nnodes=16", "rollout.expert_parallel_size=128",
                                              "rollout.data_parallel_size=16"], check_files=False))
    assert split.fits and split.vllm_weights < p.vllm_weights / 11
    # the push holds one tensor at a time, a packed expert tensor one expert at a time: the largest is the embedding,
    # not a layer's 256 x 44M experts; and of a layer held until vLLM has it whole, the experts this rank's engine keeps
    m = split.model
    assert m.largest_tensor == 129280 * 7168
    held = next(ph for ph in split.phases if ph.name == "push").items
    layer = m.unit_params - m.layer_experts + m.layer_experts / 128
    assert layer < m.largest_tensor < m.unit_params  # the embedding: the whole layer was larger
    assert held["whole tensors gathered for the push (a layer's, or the largest)"] == pytest.approx(
        m.largest_tensor * split.run.master_bytes)
    from dataclasses import replace

    from portagrpo.plan.memory import plan as plan_of

    cannot = plan_of(p.model, p.cluster, replace(p.run, vllm_ep_allowed=False))  # a row whose vLLM cannot split them
    assert not cannot.advice[0].startswith("rollout.expert_parallel_size"), cannot.advice
    odd, _ = plan_config(load_config(None, [*common, "trainer.nnodes=12"], check_files=False))
    assert "vLLM's weights alone are 156 GiB a device" in odd.advice[0]
    assert "vLLM's expert parallelism over more ranks" in odd.advice[0]
    q = load_config(None, ["model.path=/models/Qwen2.5-32B-Instruct", "trainer.device_memory_gb=80",
                           "trainer.nproc_per_node=8", "trainer.device=cuda", "rollout.engine=vllm",
                           "model.dtype=bf16", "rollout.vllm_gpu_memory_utilization=0.5"], check_files=False)
    p, _ = plan_config(q)
    assert p.vllm_short and not p.fits  # 61 GiB of weights in a 40 GiB share
    assert p.advice[0].startswith("rollout.vllm_gpu_memory_utilization=0.87 (vLLM's weights alone are 61 GiB")


def test_what_the_plan_cannot_know_is_one_sentence(tmp_path):
    cfg = load_config(None, ["model.path=/nowhere/SomeModel-9B"], check_files=False)
    with pytest.raises(UserError, match="device-memory-gb"):
        plan_config(cfg)
    cfg = load_config(None, ["model.path=/nowhere/SomeModel-9B", "trainer.device_memory_gb=80"], check_files=False)
    with pytest.raises(UserError, match="no config.json on this machine"):
        plan_config(cfg)
    local = tmp_path / "SomeModel-9B"  # a directory with only its config.json is enough
    local.mkdir()
    shipped = json.loads((ROOT / "portagrpo" / "plan" / "model_shapes" / "Qwen2.5-0.5B-Instruct.json").read_text())
    (local / "config.json").write_text(json.dumps({k: v for k, v in shipped.items() if k != "_comment"}))
    cfg = load_config(None, [f"model.path={local}", "trainer.device_memory_gb=80"], check_files=False)
    p, source = plan_config(cfg)
    assert source.endswith("config.json") and p.model.params / 1e9 == pytest.approx(0.494, rel=0.01)


def test_dry_run_checks_the_sequence_parallel_size_against_the_models_heads(capsys):
    """Qwen2.5-7B has 28 query and 4 key/value heads: SP=4 splits them (the long-trace recipe), SP=8 cannot."""
    recipe = ROOT / "configs" / "qwen2.5-7b-longcot-cuda.yaml"
    assert main(["train", "--config", str(recipe), "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(recipe), "--dry-run", "actor.ulysses_sequence_parallel_size=8"]) == 2
    assert "must divide the model's 28 attention heads" in capsys.readouterr().err


def test_an_offloaded_run_is_not_charged_a_second_host_copy_at_checkpoint():
    """Issue 51: the sharded checkpoint of an offloaded run writes the states from host memory where they already are;
    the plan counted a staging copy on top (72B on one node: 2063 GiB against about 1.25 TiB)."""
    cfg = load_config(ROOT / "configs" / "qwen2.5-72b-gsm8k-cuda.yaml", check_files=False)
    from argparse import Namespace

    p, _ = plan_config(cfg, Namespace(nodes=1, devices_per_node=None, device_memory_gb=None, host_memory_gb=None))
    host = p.host_per_node
    assert not any("staging" in k for k in host) and 1200 < sum(host.values()) / GIB < 1300, host
    on_device = replace(p.run, offload=False)
    staged = plan(p.model, p.cluster, on_device).host_per_node
    assert any("staging" in k for k in staged)  # without offload the shards are copied to the host to be written


def test_advice_fixes_what_overflows():
    """Issue 51: a host shortfall gets host-side advice (never a device setting that cannot help it), and a run under a
    token budget is told to lower the budget, not actor.micro_batch_size."""
    from argparse import Namespace

    cfg = load_config(ROOT / "configs" / "qwen2.5-32b-gsm8k-cuda.yaml", check_files=False)
    p, _ = plan_config(cfg, Namespace(nodes=None, devices_per_node=None, device_memory_gb=None, host_memory_gb=64))
    assert p.fits_device and not p.fits_host
    assert p.advice and all("offload" in a or "host" in a or "nnodes" in a for a in p.advice), p.advice
    assert not any("micro_batch_size" in a or "gradient_checkpointing" in a for a in p.advice), p.advice
    budget = load_config(ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml",
                         ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=96000"], check_files=False)
    q, _ = plan_config(budget)
    assert not q.fits and any("actor.ppo_max_token_len_per_gpu=" in a for a in q.advice), q.advice
    assert not any("actor.micro_batch_size" in a for a in q.advice), q.advice


def test_the_capacity_is_what_torch_can_allocate_of_the_devices_nominal_memory():
    """An H100 80GB gives torch 79.2 GiB and a 64 GB 910B about 61 (issue 51): a peak between the usable and the
    nominal figure does not fit, and the plan says the usable figure."""
    from portagrpo.backends import backend_spec
    from portagrpo.tools.plan import describe

    cfg = load_config(ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml", check_files=False)
    for device, nominal, usable in (("cuda", 80, 79.2), ("npu", 64, 61.0)):
        cfg = replace(cfg, trainer=replace(cfg.trainer, device=device, device_memory_gb=float(nominal)))
        p, source = plan_config(cfg)
        assert p.cluster.capacity / GIB == pytest.approx(usable)
        assert backend_spec(device).usable_memory_fraction * nominal == pytest.approx(usable)
        between = replace(p, phases=[replace(p.phases[0], items={"x": (usable + nominal) / 2 * GIB})])
        assert not between.fits_device
        assert f"of {nominal} GiB ({usable:.1f} usable)" in "\n".join(describe(p, source))


def test_the_plan_counts_page_locked_host_memory_apart_and_pin_offload_false_unpins_it():
    """issue 51 item 4: an offloaded run's shards are pinned where the backend row says so, and the plan says how much
    of each node's host memory is page-locked; actor.pin_offload=false leaves the same bytes, none of them pinned."""
    from portagrpo.tools.plan import describe

    cfg = load_config(ROOT / "configs" / "qwen2.5-72b-gsm8k-cuda.yaml", check_files=False)
    pinned, source = plan_config(cfg)
    assert cfg.actor.offload and pinned.run.pinned_offload
    offloaded = sum(v for k, v in pinned.host_per_node.items() if k.startswith("offloaded"))
    assert pinned.pinned_per_node == pytest.approx(offloaded) and offloaded > 0
    assert "of which page-locked" in "\n".join(describe(pinned, source))
    pageable, _ = plan_config(replace(cfg, actor=replace(cfg.actor, pin_offload=False)))
    assert pageable.pinned_per_node == 0
    assert sum(pageable.host_per_node.values()) == pytest.approx(sum(pinned.host_per_node.values()))


def test_a_vision_language_run_holds_its_steps_images_from_the_rollout_to_the_push():
    """Every rank keeps the gathered global batch, whose prompts each keep their fp32 pixel values (measured on the
    emulated device: tests/emulated/test_memory_plan_measured.py, vl). Twice the prompts, twice the bytes; none in
    the load or the checkpoint, which come before and after the step's batch."""
    term = "the step's images (every prompt's pixel values)"
    cfg = load_config("configs/qwen2.5-vl-7b-geo3k-cuda.yaml", [], check_files=False)
    p, _ = plan_config(cfg)
    m, r = p.model, p.run
    assert m.vision_patch == 3 * 2 * 14 * 14  # Qwen2.5-VL's patch embedding takes 1176 values
    held = {ph.name: ph.items.get(term, 0.0) for ph in p.phases}
    expected = 4 * r.prompts * r.image_tokens * m.vision_merge * m.vision_patch
    assert {k for k, v in held.items() if v} == {"push", "rollout", "scoring", "update"}
    assert all(v in (0.0, expected) for v in held.values())
    doubled = plan(m, p.cluster, replace(r, prompts=2 * r.prompts))
    assert {ph.name: ph.items.get(term, 0.0) for ph in doubled.phases}["push"] == 2 * expected


def test_a_one_step_off_run_plans_its_engine_on_the_samplers_devices():
    """rollout.mode=one_step_off samples in a process of its own, on an accelerator a device of its own after the
    trainers' (rollout.devices): vLLM's share is planned there, and the trainers' devices only gather whole tensors
    for the push. The plan had charged vLLM to the trainers' devices, as for a sync run."""
    vllm_term = "vLLM (weights, KV cache, its activations)"
    sync = load_config("configs/qwen2.5-7b-gsm8k-cuda.yaml", [], check_files=False)
    apart = load_config("configs/qwen2.5-7b-gsm8k-cuda.yaml", ["rollout.mode=one_step_off", "rollout.devices=8"],
                        check_files=False)
    plans = {name: {ph.name: ph for ph in plan_config(cfg)[0].phases} for name, cfg in (("sync", sync),
                                                                                       ("apart", apart))}
    assert sync.rollout.engine == "vllm" and vllm_term in plans["sync"]["rollout"].items
    assert "sampler" not in plans["sync"]
    trainer = [ph for name, ph in plans["apart"].items() if name != "sampler"]
    assert not any(k.startswith("vLLM") for ph in trainer for k in ph.items)
    assert plans["apart"]["sampler"].items[vllm_term] == plans["sync"]["rollout"].items[vllm_term]
    assert plans["apart"]["rollout"].total < plans["sync"]["rollout"].total
    assert "whole tensors gathered for the push (a layer's, or the largest)" in plans["apart"]["push"].items


def test_the_head_read_by_rows_is_planned_by_the_ranks_and_gathered_whole_without():
    """actor.stream_head_rows: an untied 152,064 x 3,584 head (Qwen2.5-7B) read one rank's rows at a time holds
    head / 8 rows in its backward; gathered as an FSDP2 unit (false, or under actor.offload), its weight, all-gather
    output and gradient, whole."""
    def update(*extra):
        cfg = load_config(ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml", list(extra), check_files=False)
        p, _ = plan_config(cfg)
        return next(ph for ph in p.phases if ph.name == "update").items["FSDP2 gathered units and unsharded gradients"]

    head = 152_064 * 3_584
    gathered, by_rows = update("actor.stream_head_rows=false"), update()
    assert gathered == pytest.approx(3 * head * 2, rel=0.01)  # bf16: weight, all-gather output, gradient
    # by rows: a bf16 block with its fp32 gradient and the rank's own (0.68 GB) is less than a decoder layer's
    # backward, which then decides the term
    assert head / 8 * (2 + 8) < by_rows < gathered - 1e9
