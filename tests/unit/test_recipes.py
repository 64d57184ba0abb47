"""Every recipe resolves and validates with --dry-run, without the device or the model files."""
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_runs(recipe, capsys):
    assert main(["train", "--config", str(recipe), "--dry-run"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_the_required_recipes_exist():
    names = {p.name for p in RECIPES}
    for size in ("0.5b", "3b", "7b"):
        for device in ("cuda", "rocm", "npu"):
            assert f"qwen2.5-{size}-gsm8k-{device}.yaml" in names
    assert "qwen2.5-0.5b-gsm8k-drgrpo-cuda.yaml" in names and "smollm2-135m-arith-cpu.yaml" in names
    dr = load_config(ROOT / "configs" / "qwen2.5-0.5b-gsm8k-drgrpo-cuda.yaml", check_files=False)
    assert dr.actor.loss_agg_mode == "seq-mean-token-sum-norm" and not dr.actor.use_kl_loss


def test_dry_run_catches_divisions_for_the_world_size(capsys):
    recipe = ROOT / "configs" / "qwen2.5-0.5b-gsm8k-npu.yaml"
    assert main(["train", "--config", str(recipe), "--dry-run", "trainer.nproc_per_node=6"]) == 2
    assert "cannot be split over 6 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda", "rocm", "npu"])
def test_the_vision_language_recipes_are_verls_geo3k_run_on_eight_ranks(device):
    """Qwen2.5-VL-7B on geo3k as verl's example runs it: FSDP2 over 8 ranks, vLLM rollouts, the geo3k reward."""
    cfg = load_config(ROOT / "configs" / f"qwen2.5-vl-7b-geo3k-{device}.yaml", check_files=False)
    assert cfg.model.path.endswith("Qwen2.5-VL-7B-Instruct") and cfg.trainer.device == device
    assert (cfg.trainer.nproc_per_node, cfg.trainer.parallel, cfg.rollout.engine) == (8, "fsdp2", "vllm")
    assert (cfg.reward.function, cfg.data.image_key, cfg.data.train_files) == ("geo3k", "images",
                                                                              ["data/geo3k/train.parquet"])
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_prompt_length, cfg.data.max_response_length) \
        == (512, 5, 1024, 2048)
    assert (cfg.actor.lr, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (1e-6, 0.01, "low_var_kl")
    assert cfg.actor.ppo_mini_batch_size == (160 if device == "npu" else 640)
