"""Vision-language policies (Qwen2.5-VL architecture): the tiny local model and processor, a rollout's images
kept once per prompt, and the model inputs a micro-batch's rows take from them.

Where images travel in a step: the processor turns each distinct prompt's images into patches
(`pixel_values`) and grids (`image_grid_thw`) once, when its prompt is tokenized (`vision_prompts`). A
`PromptImages` keeps them once per prompt and maps each row (a group's n samples) to its prompt, so
selecting rows (micro-batches, token-budget groups, mini-batches) copies no pixels. `generate` gets each
row's patches; a scoring or update forward runs the vision tower once per distinct prompt of the
micro-batch and hands every row its prompt's image features. The multimodal rotary positions are
computed from the rows' ids, grids and 2D attention masks (`mrope_positions`), so left padding is fine;
packing is not used for vision-language rows. On several ranks the images are gathered with the rows
(model/vision_gather.py), and FSDP2 shards each vision block (`vision_blocks`).
"""
from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from portagrpo.batch import PromptImages  # noqa: F401 - re-exported: a batch's images
from portagrpo.errors import UserError
from portagrpo.paths import uses_vision

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
QWEN_VL_SPECIALS = ["<|im_start|>", "<|im_end|>", VISION_START, VISION_END, "<|vision_pad|>", IMAGE_PAD,
                    "<|video_pad|>"]
IMAGE_IN_PROMPT = VISION_START + IMAGE_PAD + VISION_END
# The tiny processor's image sizes: at least 56x56 pixels (4 merged image tokens), at most 112x112 (16).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


# The first transformers whose Qwen2.5-VL this module runs, computing what the parity golden does: 4.x lacks the API
# called here (get_image_features(..., return_dict=True), get_rope_index taking token types, the PIL image
# processor); up to 5.5.3 a still image's multimodal rotary positions were scaled as a video's (transformers issue
# 45325, fixed in 5.5.4).
VL_MIN_TRANSFORMERS = "5.5.4"


class VisionError(UserError, ValueError):
    """A vision-language setting or row that cannot run."""


# ---- the tiny model and its processor, built locally
def build_vl_tokenizer():
    """portagrpo's character tokenizer with Qwen2.5-VL's special tokens (each one token)."""
    from tokenizers import AddedToken

    from portagrpo.model.loading import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in QWEN_VL_SPECIALS]})
    return tok


def _processor_class():
    """Qwen2.5-VL's processor without its video part. transformers' `Qwen2_5_VLProcessor` also needs a video
    processor, which needs torchvision; images need only the image processor and the tokenizer. It saves what
    transformers' own class saves, under that class's name: processor_config.json naming `Qwen2_5_VLProcessor`, and
    the image processor's preprocessor_config.json beside it, which transformers also reads as the video processor's
    (the layout of Qwen's own Qwen2.5-VL directories). So transformers alone, with no registration by portagrpo, loads
    a saved one with `AutoProcessor` as the real `Qwen2_5_VLProcessor` (which needs torchvision), and portagrpo
    loads it with this class (`load_processor`)."""
    global _PROCESSOR
    if _PROCESSOR is None:
        from transformers import Qwen2_5_VLProcessor

        class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                kwargs.pop("video_processor", None)
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

            def save_pretrained(self, save_directory, *args, **kwargs):
                saved = super().save_pretrained(save_directory, *args, **kwargs)
                self.image_processor.save_pretrained(save_directory)
                return saved

        # the name save_pretrained writes (processor_config.json, tokenizer_config.json): transformers' own class
        ImageOnlyQwen2_5_VLProcessor.__name__ = ImageOnlyQwen2_5_VLProcessor.__qualname__ = "Qwen2_5_VLProcessor"
        _PROCESSOR = ImageOnlyQwen2_5_VLProcessor
    return _PROCESSOR


_PROCESSOR = None
# processor_class values that `load_processor` loads as the image-only Qwen2.5-VL processor ("PortagrpoVLProcessor":
# what portagrpo wrote before its processor saved under transformers' own name)
IMAGE_ONLY_LOADS = ("Qwen2_5_VLProcessor", "PortagrpoVLProcessor")


def transformers_version() -> str:
    """The installed transformers' version (read here, in one place, so a test can stand in another)."""
    import transformers

    return transformers.__version__


def vision_support_problem() -> str | None:
    """Why this environment's transformers cannot run a vision-language policy, in one sentence; None if it can."""
    from packaging.version import Version

    have = transformers_version()
    if Version(have) >= Version(VL_MIN_TRANSFORMERS):
        return None
    return (f"a vision-language policy needs transformers {VL_MIN_TRANSFORMERS} or newer and this environment has "
            f"{have} (4.x lacks the Qwen2.5-VL API portagrpo calls; up to 5.5.3 a still image's rotary positions "
            f"were placed as a video's); install transformers>={VL_MIN_TRANSFORMERS}.")


def require_vision_support() -> None:
    problem = vision_support_problem()
    if problem is not None:
        raise VisionError(problem)


