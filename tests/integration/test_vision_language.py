"""GRPO on a vision-language policy (a tiny Qwen2.5-VL built locally) on the CPU: the model and processor, images
through the step (rollout, scoring, micro-batches), freeze_vision_tower, LoRA on the language model only."""
import contextlib
import io
import json

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.config import load_config  # noqa: E402
from portagrpo.data.records import PromptRecord  # noqa: E402
from portagrpo.kernels import token_logprobs_reference  # noqa: E402
from portagrpo.model import vision  # noqa: E402
from portagrpo.rollout.generators import GeneratorInputs, GeneratorSpec, make_generator, one_round  # noqa: E402

FAST = ["trainer.progress_bar=false", "model.tiny.vision=true", "model.tiny.num_heads=2", "data.task=colours",
        "data.train_size=32", "data.val_size=4", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=4", "data.max_response_length=6",
        "trainer.test_freq=0", "actor.warmup_steps=0", "actor.lr=1e-2", "actor.use_kl_loss=false"]


def _trainer(run_dir, *overrides):
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*FAST, *overrides]), run_dir=run_dir, log=lambda m: None).setup()


def _png(size, rgb) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def _tiny():
    return load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny


def test_tiny_vl_model_and_processor_are_built_locally_and_load_from_a_local_path(tmp_path):
    from portagrpo.model.loading import load_model

    processor = vision.build_tiny_processor()
    model = vision.build_tiny_vl_model(_tiny(), processor.tokenizer, seed=0)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = vision.load_processor(tmp_path)
    text = "<|vision_start|><|image_pad|><|vision_end|>colour?"
    out = loaded(text=[text], images=[Image.open(io.BytesIO(_png((56, 56), (200, 0, 0))))], return_tensors="pt")
    image_id = loaded.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((out["input_ids"] == image_id).sum()) == 4  # 56x56: a 4x4 grid of 14-pixel patches, merged 2x2
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    policy = load_model(tmp_path, "sdpa")
    assert type(policy).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text_cfg, vision_cfg = policy.config.text_config, policy.config.vision_config
    assert (text_cfg.num_hidden_layers, text_cfg.hidden_size, text_cfg.hidden_size // text_cfg.num_attention_heads) \
        == (2, 64, 32)
    assert (vision_cfg.depth, vision_cfg.hidden_size, vision_cfg.patch_size, vision_cfg.spatial_merge_size) \
        == (2, 32, 14, 2)
    assert policy.config.image_token_id == image_id
    for name, value in model.state_dict().items():
        assert torch.equal(policy.state_dict()[name], value), name


def _rollout(n=3):
    from portagrpo.model.scorer import ResponseScorer
    from portagrpo.rollout.engines import HFRollout
    from portagrpo.rollout.settings import SamplingParams

    torch.manual_seed(0)
    processor = vision.build_tiny_processor()
    model = vision.build_tiny_vl_model(_tiny(), processor.tokenizer, seed=1)
    scorer = ResponseScorer(model, token_logprobs_reference)
    records = [  # images of different sizes (4, 6 and 4 image tokens) and prompts of different lengths
        PromptRecord(0, [{"role": "user", "content": "<image>colour?"}], "red", "x",
                     images=(_png((56, 56), (250, 0, 0)),)),
        PromptRecord(1, [{"role": "user", "content": "what is the colour of <image> here?"}], "blue", "x",
                     images=(_png((84, 56), (0, 0, 250)),)),
        PromptRecord(2, [{"role": "user", "content": "<image>name it"}], "green", "x",
                     images=(_png((56, 56), (0, 250, 0)),)),
        PromptRecord(3, [{"role": "user", "content": "no picture"}], "none", "x"),  # a text-only row among them
    ]
    engine = HFRollout(scorer, processor.tokenizer, contextlib.nullcontext)
    rows = make_generator(GeneratorSpec("vision"), GeneratorInputs(processor.tokenizer, processor))
    batch = one_round(rows, engine, records, n, SamplingParams(max_tokens=6), "cpu")
    return scorer, batch


def test_images_are_kept_once_per_prompt_and_scoring_matches_the_sampler():
    from portagrpo.model.scorer import response_stats

    scorer, batch = _rollout()
    images = batch.images
    assert images.grid_thw.tolist() == [[1, 4, 4], [1, 4, 6], [1, 4, 4]]  # one per prompt, not per sample
    assert images.pixel_values.shape[0] == 16 + 24 + 16
    assert images.row_prompt == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3] and images.image_spans[3] == (3, 3)
    assert batch.select([7, 1]).images.pixel_values is images.pixel_values  # selecting rows copies no pixels
    with torch.no_grad():
        logp = response_stats(scorer, batch, temperature=1.0, compute_entropy=False).logp
    # the scorer sees the image features and the multimodal positions generate used (left padding included)
    assert torch.allclose(logp, batch.rollout_logp, atol=1e-5)
    assert batch.response_mask.sum() > 12


