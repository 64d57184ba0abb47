"""The tools on a vision-language run (a tiny Qwen2.5-VL built locally): `portagrpo eval` samples with the prompts'
images, replay trains a recorded step on the images it was sampled with, and a merged LoRA export carries the
processor."""
import io
import json
import shutil

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.cli import main  # noqa: E402
from portagrpo.data.tasks import colours_task  # noqa: E402
from portagrpo.errors import UserError  # noqa: E402
from portagrpo.model import vision  # noqa: E402

RUN = ["trainer.progress_bar=false", "model.tiny.vision=true", "model.tiny.num_heads=2", "data.task=colours",
       "data.train_size=16", "data.val_size=4", "data.train_batch_size=2", "rollout.n=4",
       "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "data.max_response_length=6",
       "trainer.test_freq=0", "actor.warmup_steps=0", "actor.lr=1e-2", "actor.use_kl_loss=false",
       "trainer.tensorboard=false", "trainer.plot=false", "trainer.total_steps=2", "trainer.save_freq=2",
       "trainer.record_rollouts=true", "model.lora.rank=4"]


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """Two GRPO steps of a LoRA on the tiny VL policy, recorded and checkpointed."""
    run = tmp_path_factory.mktemp("vl") / "run"
    assert main(["train", "--output-dir", str(run), *RUN]) == 0
    return run


def _colours_parquet(path, size, seed):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(colours_task(size, seed)), path)
    return path


@pytest.fixture(scope="module")
def seeing_model(tmp_path_factory):
    """A tiny VL model taught (by plain next-token loss) to name the colour of the picture, saved with its processor.
    The prompt is the same for every row, so only a model that is shown the image can answer."""
    from portagrpo.config import load_config
    from portagrpo.data.records import task_records

    torch.manual_seed(0)
    processor = vision.build_tiny_processor()
    tok = processor.tokenizer
    tiny = load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny
    model = vision.build_tiny_vl_model(tiny, tok, seed=0)
    records = task_records("colours", 64, 3)
    prompts = [vision.vision_prompt_text(tok, r) for r in records]
    images = [Image.open(io.BytesIO(r.images[0])).convert("RGB") for r in records]
    prompt_len = len(processor(text=[prompts[0]], images=[images[0]])["input_ids"][0])  # the same for every row
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        rows = range(step * 8 % 64, step * 8 % 64 + 8)
        batch = processor(text=[prompts[i] + records[i].ground_truth + tok.eos_token for i in rows],
                          images=[images[i] for i in rows], return_tensors="pt", padding=True, padding_side="right")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, :prompt_len] = -100
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("seeing")
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out


def test_eval_of_a_vision_language_model_shows_it_the_images(seeing_model, tmp_path):
    data = _colours_parquet(tmp_path / "colours.parquet", 12, 99)
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(seeing_model), "--data", str(data), "--max-new-tokens", "7",
                 "--batch-size", "5", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    answers = {r["reward_model"]["ground_truth"] for r in colours_task(12, 99)}
    assert len(answers) > 1  # one fixed reply cannot be right for every row
    assert report["greedy"]["accuracy"] >= 0.9, report["greedy"]["examples"]


def test_eval_refuses_image_rows_for_a_text_only_model(tiny_model_dir, tmp_path, capsys):
    data = _colours_parquet(tmp_path / "colours.parquet", 2, 1)
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(data), "--output",
                 str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert "has images but --model" in err and "text-only" in err and "Traceback" not in err


def test_a_recorded_vision_language_step_replays_exactly_with_its_images(vl_run, tmp_path):
    from portagrpo.tools.replay import recorded_steps, replay
    from portagrpo.train.record import StepRecord

    report = replay(vl_run, "cpu", None, tmp_path / "replay", [], log=lambda m: None)
    assert report["passed"], report["verdict"]
    # the same device, dtype and kernel on the same rollouts and images: the same numbers
    assert all(v["error"] == 0.0 for v in report["verdict"].values()), report["verdict"]
    record = StepRecord.load(recorded_steps(vl_run)[0])
    assert record.images is not None and len(record.images["row_prompt"]) == record.rollout["responses"].shape[0]


def test_a_vision_language_record_without_its_images_is_refused(vl_run, tmp_path):
    from portagrpo.tools.replay import recorded_steps, replay

    copy = tmp_path / "run"
    shutil.copytree(vl_run, copy, ignore=shutil.ignore_patterns("replay*", "export*"))
    for path in recorded_steps(copy):  # as an earlier portagrpo wrote it: tokens only
        payload = torch.load(path, weights_only=False)
        del payload["images"]
        torch.save(payload, path)
    with pytest.raises(UserError, match="has image tokens but no images"):
        replay(copy, "cpu", None, tmp_path / "replay", [], log=lambda m: None)


def test_a_merged_lora_export_of_a_vision_language_run_carries_its_processor(vl_run, tmp_path):
    from portagrpo.model.loading import load_model
    from portagrpo.tools.evaluate import evaluate
    from portagrpo.tools.export import export

    out = export(vl_run, tmp_path / "merged", merge=True, log=lambda m: None)
    processor = vision.load_processor(out)  # transformers alone: tests/integration/test_export_plain_transformers.py
    picture = Image.open(io.BytesIO(colours_task(1, 0)[0]["images"][0]["bytes"])).convert("RGB")
    inputs = processor(text=[vision.IMAGE_IN_PROMPT + "colour?"], images=[picture], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    model = load_model(out, "sdpa")
    assert vision.is_vision_language(model)
    assert model(**inputs).logits.isfinite().all()
    # the export evaluates as the run it came from does (LoRA merged into the same base, the same processor)
    data = _colours_parquet(tmp_path / "colours.parquet", 4, 7)
    args = dict(max_new_tokens=6, device="cpu", progress=False)
    from_run, from_export = evaluate(str(vl_run), [str(data)], **args), evaluate(str(out), [str(data)], **args)
    assert from_export["greedy"]["examples"] == from_run["greedy"]["examples"]
