"""`portagrpo plan` as strict as `train` (issue 49): its --json never replaces a file that is not an earlier plan,
nonsense cluster numbers and unreadable config.json files are one sentence, and every layout `train` refuses is
refused here with the same sentence."""
import json
from pathlib import Path

import pytest

from portagrpo.cli import main

ROOT = Path(__file__).resolve().parents[2]
SEVEN_B = ROOT / "configs" / "qwen2.5-7b-gsm8k-cuda.yaml"
MOE = ROOT / "configs" / "qwen3-30b-a3b-gsm8k-cuda.yaml"
SHIPPED = ROOT / "portagrpo" / "plan" / "model_shapes" / "Qwen2.5-0.5B-Instruct.json"


def _one_sentence(err: str) -> None:
    assert "Traceback" not in err and err.strip(), err
    assert len(err.strip().splitlines()) == 1, err


def test_json_never_replaces_a_file_that_is_not_an_earlier_plan(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(SEVEN_B.read_text())
    before = recipe.read_text()
    assert main(["plan", "--config", str(SEVEN_B), "--json", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "plan --json" in err and "is not an earlier portagrpo plan report" in err and "nothing was written" in err
    assert recipe.read_text() == before
    report = tmp_path / "plan.json"
    assert main(["plan", "--config", str(SEVEN_B), "--json", str(report)]) == 0
    assert main(["plan", "--config", str(SEVEN_B), "--json", str(report), "--nodes", "2"]) == 0  # its own: replaced
    assert json.loads(report.read_text())["cluster"]["nodes"] == 2


@pytest.mark.parametrize("flag,value", [("--device-memory-gb", "-80"), ("--device-memory-gb", "nan"),
                                        ("--device-memory-gb", "inf"), ("--device-memory-gb", "0"),
                                        ("--devices-per-node", "-4"), ("--devices-per-node", "0"),
                                        ("--host-memory-gb", "-1"), ("--host-memory-gb", "0"), ("--nodes", "0")])
def test_nonsense_cluster_numbers_are_one_sentence(capsys, flag, value):
    assert main(["plan", "--config", str(SEVEN_B), flag, value]) == 2
    err = capsys.readouterr().err
    _one_sentence(err)
    assert f"{flag} {value}" in err


def test_nonsense_memory_in_the_config_is_refused_where_it_loads(capsys):
    assert main(["plan", "--config", str(SEVEN_B), "trainer.device_memory_gb=-80"]) == 2
    assert "trainer.device_memory_gb=-80.0 must be a positive number of GiB" in capsys.readouterr().err


@pytest.mark.parametrize("recipe,overrides,words", [
    (SEVEN_B, ["trainer.fsdp_size=3"], "trainer.fsdp_size=3 needs trainer.parallel=fsdp2 and must divide the 8 ranks"),
    (SEVEN_B, ["actor.ulysses_sequence_parallel_size=3"],
     "actor.ulysses_sequence_parallel_size=3 must divide the 8 rank(s)"),
    (SEVEN_B, ["trainer.parallel=ddp", "trainer.fsdp_size=2"], "trainer.fsdp_size=2 needs trainer.parallel=fsdp2"),
    (MOE, ["actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true"],
     "a mixture-of-experts policy's routes"),
])
def test_every_layout_train_refuses_plan_refuses_in_the_same_words(capsys, recipe, overrides, words):
    assert main(["plan", "--config", str(recipe), *overrides]) == 2
    planned = capsys.readouterr().err
    assert words in planned and "Traceback" not in planned
    assert main(["train", "--config", str(recipe), "--dry-run", *overrides]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("content,words", [
    ("{not json", "is not a JSON file"),
    ("[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({"model_type": "nosuchmodel", "hidden_size": 8}), "transformers cannot read it"),
    ("HIDDEN_TEXT", "hidden_size='big' must be a positive integer"),
    ("HEADS_ZERO", "num_attention_heads=0 must be a positive integer"),
])
def test_a_malformed_config_json_is_one_sentence(tmp_path, capsys, content, words):
    shipped = {k: v for k, v in json.loads(SHIPPED.read_text()).items() if k != "_comment"}
    if content == "HIDDEN_TEXT":
        content = json.dumps({**shipped, "hidden_size": "big"})
    elif content == "HEADS_ZERO":
        content = json.dumps({**shipped, "num_attention_heads": 0})
    model = tmp_path / "Broken-1B"
    model.mkdir()
    (model / "config.json").write_text(content)
    assert main(["plan", f"model.path={model}", "trainer.device_memory_gb=80"]) == 2
    err = capsys.readouterr().err
    _one_sentence(err)
    assert words in err and str(model / "config.json") in err


def test_plan_takes_device_as_train_does(capsys):
    assert main(["plan", "--config", str(SEVEN_B), "--device", "npu"]) in (0, 1)
    assert "memory plan: Qwen2.5-7B-Instruct" in capsys.readouterr().out


def test_a_vllm_group_over_nodes_is_refused_with_the_largest_size_that_fits(capsys):
    """verl's 72B script asks for TP 16 over nodes of 8: the engine refuses that at build (a tensor-parallel group
    sits on one node), so the plan does too, and names the largest size it takes."""
    seventy = ROOT / "configs" / "qwen2.5-72b-gsm8k-cuda.yaml"
    assert main(["plan", "--config", str(seventy), "rollout.engine=vllm", "rollout.tensor_model_parallel_size=16"]) == 2
    err = capsys.readouterr().err
    assert "rollout.tensor_model_parallel_size=16 does not divide the 8 rank(s) per node" in err
    assert "The largest rollout.tensor_model_parallel_size vLLM takes here is 8" in err and "Traceback" not in err
