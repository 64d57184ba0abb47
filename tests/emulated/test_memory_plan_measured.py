"""`portagrpo plan` against measurement (issue 41): on 2 and 4 emulated ranks under FSDP2, for seven model shapes
(fp32 and bf16, states-heavy, activation-heavy, root-heavy, mixture-of-experts, LoRA and vision-language), each
phase's planned per-rank peak is within 15% of the peak the emulated device counted (`mem/<phase>_peak_gb`, the
largest over the run's steps). The plan is made from the run's own config, with the padded row width the run actually
trained (its step records) and the image tokens its images made: the plan's maximum lengths are what a recipe
promises, the width and the images are what this run's prompts were."""
import glob
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_emulated_device import ENV, pytestmark  # noqa: F401 - the same skip rule

from portagrpo.config import load_config
from portagrpo.plan.gate import plan_config
from portagrpo.plan.memory import plan

SHAPES = {
    "fp32-states": ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.intermediate_size=1024"],
    "bf16-states": ["model.tiny.hidden_size=384", "model.tiny.num_layers=6", "model.tiny.intermediate_size=1536",
                    "model.dtype=bf16"],
    "fp32-activations": ["model.tiny.hidden_size=128", "model.tiny.num_layers=2", "model.tiny.intermediate_size=512",
                         "data.max_response_length=64", "actor.micro_batch_size=4"],
}
# an untied LM head and embedding of a 32,768-token vocabulary, 93% of the parameters (Qwen2.5-72B's are 3%, 0.5B
# one's 27%): the head and embedding are FSDP2 units of their own (model/parallel.py split_root), read by rows. Saved
# as a checkpoint and loaded from its path (the tiny built-in model's vocabulary is the character tokenizer's).
SAVED = {"root-heavy": dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)}
SHAPES["root-heavy"] = []
# issue 51's shapes: a mixture-of-experts model read by shards from the per-expert names transformers 5 saves, and
# LoRA on a base read by shards
SHAPES["moe"] = ["model.tiny.hidden_size=128", "model.tiny.num_layers=2", "model.tiny.moe=qwen3_moe",
                 "model.tiny.num_experts=8", "model.tiny.moe_intermediate_size=256"]
SHAPES["lora"] = ["model.tiny.hidden_size=256", "model.tiny.num_layers=4", "model.tiny.intermediate_size=1024",
                  "model.lora.rank=8", "model.tiny.tie_word_embeddings=false"]
# a vision-language model (a tiny Qwen2.5-VL): each vision block is a unit, the merger sits in the root with the tied
# embedding and LM head, and every rank holds the step's images
SHAPES["vl"] = ["model.tiny.vision=true", "data.task=colours", "model.tiny.hidden_size=128", "model.tiny.num_layers=2",
                "model.tiny.intermediate_size=512"]
COMMON = ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2",
          "trainer.parallel=fsdp2"]
RUN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=1", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "trainer.record_rollouts=true"]
TOLERANCE = 0.15


def _measure(out, ranks: int, shape: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "emu", "--output-dir", str(out),
           f"trainer.nproc_per_node={ranks}", *COMMON, *RUN, *shape]
    res = subprocess.run(cmd, env={**ENV, "PORTAGRPO_EMU_DEVICES": "1"}, capture_output=True, text=True, timeout=1200,
                         cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    peaks: dict[str, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("mem/") and key.endswith("_peak_gb"):
                peaks[key[4:-8]] = max(peaks.get(key[4:-8], 0.0), value * 2**30)
    return peaks


def _width(out, merge: int) -> tuple[int, int]:
    """The padded row width the run trained, and the image tokens its largest image made (0 without images)."""
    width, image_tokens = 0, 0
    for path in glob.glob(str(out / "rollouts" / "step_*.pt")):
        record = torch.load(path, weights_only=False)
        width = max(width, record["prompt_ids"].shape[1] + record["responses"].shape[1])
        for start, end in (record.get("images") or {}).get("patch_spans", []):
            image_tokens = max(image_tokens, (end - start) // merge)
    return width, image_tokens


def _saved(path, fields: dict) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.model.loading import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **fields)
                     ).save_pretrained(path)
    tok.save_pretrained(path)
    return f"model.path={path}"


@pytest.mark.parametrize("name", SHAPES)
def test_the_plan_is_within_15_percent_of_each_measured_phase(name, tmp_path):
    misses, updates = [], {}
    shape = SHAPES[name] + ([_saved(tmp_path / "model", SAVED[name])] if name in SAVED else [])
    for ranks in (2, 4):
        out = tmp_path / f"r{ranks}"
        measured = _measure(out, ranks, shape)
        updates[ranks] = measured["update"]
        cfg = load_config(None, ["trainer.device=emu", f"trainer.nproc_per_node={ranks}", "trainer.device_memory_gb=1",
                                 *COMMON, *shape], check_files=False)
        planned, _ = plan_config(cfg)
        (width, image_tokens), r = _width(out, planned.model.vision_merge), planned.run
        planned = plan(planned.model, planned.cluster, replace(r, seq_len=width, update_tokens=r.update_rows * width,
                                                               scoring_tokens=r.scoring_rows * width,
                                                               image_tokens=image_tokens or r.image_tokens))
        phases = {p.name: p.total for p in planned.phases}
        assert set(measured) == set(phases), (set(measured), set(phases))  # every phase measured, and planned
        for phase, bytes_measured in measured.items():
            ratio = phases[phase] / bytes_measured
            if abs(ratio - 1) > TOLERANCE:
                misses.append(f"{ranks} ranks, {phase}: planned {phases[phase] / 2**20:.2f} MiB, measured "
                              f"{bytes_measured / 2**20:.2f} MiB")
    assert not misses, misses
    if name == "root-heavy":
        # issue 51: the update's peak falls x0.60 or more from 2 to 4 ranks. The head and embedding are read one rank's
        # rows at a time (model/parallel.py StreamedRows); as gathered units they held 3 x 32 MiB at any world size
        # (x0.67), in the root 166 MiB.
        assert updates[4] <= 0.60 * updates[2], updates
