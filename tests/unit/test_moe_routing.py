"""Mixture-of-experts routing (model/moe.py, model/router_replay.py, rollout/vllm_routes.py): the tiny MoE families,
recording and replaying routes, the router's gradient under replay (with gradient checkpointing too), the routes the
hf engine records in `generate`, routing handed to the forward as data, and the refusals."""
import pytest
import torch

from portagrpo.config import LoraSettings, ModelConfig, TinyModelConfig
from portagrpo.errors import UserError
from portagrpo.model import moe
from portagrpo.model import router_replay as rr
from portagrpo.model.loading import ModelLoadError, apply_lora, build_char_tokenizer, build_tiny_model
from portagrpo.rollout.vllm_routes import routes_from_engine

TOK = build_char_tokenizer()
# DeepSeek-V3's tiny model needs transformers 5 (its 4.x router returns the experts and weights alone)
TRANSFORMERS_5 = int(__import__("transformers").__version__.split(".")[0]) >= 5
FAMILIES = ["qwen3_moe", "qwen2_moe", *(["deepseek_v3"] if TRANSFORMERS_5 else [])]


def tiny(family: str, seed: int = 0, dtype=torch.float32):
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig(moe=family)), TOK, seed).eval().to(dtype)
    moe.fit_experts_to_dtype(model)
    return model


def recorded(model, ids, valid=None):
    valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid
    hooks = rr.RouterHooks.install(model)
    try:
        with hooks.forward(None, valid, int(valid.sum()), record=True) as fwd:
            logits = model(input_ids=ids).logits
    finally:
        hooks.remove()
    return logits, rr.grid_of(fwd, tuple(ids.shape))