def test_micro_batched_scoring_equals_one_full_pass_as_image_slices_follow_the_samples():
    from portagrpo.batch import micro_batches
    from portagrpo.model.scorer import response_stats

    scorer, batch = _rollout()
    stats = lambda b: response_stats(scorer, b, temperature=1.0, compute_entropy=True)  # noqa: E731
    with torch.no_grad():
        full = stats(batch)
        reordered = [8, 3, 11, 0, 5, 1, 9, 7, 2, 4, 10, 6]  # rows of different prompts interleaved, out of order
        only_text = torch.tensor([10, 9])  # a micro-batch without any image
        for rows in [torch.tensor(reordered), only_text] + micro_batches(batch, 2) + micro_batches(batch, 2, 70):
            part = stats(batch.select(rows))
            assert torch.allclose(part.logp, full.logp[rows], atol=1e-5), rows.tolist()
            assert torch.allclose(part.entropy, full.entropy[rows], atol=1e-5), rows.tolist()
    # the images matter: another prompt's images give other log-probs
    swapped = batch.select(list(range(12)))
    swapped.images = swapped.images.select([6, 7, 8, 3, 4, 5, 0, 1, 2, 9, 10, 11])
    with torch.no_grad():
        other = stats(swapped).logp
    assert (other[:3] - full.logp[:3]).abs().max() > 1e-4


def test_freeze_vision_tower_keeps_vision_weights_bit_identical_while_text_weights_move(tmp_path):
    def step_changes(run_dir, *overrides):
        t = _trainer(run_dir, *overrides)
        tower = vision.vision_tower(t.models.policy)
        vis_names = {id(p) for p in tower.parameters()}
        before = {n: p.detach().clone() for n, p in t.models.policy.named_parameters()}
        in_optimizer = {id(p) for group in t.parts.optim.optimizer.param_groups for p in group["params"]}
        t.step()
        t.step()
        params = dict(t.models.policy.named_parameters())
        moved = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
        vision_names = {n for n, p in params.items() if id(p) in vis_names}
        return moved, vision_names, bool(vis_names & in_optimizer)

    moved, vision_names, vision_in_optimizer = step_changes(tmp_path / "frozen", "actor.freeze_vision_tower=true")
    assert vision_names and not (moved & vision_names) and not vision_in_optimizer
    assert any("language_model" in n for n in moved)
    moved, vision_names, vision_in_optimizer = step_changes(tmp_path / "trained")  # without it, the tower learns
    assert moved & vision_names and vision_in_optimizer


def test_lora_adapts_the_language_model_only(tmp_path):
    pytest.importorskip("peft")
    t = _trainer(tmp_path, "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj,gate_proj]")
    adapted = {n for n, p in t.models.policy.named_parameters() if p.requires_grad}
    assert adapted and all("lora_" in n and "language_model" in n for n in adapted)
    assert not any("visual" in n for n in adapted)  # the vision tower's MLP has a gate_proj too
    t.step()


def test_trains_two_steps_from_a_geo3k_parquet(tmp_path):
    import importlib.util
    from pathlib import Path

    from portagrpo.cli import main

    # the colleague's helpers for geo3k-format files (tests/unit/test_geo3k.py)
    spec = importlib.util.spec_from_file_location("geo3k_helpers", Path(__file__).parents[1] / "unit" / "test_geo3k.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    _hf_rows, _write_parquet = helpers._hf_rows, helpers._write_parquet

    src = _write_parquet(tmp_path / "train.parquet", _hf_rows() * 3)
    assert main(["data", "geo3k", "--input", str(src), "--output", str(tmp_path / "geo3k"), "--split", "train"]) == 0
    train = tmp_path / "geo3k" / "train.parquet"
    run = tmp_path / "run"
    code = main(["train", "--output-dir", str(run), "model.tiny.vision=true", "model.tiny.num_heads=2",
                 "data.task=null", f"data.train_files=[{train}]", "data.max_prompt_length=400",
                 "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
                 "trainer.total_steps=2", "trainer.test_freq=0", "trainer.progress_bar=false"])
    assert code == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "reward_mean" in s]
    assert [s["step"] for s in trained] == [1, 2] and all(s["loss_policy"] == s["loss_policy"] for s in trained)
    assert type(vision.load_processor(run / "init_model")).__name__ == "Qwen2_5_VLProcessor"