def build_tiny_processor(tokenizer=None):
    """Qwen2.5-VL's processor of the VL tokenizer and a `Qwen2VLImageProcessor` (its PIL version) with small
    images (56x56 to 112x112 pixels)."""
    require_vision_support()
    from transformers import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS, patch_size=14,
                                     merge_size=2, temporal_patch_size=2)
    tokenizer = tokenizer if tokenizer is not None else build_vl_tokenizer()
    return _processor_class()(image_processor=image, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def build_tiny_vl_model(tiny, tokenizer, seed: int):
    """A random-init `Qwen2_5_VLForConditionalGeneration`: the text part sized by `model.tiny` (head dim
    hidden/heads), a vision tower of depth 2, width 32, patch 14 and spatial merge 2."""
    require_vision_support()
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", IMAGE_PAD), ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", VISION_START),
        ("vision_end_token_id", VISION_END)]}
    head_dim = tiny.hidden_size // tiny.num_heads
    half = head_dim // 2  # mrope sections over temporal, height, width: they sum to half the head dim
    sections = [half - 2 * (half // 4), half // 4, half // 4]
    text = dict(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                num_key_value_heads=tiny.num_heads, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
                tie_word_embeddings=tiny.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=tiny.hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_chans=3)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tiny.tie_word_embeddings,
                              **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.float()


def _hf(model):
    """The transformers model under our wrappers (the scorer's `.lm`, peft)."""
    lm = getattr(model, "lm", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def is_vision_language(model) -> bool:
    """Whether a transformers model (under our wrappers) is a vision-language one."""
    return getattr(_hf(model).config, "vision_config", None) is not None


def vl_body(model):
    """The multimodal body (vision tower + language model, returning hidden states) under our wrappers."""
    return _hf(model).model


def vision_tower(model):
    return vl_body(model).visual


def vision_blocks(model) -> list:
    """The vision tower's transformer blocks (FSDP2 shards each, as it shards the decoder layers); none for a
    text-only policy."""
    return list(vision_tower(model).blocks) if is_vision_language(model) else []


def freeze_vision_tower(model) -> int:
    """`actor.freeze_vision_tower`: the vision tower's parameters get no gradient (so they are left out of the
    optimizer). Returns how many parameters were frozen."""
    if not is_vision_language(model):
        raise VisionError("actor.freeze_vision_tower=true but the policy has no vision tower; set it to false, or "
                          "train a vision-language model (model.tiny.vision=true or a Qwen2.5-VL model.path).")
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return len(params)


# ---- a rollout's images, once per prompt
def _pil(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def vision_prompt_text(tokenizer, record, tools: list[dict] | None = None) -> str:
    """The rendered prompt (with the tools' schemas of a conversation) with each `<image>` placeholder as
    Qwen2.5-VL's vision span."""
    from portagrpo.data.images import IMAGE_PLACEHOLDER
    from portagrpo.data.records import render_prompt

    if record.token_ids is not None:
        raise VisionError(f"prompt {record.index} has images and was cut by data.truncation, which would cut its "
                          f"image tokens; raise data.max_prompt_length or set data.filter_overlong_prompts=true.")
    return render_prompt(tokenizer, record.prompt, tools).replace(IMAGE_PLACEHOLDER, IMAGE_IN_PROMPT)


def vision_prompts(processor, records: list, device,
                   tools: list[dict] | None = None) -> tuple[list[list[int]], PromptImages | None]:
    """Each record's prompt tokens (its image spans expanded to the image's tokens) and the records' images,
    processed once per record. No images at all: (ids, None)."""
    ids, pixels, grids, patch_spans, image_spans = [], [], [], [], []
    n_patches = n_images = 0
    for record in records:
        text = vision_prompt_text(processor.tokenizer, record, tools)
        images = [_pil(b) for b in record.images] or None
        out = processor(text=[text], images=images, return_tensors="pt")
        ids.append(out["input_ids"][0].tolist())
        if images:
            pixels.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
        k, m = (out["pixel_values"].shape[0], len(images)) if images else (0, 0)
        patch_spans.append((n_patches, n_patches + k))
        image_spans.append((n_images, n_images + m))
        n_patches, n_images = n_patches + k, n_images + m
    if not pixels:
        return ids, None
    return ids, PromptImages(torch.cat(pixels).to(device), torch.cat(grids).to(device), patch_spans, image_spans,
                             list(range(len(records))))


def with_rows(images: PromptImages | None, n: int) -> PromptImages | None:
    """The prompts' images for a rollout of n samples per prompt (rows prompt after prompt)."""
    if images is None:
        return None
    return replace(images, row_prompt=[p for p in images.row_prompt for _ in range(n)])


# ---- model inputs
def mm_token_types(model, input_ids: torch.Tensor, prompt_len: int | None = None) -> torch.Tensor:
    """1 on the prompt's image tokens, 0 elsewhere (the token types Qwen2.5-VL's rotary positions are computed
    from). An image token a policy sampled in its response is text: it has no image behind it."""
    types = (input_ids == hf_config(model).image_token_id).int()
    if prompt_len is not None:
        types[:, prompt_len:] = 0
    return types


def hf_config(model):
    return _hf(model).config


def vl_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: PromptImages,
                     prompt_len: int, embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Final hidden states [B, S, H] of left-padded prompt + response rows: the vision tower runs once per
    distinct prompt of these rows, every row's prompt image tokens get its prompt's image features, and the
    multimodal rotary positions come from the rows' ids, grids and attention masks (as `generate` computed
    them: text positions count real tokens only). `embed`: how token ids become embeddings (the scorer's, which may
    read the embedding by rows: model/parallel.py StreamedRows); by default the language model's own."""
    embeds, positions = vl_inputs(model, input_ids, attention_mask, images, prompt_len, embed)
    out = vl_body(model).language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                                        use_cache=False)
    return out.last_hidden_state


def vl_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: PromptImages,
              prompt_len: int, embed: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `vl_hidden_states` hands the language model: the rows' embeddings [B, S, H] with the image features in
    place, and their multimodal rotary positions [3, B, S] (a packed forward selects the real tokens of both)."""
    body = vl_body(model)
    prompts = images.distinct()
    pixels, grids = images.take(prompts)
    features = body.get_image_features(pixels, grids, return_dict=True).pooler_output if len(grids) else ()
    idle = idle_tower(body) if not len(grids) else None
    per_prompt, at = {}, 0
    for p in prompts:
        k = images.image_spans[p][1] - images.image_spans[p][0]
        per_prompt[p] = list(features[at:at + k])
        at += k
    rows = [f for p in images.row_prompt for f in per_prompt[p]]
    types = mm_token_types(model, input_ids, prompt_len)
    embeds = (embed or body.get_input_embeddings())(input_ids)
    if rows:  # rows whose prompts have no image keep their plain embeddings
        embeds = embeds.masked_scatter(types.bool()[..., None], torch.cat(rows).to(embeds.dtype))
    if idle is not None:
        embeds = embeds + 0 * idle.to(embeds.dtype)
    positions, _ = body.get_rope_index(input_ids, types, image_grid_thw=images.grids_per_row(),
                                       attention_mask=attention_mask)
    return embeds, positions


def idle_tower(body) -> torch.Tensor | None:
    """Under FSDP2 every rank must run each vision block's all-gathers (and reduce-scatters) with the others: a
    micro-batch without images (whose rank's peers may have some) still runs the tower, on one blank image of
    the smallest grid, and adds 0 x its features' sum to the embeddings, so its blocks take part in backward too.
    None where the tower is not sharded (nothing to keep in step, and no zero gradient changes an optimizer)."""
    from torch.distributed.fsdp import FSDPModule

    tower = body.visual
    if not any(isinstance(block, FSDPModule) for block in tower.blocks):
        return None
    cfg, param = tower.config, next(tower.parameters())
    merge = cfg.spatial_merge_size
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = torch.zeros(merge * merge, width, device=param.device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=param.device)
    return torch.cat(list(body.get_image_features(pixels, grid, return_dict=True).pooler_output)).sum()


def generate_inputs(model, prompt_ids: torch.Tensor, images: PromptImages | None) -> dict[str, Any]:
    """The extra `generate` inputs of vision-language rows: each row's patches, grids and token types."""
    if images is None:
        return {}
    pixels, grids = images.per_row()
    return {"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": mm_token_types(model, prompt_ids)}


# ---- loading
def load_processor(path: str | Path, field: str = "model.path"):
    """A model directory's processor: a Qwen2.5-VL one as the image-only processor (no torchvision needed), any other
    through transformers' AutoProcessor."""
    require_vision_support()
    from transformers import AutoProcessor

    try:
        if saved_processor_class(path) in IMAGE_ONLY_LOADS:
            return _processor_class().from_pretrained(str(path), local_files_only=True)
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise VisionError(f"{field}={str(path)!r}: its processor cannot be loaded ({type(err).__name__}: {first}); "
                          f"give a directory with the model's preprocessor_config.json and tokenizer.") from None


def saved_processor_class(path: str | Path) -> str | None:
    """The processor class a model directory names (processor_config.json, else preprocessor_config.json)."""
    import json

    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            found = json.loads((Path(path) / name).read_text()).get("processor_class")
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return None


def processor_for(model_cfg):
    """The policy's processor (`uses_vision`, paths.py), or None for a text-only policy."""
    if not uses_vision(model_cfg):
        return None
    return build_tiny_processor() if model_cfg.path is None else load_processor(model_cfg.path)


def check_rows(processor, records: list) -> None:
    """Rows with images need a vision-language policy."""
    with_images = next((r for r in records if r.images), None)
    if processor is None and with_images is not None:
        raise VisionError(f"prompt {with_images.index} has images but the policy is text-only; train a "
                          f"vision-language model (model.tiny.vision=true, or a Qwen2.5-VL model.path with its "
                          f"processor), or use data without images.")