def other_expert(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each route with its first expert swapped for one it does not hold."""
    out = routes.clone()
    first = (out[..., 0] + 1) % num_experts
    first = torch.where(first == out[..., 1], (first + 1) % num_experts, first)
    out[..., 0] = first
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_moe_counts_experts_and_active_parameters(family):
    model = tiny(family)
    shape = moe.moe_shape(model)
    layers = moe.moe_layers(model)
    sparse = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense (first_k_dense_replace)
    assert (shape.moe_layers, shape.num_experts, shape.top_k) == (sparse, 4, 2)
    experts = sum(p.numel() for layer in model.model.layers if hasattr(layer.mlp, "experts")
                  for p in layer.mlp.experts.parameters())
    assert shape.active_params == shape.total_params - experts // 2  # top-2 of 4: half the experts idle per token
    assert shape.route_bytes_per_token == sparse * 2 * 2
    assert {layer.scoring for layer in layers} == {"sigmoid" if family == "deepseek_v3" else "softmax"}
    assert all(layer.norm_topk_prob for layer in layers)
    # the random router is not the zero one transformers starts from (every expert tied)
    assert layers[0].gate.weight.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_recorded_routes_changes_nothing_and_other_routes_do(family):
    model = tiny(family)
    ids = torch.randint(4, 60, (3, 9), generator=torch.Generator().manual_seed(1))
    logits, routes = recorded(model, ids)
    sparse = len(moe.moe_layers(model))
    assert routes.shape == (3, 9, sparse, 2) and routes.dtype == moe.ROUTE_DTYPE and (routes >= 0).all()
    hooks, valid = rr.RouterHooks.install(model), torch.ones(3, 9, dtype=torch.bool)
    with hooks.forward(routes, valid, 27, count=True) as fwd:
        again = model(input_ids=ids).logits
    # the replayed weights are the router's own (bit for bit; transformers 4.x: a masked softmax)
    assert torch.equal(again, logits) or (family != "deepseek_v3" and (again - logits).abs().max() < 1e-6)
    assert fwd.agree == fwd.total == 27 * sparse  # every (token, layer) decision agreed
    with hooks.forward(other_expert(routes, 4), valid, 27, count=True) as fwd:
        moved = model(input_ids=ids).logits
    assert (moved - logits).abs().max() > 1e-3
    assert fwd.agree == 0 and fwd.total == 27 * sparse
    # -1 (unknown) routes live
    with hooks.forward(torch.full_like(routes, -1), valid, 27):
        assert torch.equal(model(input_ids=ids).logits, logits)
    # outside a forward that was handed routing, the hooks do nothing
    assert torch.equal(model(input_ids=ids).logits, logits)


def test_replayed_weights_are_the_live_routers_and_its_gradient_flows():
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    experts = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]])
    w = rr.replayed_weights(logits, experts, renormalise=True)
    p = torch.softmax(logits, -1).gather(1, experts)
    torch.testing.assert_close(w, p / p.sum(-1, keepdim=True))
    (w[:, 0] * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    assert logits.grad.abs().sum() > 0
    torch.testing.assert_close(rr.replayed_weights(logits, experts, renormalise=False), p)
    # with the live top-k given, the replayed weights are the live router's exactly
    live = rr.live_topk(logits.detach(), 2)
    probs = torch.softmax(logits.detach(), -1, dtype=torch.float32)
    top = probs.gather(1, live)
    assert torch.equal(rr.replayed_weights(logits.detach(), live, True), (top / top.sum(-1, keepdim=True)).double())


def test_router_gradient_under_replay_matches_the_live_forward():
    model = tiny("qwen3_moe", dtype=torch.float64)
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    _, routes = recorded(model, ids)
    gate = moe.moe_layers(model)[0].gate.weight
    model(input_ids=ids).logits.square().mean().backward()
    live = gate.grad.clone()
    model.zero_grad()
    with rr.RouterHooks.install(model).forward(routes, torch.ones(2, 7, dtype=torch.bool), 14):
        model(input_ids=ids).logits.square().mean().backward()
    assert live.abs().sum() > 0
    # fp64: equal up to rounding. transformers 4.x takes the router's softmax in fp32 even in an fp64 model, and
    # replay there masks the logits (the same function of them, rounded differently): fp32 rounding
    bound = 1e-9 if moe.moe_layers(model)[0].layout == "router" else 1e-5
    assert (gate.grad - live).norm() / live.norm() < bound


def test_a_packed_forward_takes_the_routes_of_the_real_tokens():
    model = tiny("qwen3_moe")
    ids = torch.randint(4, 60, (2, 6), generator=torch.Generator().manual_seed(3))
    valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    _, routes = recorded(model, ids)
    fwd = rr.Forward(routes, valid, 10)
    packed = fwd.flat(routes, 10)
    assert torch.equal(packed, routes.flatten(0, 1)[valid.flatten()])
    with pytest.raises(RuntimeError, match="matches neither"):
        fwd.flat(routes, 7)


def test_generation_routes_are_the_samplers_own():
    """The hf engine's routes: the prompt's from the prefill, each fed-back token's from its decode step; the full
    forward over the same tokens routes the same (fp64: no near-tie flips), and the last token stays unknown."""
    from portagrpo.rollout.engines import HFRollout
    from portagrpo.rollout.settings import SamplingParams

    model = tiny("qwen3_moe", dtype=torch.float64)
    engine = HFRollout(model, TOK, autocast=lambda: torch.autocast("cpu", enabled=False))
    prompts = torch.tensor([[0, 10, 11, 12], [13, 14, 15, 16], [0, 10, 11, 12]])
    mask = (prompts != 0).long()
    out = engine.generate(prompts, mask, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=5))
    assert out.routes.shape == (3, 9, 2, 2)
    lengths = out.mask.sum(1).long().tolist()
    ids = torch.cat([prompts, out.responses], 1)
    full = torch.cat([mask, out.mask.long()], 1)
    from portagrpo.model.loading import position_ids_from_mask

    with engine.routers.forward(None, full.bool(), int(full.sum()), record=True) as fwd:
        model(input_ids=ids, attention_mask=full, position_ids=position_ids_from_mask(full))
    forward = rr.grid_of(fwd, tuple(ids.shape))
    for row, n in enumerate(lengths):
        real = [c for c in range(4) if mask[row, c]] + list(range(4, 4 + n - 1))  # every token fed back in
        assert torch.equal(out.routes[row, real], forward[row, real])
        assert (out.routes[row, 4 + n - 1:] == -1).all()


def test_refusals_are_one_sentence():
    dense = build_tiny_model(ModelConfig(), TOK, 0)
    assert "has none" in moe.refuse_replay_problem(dense, "R3")
    assert moe.refuse_replay_problem(tiny("qwen3_moe"), "R3") is None
    assert "not a router replay mode" in moe.refuse_replay_problem(tiny("qwen3_moe"), "R4")
    with pytest.raises(UserError, match="rollout.engine=hf or vllm"):
        rr.refuse_r3_engine("R3", "fixed")
    rr.refuse_r3_engine("R3", "vllm")  # vLLM returns its routes where its build can (else it refuses when built)
    rr.refuse_r3_engine("R2", "fixed")


def test_an_engines_routes_land_on_the_rollout_grid():
    """vLLM's `routed_experts` per sample, [prompt + output - 1, every decoder layer, k]: the prompt's rows on the
    columns of its real tokens (left padding here), output token j's on column P + j, the last sampled token's column
    and the rest -1; only the MoE layers' indices are read (a dense layer's rows are vLLM's zeros)."""
    import numpy as np

    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # prompts of 2 and 3 tokens, left-padded to 3
    outputs = [4, 2]  # tokens sampled (the last never fed back)
    per_sample = []
    for b, (plen, n) in enumerate(zip([2, 3], outputs)):
        rows = plen + n - 1
        a = np.zeros((rows, 3, 2), dtype=np.uint8)  # 3 decoder layers, the middle one dense
        for t in range(rows):
            a[t, 0] = (10 * b + t, 50 + t)
            a[t, 2] = (100 + t, 150 + b)
        per_sample.append(a)
    grid = routes_from_engine(per_sample, [2, 3], mask, max_tokens=5, layers=[0, 2], top_k=2)
    assert grid.shape == (2, 8, 2, 2) and grid.dtype == moe.ROUTE_DTYPE
    assert (grid[0, 0] == -1).all()  # the padding column
    assert grid[0, 1, 0].tolist() == [0, 50] and grid[0, 2, 1].tolist() == [101, 150]  # prompt tokens 0 and 1
    assert grid[0, 3, 0].tolist() == [2, 52] and grid[0, 5, 0].tolist() == [4, 54]  # outputs 0..2 fed back
    assert (grid[0, 6:] == -1).all()  # the last sampled token (output 3) and past the end
    assert grid[1, 0, 0].tolist() == [10, 50] and grid[1, 3, 1].tolist() == [103, 151] and (grid[1, 4:] == -1).all()
    other = routes_from_engine(per_sample, [2, 4], mask, max_tokens=5, layers=[0, 2], top_k=2)
    assert (other[1, :3] == -1).all()  # the engine saw another prompt length (an expanded image prompt): unknown
    with pytest.raises(ModelLoadError, match="attention only"):
        apply_lora(tiny("qwen3_moe"), LoraSettings(rank=4, target_modules=["q_proj", "gate_up_proj"]))


def test_lora_on_moe_attention_trains_only_adapters():
    pytest.importorskip("peft")
    model = apply_lora(tiny("qwen3_moe"), LoraSettings(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert moe.moe_layers(model)  # the routers are still found under peft's wrapper


def _batch(model, rows: int = 4, width: int = 6, t: int = 5):
    from portagrpo.batch import RolloutBatch

    g = torch.Generator().manual_seed(11)
    prompt_mask = torch.ones(rows, width, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask = torch.ones(rows, t)
    response_mask[1, 3:] = 0
    return RolloutBatch(prompt_ids=torch.randint(4, 60, (rows, width), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask, responses=torch.randint(4, 60, (rows, t), generator=g),
                        response_mask=response_mask, uid=torch.arange(rows), prompt_index=torch.arange(rows),
                        response_text=[], ground_truth=[], data_source=[], extra_info=[])


def test_r2_records_the_old_policys_routes_and_the_update_replays_them():
    """R2: the scoring pass (no gradient) returns the old policy's routes with its statistics, and the batch is left
    as it was; after an update moved the routers, the update's forward (with gradient), handed those routes, routes
    with them, not with the moved routers' own choices; an update without a scoring pass's routes routes live."""
    from dataclasses import replace

    from portagrpo.kernels import logprob_impl
    from portagrpo.model.scorer import ResponseScorer, response_stats

    model = tiny("qwen3_moe", dtype=torch.float64)
    moe.configure_experts(model, "R2", "eager")
    scorer = ResponseScorer(model, logprob_impl("reference"), routers=rr.RouterHooks.install(model))
    batch = _batch(model)
    stats = lambda b, routing: response_stats(scorer, b, temperature=1.0, compute_entropy=False,  # noqa: E731
                                              routing=routing)
    with torch.no_grad():
        scored = stats(batch, rr.Routing.scoring("R2"))
    assert batch.routes is None  # nothing written into the batch: the routes come back as data
    routes, counts = scored.routes, scored.route_counts
    assert routes is not None and routes.shape == (4, 11, 2, 2) and counts is None  # nothing to compare with yet
    assert (routes[0, 2:] >= 0).all()  # every real token routed (padding: whatever the forward did)
    with torch.no_grad():
        for layer in moe.moe_layers(model):
            layer.gate.weight.add_(torch.randn(layer.gate.weight.shape, generator=torch.Generator().manual_seed(3),
                                               dtype=torch.float64) * 2.0)
    with_routes = replace(batch, routes=routes)
    update = stats(with_routes, rr.Routing.update("R2", old_routes=True))
    agree, total = update.route_counts
    assert 0 < int(total) and int(agree) < int(total)  # the moved routers disagree somewhere
    with torch.no_grad():
        live = stats(with_routes, rr.Routing.update("R2", old_routes=False)).logp
        forced = stats(with_routes, rr.Routing.update("R3", old_routes=False)).logp  # replayed as R3 replays
    assert torch.equal(update.logp.detach(), forced)
    assert (live - forced).abs().max() > 1e-4 and (scored.logp - forced).abs().max() > 1e-4
    with pytest.raises(UserError, match="came without them"):
        stats(batch, rr.Routing.scoring("R3"))  # R3 needs the sampler's routes


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpointed_layer_recomputes_with_the_routes_its_forward_replayed(family):
    """Gradient checkpointing recomputes each layer in the backward, after the forward that was handed the routes has
    ended: the recomputation replays them too (`RouterHooks.checkpoint_context`), so the gradient is the one without
    checkpointing. Before, it routed live there: torch refused the backward (a different number of saved tensors), and
    the Qwen3-30B-A3B recipes (R2 with gradient checkpointing) stopped at their first off-policy update."""
    from portagrpo.model.activation_offload import checkpoint_kwargs

    model = tiny(family, dtype=torch.float64).train()
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    _, routes = recorded(model, ids)
    routes = other_expert(routes, moe.moe_layers(model)[0].num_experts)
    hooks, valid = rr.RouterHooks.install(model), torch.ones(2, 7, dtype=torch.bool)

    def grads():
        model.zero_grad()
        with hooks.forward(routes, valid, 14, count=True) as fwd:
            loss = model(input_ids=ids, use_cache=False).logits.square().mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), fwd

    plain, counted = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(False,
                                                                                        hooks.checkpoint_context))
    checkpointed, again = grads()
    assert model.is_gradient_checkpointing
    torch.testing.assert_close(checkpointed, plain, rtol=1e-9, atol=1e-12)
    sparse = len(moe.moe_layers(model))
    assert int(again.total) == int(counted.total) == 14 * sparse  # the recomputation counts nothing twice


def test_replay_under_reentrant_checkpointing_is_refused_by_the_config():
    from portagrpo.config import load_config

    with pytest.raises(UserError, match="enable_activation_offload=false"):
        load_config(None, ["actor.router_replay=R2", "model.gradient_checkpointing=true",
                           "model.enable_activation_offload=true"], check_files=False)
    load_config(None, ["actor.router_replay=R2", "model.gradient_checkpointing=true"], check_files=False)


def test_verls_router_replay_key_maps_to_actor_router_replay():
    from portagrpo.config import load_config

    key = "actor_rollout_ref.actor.router_replay.mode"
    assert load_config(None, [f"{key}=R3"]).actor.router_replay == "R3"
    assert load_config(None, [f"{key}=R2"]).actor.router_replay == "R2"
    assert load_config(None, [f"{key}=disabled"]).actor.router_replay is None
    with pytest.raises(UserError, match="actor.router_replay"):
        load_config(None, ["actor.router_replay=R4"])


@pytest.mark.parametrize("device", ["cuda", "rocm", "npu"])
def test_the_qwen3_30b_a3b_recipes_replay_routes_on_eight_ranks(device):
    """The MoE recipes (their --dry-run, memory plan included, runs with every recipe in tests/unit/test_recipes.py)."""
    from pathlib import Path

    from portagrpo.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / f"qwen3-30b-a3b-gsm8k-{device}.yaml",
                      check_files=False)
    assert cfg.model.path.endswith("Qwen3-30B-A3B") and cfg.trainer.device == device
    assert (cfg.trainer.nproc_per_node, cfg.trainer.parallel, cfg.rollout.engine) == (8, "fsdp2", "vllm")
    assert cfg.actor.router_replay == "R2" and cfg.actor.offload and cfg.actor.ref_offload
    assert cfg.trainer.device_memory_gb == (64 if device == "npu" else 80)


def test_rounds_of_different_prompt_widths_join_with_their_routes():
    """DAPO's rounds are joined left-padded to the widest prompt (RolloutBatch.cat): routes get -1 on the added
    columns, so every row's routes stay on its tokens."""
    from portagrpo.batch import RolloutBatch

    model = tiny("qwen3_moe")
    wide, narrow = _batch(model, rows=2, width=6), _batch(model, rows=2, width=4)
    wide.routes = torch.zeros(2, 11, 2, 2, dtype=moe.ROUTE_DTYPE)
    narrow.routes = torch.ones(2, 9, 2, 2, dtype=moe.ROUTE_DTYPE)
    joined = RolloutBatch.cat([wide, narrow], pad_id=0)
    assert joined.routes.shape == (4, 11, 2, 2)
    assert (joined.routes[2:, :2] == -1).all() and (joined.routes[2:, 2:] == 1).all() and (joined.routes[:2] == 0).all()


def test_r3_with_multi_turn_is_refused_by_the_config():
    from portagrpo.config import load_config

    with pytest.raises(UserError, match="multi-turn rollout does not carry"):
        load_config(None, ["actor.router_replay=R3", "rollout.multi_turn.enable=true"], check_files=False)


def test_verls_other_expert_parallel_keys_are_refused_naming_what_portagrpo_splits():
    from portagrpo.config import load_config

    with pytest.raises(UserError, match="portagrpo splits the experts by whole experts.*rollout.expert_parallel_size"):
        load_config(None, ["actor_rollout_ref.rollout.enable_expert_parallel=true"], check_files=False)


def test_verls_trainer_expert_parallel_size_is_trainer_ep_size():
    from portagrpo.config import load_config

    notices = []
    cfg = load_config(None, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"], check_files=False,
                      notices=notices)
    assert (cfg.trainer.parallel, cfg.trainer.ep_size) == ("ep", 4)
    assert any("trainer.parallel=ep trainer.ep_size=4" in n for n in notices)
    one = load_config(None, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=1"], check_files=False)
    assert (one.trainer.parallel, one.trainer.ep_size) == ("auto", -1)


def test_routes_cross_the_ranks_as_their_bytes_and_come_back_exact():
    """The global batch's routes are held on every rank; gathered as int64 they took 4x their int16 size at the step's
    peak. They travel as their bytes (uint8, which NCCL, HCCL, RCCL and gloo all take; NCCL has no int16), unknown
    cells (-1) and large expert ids included; int64 tensors travel as they are."""
    from portagrpo.train.pipeline import gather_as_bytes

    wire = []

    def two_ranks(t):  # an all-gather over two ranks whose rows are these and these plus one
        wire.append(t.dtype)
        return torch.cat([t, t + 1 if t.dtype != torch.uint8 else t])

    routes = torch.tensor([[[[3, -1]], [[127, 32000]]]], dtype=moe.ROUTE_DTYPE)  # [rows, length, layers, top-k]
    got = gather_as_bytes(two_ranks, routes)
    assert wire == [torch.uint8] and got.dtype == moe.ROUTE_DTYPE and got.shape == (2, 2, 1, 2)
    assert torch.equal(got, torch.cat([routes, routes]))
    ids = torch.tensor([5, 7])
    assert torch.equal(gather_as_bytes(two_ranks, ids), torch.tensor([5, 7, 6, 8])) and wire[-1] == torch.int64


def test_no_attribute_is_set_on_the_hugging_face_model_at_run_time():
    """Routing travels as data: once the scorer is built (its router hooks installed, checkpointing on), sampling,
    an R2 scoring pass and a replaying update with its backward leave every module of the Hugging Face model with
    the attributes it had."""
    from dataclasses import replace

    from portagrpo.kernels import logprob_impl
    from portagrpo.model.activation_offload import checkpoint_kwargs
    from portagrpo.model.scorer import ResponseScorer, response_stats
    from portagrpo.rollout.engines import HFRollout
    from portagrpo.rollout.settings import SamplingParams

    model = tiny("qwen3_moe").train()
    moe.configure_experts(model, "R2", "eager")
    routers = rr.RouterHooks.install(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(False,
                                                                                        routers.checkpoint_context))
    scorer = ResponseScorer(model, logprob_impl("reference"), routers=routers)
    engine = HFRollout(scorer, TOK, autocast=lambda: torch.autocast("cpu", enabled=False), routers=routers)
    before = {name: sorted(vars(m)) for name, m in model.named_modules()}
    prompts = torch.tensor([[0, 10, 11, 12], [13, 14, 15, 16]])
    engine.generate(prompts, (prompts != 0).long(), SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=3))
    batch = _batch(model)
    with torch.no_grad():
        routes = response_stats(scorer, batch, temperature=1.0, compute_entropy=False,
                                routing=rr.Routing.scoring("R2")).routes
    update = response_stats(scorer, replace(batch, routes=routes), temperature=1.0, compute_entropy=False,
                            routing=rr.Routing.update("R2", old_routes=True))
    update.logp.sum().backward()
    assert {name: sorted(vars(m)) for name, m in model.named_modules()} == before
    assert routers.active is None
