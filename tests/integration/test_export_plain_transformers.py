"""Every kind of `portagrpo export` loads with transformers alone: a fresh Python process that never imports
portagrpo loads the model, the tokenizer with its chat template and, for a vision-language export, the processor,
and they compute what portagrpo computes from the same directory (no class registered by portagrpo needed)."""
import io
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.cli import main  # noqa: E402
from portagrpo.data.tasks import colours_task  # noqa: E402
from portagrpo.model import vision  # noqa: E402
from portagrpo.model.loading import load_model, load_tokenizer  # noqa: E402
from portagrpo.tools.export import export  # noqa: E402

ONE_STEP = ["trainer.progress_bar=false", "model.tiny.num_heads=2", "data.train_size=8", "data.val_size=4",
            "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
            "trainer.test_freq=0", "actor.warmup_steps=0", "actor.lr=1e-2", "actor.use_kl_loss=false",
            "trainer.tensorboard=false", "trainer.plot=false", "trainer.total_steps=1", "trainer.save_freq=1"]
KINDS = {  # export kind: (train overrides, --merge)
    "text_full": (["data.task=repeat"], False),
    "text_lora_merged": (["data.task=repeat", "model.lora.rank=4"], True),
    "vl_full": (["data.task=colours", "model.tiny.vision=true"], False),
    "vl_lora_merged": (["data.task=colours", "model.tiny.vision=true", "model.lora.rank=4"], True),
}
PROMPT = "1+2="

# Run in a fresh interpreter: transformers only. Prints one JSON object.
PROBE = r"""
import io, json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

path, vl, prompt = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
out = {}
tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
out["chat_template"] = bool(tok.chat_template)
ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
out["ids"] = ids[0].tolist()
loader = AutoModelForImageTextToText if vl else AutoModelForCausalLM
model = loader.from_pretrained(path, local_files_only=True).float().eval()
out["model"] = type(model).__name__
with torch.no_grad():
    out["logits"] = model(input_ids=ids).logits[0, -1].tolist()
try:
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    out["processor"] = type(processor).__name__
except ImportError as err:  # transformers' Qwen2_5_VLProcessor needs torchvision for its video part
    out["processor"] = "ImportError: " + " ".join(str(err).split())[:200]
if vl:
    from PIL import Image
    from transformers import AutoImageProcessor

    out["processor_class"] = json.load(open(path + "/processor_config.json"))["processor_class"]
    image = Image.open(io.BytesIO(bytes.fromhex(sys.argv[4]))).convert("RGB")
    pixels = AutoImageProcessor.from_pretrained(path, local_files_only=True)(images=[image], return_tensors="pt")
    out["grid"] = pixels["image_grid_thw"].tolist()
    out["pixels_sum"] = float(pixels["pixel_values"].double().sum())
    if not out["processor"].startswith("ImportError"):
        both = processor(text=["<|vision_start|><|image_pad|><|vision_end|>" + prompt], images=[image],
                         return_tensors="pt")
        out["processor_pixels_sum"] = float(both["pixel_values"].double().sum())
out["portagrpo_imported"] = any(name.split(".")[0] == "portagrpo" for name in sys.modules)
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=sorted(KINDS))
def exported(request, tmp_path_factory):
    overrides, merge = KINDS[request.param]
    run = tmp_path_factory.mktemp(request.param) / "run"
    assert main(["train", "--output-dir", str(run), *ONE_STEP, *overrides]) == 0
    return request.param, export(run, run / "exported", merge=merge, log=lambda m: None)


def _probe(path, vl: bool, image: bytes, cwd) -> dict:
    done = subprocess.run([sys.executable, "-I", "-c", PROBE, str(path), "1" if vl else "0", PROMPT, image.hex()],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_export_loads_with_transformers_alone_and_computes_what_portagrpo_computes(exported, tmp_path):
    kind, out = exported
    vl = kind.startswith("vl")
    image = colours_task(1, 0)[0]["images"][0]["bytes"]
    got = _probe(out, vl, image, tmp_path)
    assert not got["portagrpo_imported"]
    assert got["chat_template"] or not vl
    assert not (out / "adapter_config.json").exists()  # merged: a plain model, no peft needed
    tokenizer = vision.load_processor(out).tokenizer if vl else load_tokenizer(str(out))
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert got["ids"] == ids
    model = load_model(out, "sdpa").float().eval()
    with torch.no_grad():
        ours = model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(torch.tensor(got["logits"]), ours, rtol=1e-5, atol=1e-5)
    if not vl:
        assert got["model"] == type(model).__name__
        assert got["processor"] in ("TokenizersBackend", type(tokenizer).__name__)  # a text model's is its tokenizer
        return
    assert got["model"] == "Qwen2_5_VLForConditionalGeneration"
    assert got["processor_class"] == "Qwen2_5_VLProcessor"  # transformers' own class, not one portagrpo registers
    # The real processor, never a tokenizer alone: with torchvision (which transformers' Qwen2.5-VL processor needs
    # for its video part) it is Qwen2_5_VLProcessor; without it, transformers says so.
    assert got["processor"] == "Qwen2_5_VLProcessor" or (
        got["processor"].startswith("ImportError") and "torchvision" in got["processor"].lower())
    processor = vision.load_processor(out)
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    ours = processor(text=[vision.IMAGE_IN_PROMPT + PROMPT], images=[picture], return_tensors="pt")
    assert got["grid"] == ours["image_grid_thw"].tolist()
    assert got["pixels_sum"] == pytest.approx(float(ours["pixel_values"].double().sum()), rel=1e-6)
    if "processor_pixels_sum" in got:
        assert got["processor_pixels_sum"] == pytest.approx(got["pixels_sum"], rel=1e-6)
