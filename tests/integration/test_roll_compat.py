"""A ROLL RLVR/GRPO YAML as written (ROLL's example_grpo.yaml with paths and sizes changed) is recognised,
mapped key by key with notices, and trains; an unknown ROLL key gets a sentence."""
from pathlib import Path

import pytest
import yaml

from portagrpo.cli import main
from portagrpo.config import ConfigError, load_config
from portagrpo.data.records import write_jsonl
from portagrpo.data.tasks import gsm8k_style_rows
from portagrpo.metrics import read_metrics

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "roll_grpo.yaml"


def roll_yaml(tmp_path, model_dir) -> Path:
    """ROLL rows carry the chat prompt in `messages` (actor_train.data_args.messages names the column)."""
    def rows(n, seed):
        out = []
        for r in gsm8k_style_rows(n, seed=seed):
            r["messages"] = r.pop("prompt")
            out.append(r)
        return out

    train = write_jsonl(rows(16, 2), tmp_path / "train.jsonl")
    val = write_jsonl(rows(4, 3), tmp_path / "val.jsonl")
    text = TEMPLATE.read_text().replace("{MODEL}", str(model_dir)).replace("{TRAIN}", str(train))
    path = tmp_path / "rlvr_config.yaml"
    path.write_text(text.replace("{VAL}", str(val)))
    return path


def test_roll_keys_map_onto_portagrpos(tmp_path, tiny_model_dir):
    notices: list[str] = []
    cfg = load_config(roll_yaml(tmp_path, tiny_model_dir), [], notices=notices)
    a, alg, d, r, t = cfg.actor, cfg.algorithm, cfg.data, cfg.rollout, cfg.trainer
    assert (d.train_batch_size, r.n, d.max_prompt_length, d.max_response_length) == (2, 4, 200, 8)
    assert (a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type, a.loss_agg_mode) == (True, 0.001, "k3",
                                                                                 "seq-mean-token-mean")
    assert (alg.adv_estimator, alg.whiten_advantages, alg.advantage_clip, alg.reward_clip) == ("grpo", True, 2.0,
                                                                                               10.0)
    assert a.clip_ratio_c == pytest.approx(1.4)  # ROLL's dual clip bound 1 + 2 x pg_clip
    assert (a.lr, a.warmup_steps, a.micro_batch_size, a.ppo_mini_batch_size) == (1e-6, 20, 1, 8)
    assert (r.temperature, r.top_p, r.top_k, r.val_temperature) == (0.99, 0.99, 100, 0.6)
    assert (t.total_steps, t.save_freq, t.test_freq, t.seed, t.experiment_name) == (2, 2, 2, 42,
                                                                                    "qwen2.5-7B-rlvr-config")
    assert d.prompt_key == "messages" and d.task is None and t.logger == ["console", "tensorboard"]
    assert any(n.startswith("ROLL key rollout_batch_size -> portagrpo data.train_batch_size") for n in notices)
    assert any("ROLL keys with no effect here" in n and "rewards" in n for n in notices)


def test_roll_grpo_yaml_trains(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(roll_yaml(tmp_path, tiny_model_dir)), "--output-dir", str(out),
                 "trainer.progress_bar=false", "reward.num_workers=0"]) == 0
    assert "ROLL key num_return_sequences_in_group -> portagrpo rollout.n" in capsys.readouterr().out
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and "val/acc" in rows[-1]


def test_unknown_roll_keys_are_sentences(tmp_path, tiny_model_dir):
    path = roll_yaml(tmp_path, tiny_model_dir)
    raw = yaml.safe_load(path.read_text())
    raw["critic_warmup_steps"] = 3
    raw["adv_estimator"] = "gae"
    raw["actor_train"]["training_args"]["lr_scheduler_type"] = "linear"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    problems = "\n".join(info.value.problems)
    assert "ROLL key critic_warmup_steps has no portagrpo equivalent" in problems
    assert "adv_estimator='gae' has no portagrpo equivalent" in problems
    assert "lr_scheduler_type='linear': portagrpo schedules are constant and cosine" in problems


@pytest.mark.parametrize("section,value", [("actor_train", 5), ("actor_infer", [1, 2]), ("validation", "x")])
def test_a_roll_section_that_is_not_a_mapping_is_one_sentence(tmp_path, section, value):
    path = tmp_path / "rlvr.yaml"
    path.write_text(yaml.safe_dump({"rollout_batch_size": 4, "num_return_sequences_in_group": 4, section: value}))
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    assert info.value.problems == [f"ROLL key {section} is {type(value).__name__} {value!r}, not a section of keys; "
                                   f"write it as a mapping (as in ROLL's example_grpo.yaml) or remove it."]


def test_roll_parts_and_sizes_of_the_wrong_kind_are_sentences(tmp_path):
    path = tmp_path / "rlvr.yaml"
    path.write_text(yaml.safe_dump({"rollout_batch_size": 4, "num_return_sequences_in_group": 4, "pg_clip_low": "x",
                                    "use_pg_clip_range": True, "track_with": ["wandb"],
                                    "actor_infer": {"generating_args": 3},
                                    "actor_train": {"model_args": {"dtype": ["bf16"]},
                                                    "training_args": {"per_device_train_batch_size": "2"}}}))
    with pytest.raises(ConfigError) as info:
        load_config(path, [])
    problems = "\n".join(info.value.problems)
    assert "ROLL key actor_infer.generating_args is int 3, not a section of keys" in problems
    assert "ROLL keys actor_train.training_args.per_device_train_batch_size='2' and gradient_accumulation_steps=1 " \
           "must be whole numbers of at least 1." in problems
    assert "ROLL key pg_clip_low='x' must be a number." in problems
    assert "ROLL key track_with=['wandb'] has no portagrpo equivalent" in problems
    assert "model.dtype=['bf16'] is not allowed" in problems


def test_a_roll_yaml_without_actor_train_updates_once_over_the_rollout_batch(tmp_path):
    path = tmp_path / "rlvr.yaml"
    path.write_text("rollout_batch_size: 4\nnum_return_sequences_in_group: 4\nresponse_length: 8\n")
    notices: list[str] = []
    cfg = load_config(path, [], notices=notices)
    assert cfg.actor.ppo_mini_batch_size == 16  # ROLL's default: one update over 4 x 4 responses
    assert any("actor.ppo_mini_batch_size=16, the whole rollout batch" in n for n in notices)
    # an override still wins, and per device x accumulation x ranks when ROLL sets them
    assert load_config(path, ["actor.ppo_mini_batch_size=8"]).actor.ppo_mini_batch_size == 8
    path.write_text(path.read_text() + "actor_train:\n  training_args:\n    per_device_train_batch_size: 2\n"
                                       "    gradient_accumulation_steps: 2\n")
    assert load_config(path, []).actor.ppo_mini_batch_size == 4
    assert load_config(path, ["actor.ppo_mini_batch_size=8"]).actor.ppo_mini_batch_size == 8
