"""A vision-language policy (the tiny Qwen2.5-VL) on 1 process == on 2 processes (gloo, CPU), under DDP and FSDP2.

Each rank samples its share of the prompts with their images; the images are gathered with the rows, so every
micro-batch of the update, on every rank, takes exactly its rows' pixels. The data has images of several sizes
(ranks hold different numbers of patches and prompt tokens), a prompt with two images and one with none.
"""
import base64
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.tolerances import relative_error, tolerance

pytest.importorskip("PIL")

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Each prompt's images (width, height): 16 to 36 patches each; the seventh prompt has none.
IMAGES = [[(56, 56)], [(112, 56)], [(84, 84), (56, 56)], [(56, 112)], [(84, 56)], [(56, 56)], [], [(56, 84)]]
FP64 = torch.float64
METRICS = {"loss_policy": "loss", "loss_kl": "loss", "kl": "kl", "grad_norm": "grad_norm", "entropy": "entropy",
           "reward_mean": "loss", "adv_mean": "advantage"}


def _png(size, rng) -> str:
    from PIL import Image

    image = Image.new("RGB", size)
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(size[0] * size[1])])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory) -> list[str]:
    """A JSONL of image prompts and a reward that spreads over the responses' text (so advantages are not 0)."""
    base, rng = tmp_path_factory.mktemp("vl_data"), random.Random(0)
    with open(base / "train.jsonl", "w") as f:
        for i, sizes in enumerate(IMAGES):
            f.write(json.dumps({"prompt": [{"role": "user", "content": "<image>" * len(sizes) + "colour?"}],
                                "images": [{"bytes": _png(s, rng), "path": None} for s in sizes],
                                "reward_model": {"ground_truth": "red"}, "data_source": "vl_test",
                                "extra_info": {"index": i}}) + "\n")
    (base / "reward.py").write_text("def spread(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return (sum(map(ord, solution_str)) % 7) / 6.0\n")
    return [f"data.train_files=[{base / 'train.jsonl'}]", f"reward.function={base / 'reward.py'}:spread"]


def run_worker(out: Path, nproc: int, parallel: str, overrides: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    worker = [str(HERE / "vl_worker.py"), str(out), parallel, *overrides]
    # portagrpo's local launcher: its rendezvous listens on 127.0.0.1 only
    cmd = [sys.executable, *(["-m", "portagrpo.launcher", "--nproc", str(nproc)] if nproc > 1 else []), *worker]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


def _skip_without_fsdp2(parallel: str) -> None:
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    if parallel == "fsdp2" and fsdp2_problem(FP64):
        pytest.skip(f"refused with one sentence on torch {torch.__version__}: {fsdp2_problem(FP64)}")


def _vision(name: str) -> bool:
    return ".visual." in name


@pytest.fixture(scope="module")
def single(tmp_path_factory, vl_data):
    return run_worker(tmp_path_factory.mktemp("vl_one"), 1, "auto", vl_data)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_match_one(tmp_path, single, vl_data, parallel):
    _skip_without_fsdp2(parallel)
    two, one = run_worker(tmp_path / "two", 2, parallel, vl_data), single
    assert (one["world"], two["world"], two["strategy"]) == (1, 2, parallel)
    # the update saw the same global batch: the same rows, each with its own prompt's pixels
    for b1, b2 in zip(one["batches"], two["batches"], strict=True):
        assert torch.equal(b2["prompt_ids"], b1["prompt_ids"]) and torch.equal(b2["responses"], b1["responses"])
        assert b2["row_pixels"] is not None and torch.equal(b2["row_pixels"], b1["row_pixels"])
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key, quantity in METRICS.items():
            bound = tolerance(FP64, quantity)
            assert m2[key] == pytest.approx(m1[key], rel=bound, abs=bound), (parallel, key, m1[key], m2[key])
    assert one["state"].keys() == two["state"].keys()
    for name, p1 in one["state"].items():
        assert relative_error(two["state"][name], p1) <= tolerance(FP64, "params"), name
    # a real update, the vision tower's included, and a second step that differs from the first
    assert any(_vision(n) and not torch.equal(p, one["before"][n]) for n, p in one["state"].items())
    assert one["metrics"][1]["loss_policy"] != one["metrics"][0]["loss_policy"]
    if parallel == "fsdp2":  # each vision block is a unit of its own: back in its shards before the decoder runs
        assert two["vision_sharded_in_decoder"] and all(two["vision_sharded_in_decoder"])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_freeze_vision_tower_holds_on_two_ranks(tmp_path, vl_data, parallel):
    _skip_without_fsdp2(parallel)
    two = run_worker(tmp_path / "frozen", 2, parallel, [*vl_data, "actor.freeze_vision_tower=true"])
    vision = [n for n in two["state"] if _vision(n)]
    assert vision and all(torch.equal(two["state"][n], two["before"][n]) for n in vision)
    assert any(not torch.equal(p, two["before"][n]) for n, p in two["state"].items() if "language_model" in n)


def test_an_untied_policy_trains_as_one_process_with_its_embedding_read_by_rows(tmp_path, vl_data):
    """Untied, FSDP2 reads the language model's embedding one rank's rows at a time (model/parallel.py StreamedRows)
    for the rows with images too (model/vision.py vl_inputs takes the scorer's lookup): 2 ranks equal 1 process."""
    _skip_without_fsdp2("fsdp2")
    untied = [*vl_data, "model.tiny.tie_word_embeddings=false"]
    one, two = run_worker(tmp_path / "one", 1, "auto", untied), run_worker(tmp_path / "two", 2, "fsdp2", untied)
    assert relative_error(one["state"]["lm_head.weight"], one["state"]["model.language_model.embed_tokens.weight"]
                          if "model.language_model.embed_tokens.weight" in one["state"] else
                          next(p for n, p in one["state"].items() if n.endswith("embed_tokens.weight"))) > 0.1
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        for key, quantity in METRICS.items():
            bound = tolerance(FP64, quantity)
            assert m2[key] == pytest.approx(m1[key], rel=bound, abs=bound), (key, m1[key], m2[key])
    for name, p1 in one["state"].items():
        assert relative_error(two["state"][name], p1) <= tolerance(FP64, "params"), name