def test_what_a_vision_language_run_does_not_do_is_refused_in_one_sentence(tmp_path):
    from portagrpo.errors import UserError

    with pytest.raises(UserError, match=r"\(FixedRollout\) does not sample with images; use rollout.engine=hf"):
        _trainer(tmp_path / "fixed", "rollout.engine=fixed")
    with pytest.raises(UserError, match=r"prompt 0 has images but the policy is text-only"):
        _trainer(tmp_path / "text", "model.tiny.vision=false")
    with pytest.raises(UserError, match=r"actor.freeze_vision_tower=true but the policy has no vision tower"):
        _trainer(tmp_path / "freeze", "data.task=repeat", "model.tiny.vision=false", "actor.freeze_vision_tower=true")


def test_checkpoints_carry_the_processor_and_a_resumed_run_continues_exactly(tmp_path):
    from safetensors.torch import load_file

    from portagrpo.cli import main

    def train(run, *extra):
        return main(["train", "--output-dir", str(run), *FAST, "trainer.save_freq=2", "trainer.progress_bar=false",
                     *extra])

    assert train(tmp_path / "whole", "trainer.total_steps=4") == 0
    assert train(tmp_path / "cut", "trainer.total_steps=2") == 0
    model_dir = tmp_path / "cut" / "checkpoints" / "step_00000002" / "model"
    processor = vision.load_processor(model_dir)  # loads from the checkpoint's model directory
    assert processor.image_processor.size["shortest_edge"] == vision.TINY_MIN_PIXELS
    assert train(tmp_path / "cut", "trainer.total_steps=4", "--resume", str(tmp_path / "cut")) == 0
    whole = load_file(tmp_path / "whole" / "checkpoints" / "step_00000004" / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "checkpoints" / "step_00000004" / "model" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.allclose(whole[name], resumed[name], rtol=1e-6, atol=1e-7), name
    # the checkpoint's model directory is a policy of its own (model.path), its processor with it
    assert train(tmp_path / "from_path", "trainer.total_steps=1", f"model.path={model_dir}") == 0


def test_verls_freeze_vision_tower_key_and_no_rank_refusal():
    from portagrpo.rollout.engines import HFRollout
    from portagrpo.rollout.generators.vision import check_takes_images

    cfg = load_config(None, ["actor_rollout_ref.actor.freeze_vision_tower=true"])
    assert cfg.actor.freeze_vision_tower is True
    # several ranks train a vision-language policy (tests/distributed/test_vision_data_parallel.py), one step off,
    # with DAPO's filter and with tools too (tests/integration/test_rollout_matrix.py)
    check_takes_images(HFRollout)
    load_config(None, ["model.tiny.vision=true", "rollout.mode=one_step_off", "algorithm.filter_groups.enable=true"])


def test_the_trainer_gives_the_tower_the_backends_vision_attention(tmp_path, monkeypatch):
    """build_models asks the backend for the tower's attention (the decoder's choice in its windowed form) and sets
    it on the policy and its reference; the decoder keeps its own."""
    from portagrpo.backends.cpu import CPUBackend

    asked = []

    def answer(self, requested, dtype):
        asked.append((requested, dtype))
        return "eager"  # not what transformers would pick by itself (sdpa)

    monkeypatch.setattr(CPUBackend, "vision_attention_implementation", answer)
    t = _trainer(tmp_path / "run", "actor.use_kl_loss=true")
    try:
        assert asked and asked[0][0] == "auto"
        for model in (t.models.policy, t.models.ref):
            assert model.config.vision_config._attn_implementation == "eager"
            assert model.config._attn_implementation != "eager"
    finally:
        t.close()
