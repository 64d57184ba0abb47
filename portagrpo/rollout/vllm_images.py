"""Vision-language requests for the vLLM engine (rollout/vllm.py): a row's prompt and images as vLLM takes them.

How vLLM takes an image (read in vLLM 0.32.0: vllm/multimodal/parse.py, multimodal/processing/processor.py,
model_executor/models/qwen2_vl.py and qwen2_5_vl.py): a `TokensPrompt` with `multi_modal_data={"image": [...]}`
of raw images (PIL images, or HxWx3 uint8 arrays). vLLM's processor (the HF processor of the model directory) resizes
and patches each image, the vision tower runs on the patches with the engine's own weights, and the image's
placeholder in the prompt ids is replaced by its image tokens: for Qwen2.5-VL one `<|image_pad|>` per image becomes
grid_t * grid_h * grid_w / merge^2 of them (a `PromptReplacement` whose target is the one token), matched left to
right. That replacement is applied to every tokenized prompt, so pads the trainer's processor has already expanded
would be expanded again: the first pad of an image's run replaced by the whole run, 2N-1 pads, without an error.
The other form vLLM's Qwen2-VL data parser takes, a dict of `image_embeds` and `image_grid_thw`, hands over the
vision tower's output and skips the tower, so the pushed tower weights would go unused.

So a row goes to vLLM with each image's run of pads collapsed to one, and with its images as the trainer's
processor saw them: each image recovered from its patches (the patching and the rescale/normalisation undone,
rounded to the uint8 pixels they came from), at the size the processor resized it to. vLLM's processor keeps that
size (its sides are multiples of patch x merge within the processor's pixel bounds, and transformers' PIL and
torchvision image processors both leave a resize to the same size untouched), so vLLM's patches are the trainer's,
whichever image processor either side uses. vLLM answers with the prompt ids it sampled from (expanded); they must be
the trainer's, or the engine stops with one sentence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from portagrpo.errors import UserError


@dataclass(frozen=True)
class ImageGeometry:
    """How the trainer's image processor (Qwen2-VL's) turned an image into patches."""

    patch: int
    merge: int
    temporal: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float  # 1 when the processor does not rescale

    @classmethod
    def of(cls, image_processor) -> "ImageGeometry":
        p = image_processor
        channels = len(p.image_mean) if p.do_normalize else 3
        mean = tuple(float(m) for m in p.image_mean) if p.do_normalize else (0.0,) * channels
        std = tuple(float(s) for s in p.image_std) if p.do_normalize else (1.0,) * channels
        return cls(int(p.patch_size), int(p.merge_size), int(p.temporal_patch_size), mean, std,
                   float(p.rescale_factor) if p.do_rescale else 1.0)

    def tokens(self, grid: list[int]) -> int:
        """An image's tokens in the prompt: its patches, merged merge x merge."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)


@dataclass(frozen=True)
class RawImage:
    """One image as the trainer's processor resized it: height x width RGB, uint8, row-major."""

    height: int
    width: int
    rgb: bytes

    def pil(self):
        from PIL import Image

        return Image.frombytes("RGB", (self.width, self.height), self.rgb)


def unpatch(patches: torch.Tensor, grid: list[int], geometry: ImageGeometry) -> RawImage:
    """The image that Qwen2-VL's image processor made `patches` [t*h*w, C*T*P*P] from (grid [t, h, w]): the patch
    layout (merge blocks, then channels, frames, rows and columns of a patch) and the rescale/normalisation undone,
    the first of the temporal frames (an image's frames are copies of it)."""
    g = geometry
    t, h, w = grid
    if t != 1:
        raise ValueError(f"an image has one temporal patch, this one {t}")
    channels = len(g.mean)
    x = patches.detach().to("cpu", torch.float64).reshape(h // g.merge, w // g.merge, g.merge, g.merge, channels,
                                                           g.temporal, g.patch, g.patch)[:, :, :, :, :, 0]
    # (blocks h, blocks w, merge h, merge w, C, P h, P w) -> (C, blocks h, merge h, P h, blocks w, merge w, P w)
    x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(channels, h * g.patch, w * g.patch)
    mean = torch.tensor(g.mean, dtype=torch.float64).view(-1, 1, 1)
    std = torch.tensor(g.std, dtype=torch.float64).view(-1, 1, 1)
    pixels = ((x * std + mean) / g.rescale).round().clamp(0, 255).to(torch.uint8)
    return RawImage(h * g.patch, w * g.patch, pixels.permute(1, 2, 0).contiguous().numpy().tobytes())


@dataclass(frozen=True)
class VisionPrompt:
    """One row's request: its prompt ids as the trainer has them (each image's pads expanded) and its images. Equal
    rows (a group's n samples) are equal requests, which go to vLLM as one request for n samples."""

    ids: tuple[int, ...]
    images: tuple[RawImage, ...]
    image_token_id: int
    image_tokens: tuple[int, ...]  # each image's pads in `ids`

    def collapsed(self) -> list[int]:
        """The prompt ids with each image's run of pads as one pad, for vLLM to expand once."""
        out, at, runs = [], 0, 0
        ids = list(self.ids)
        while at < len(ids):
            if ids[at] != self.image_token_id:
                out.append(ids[at])
                at += 1
                continue
            end = at
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            if runs >= len(self.image_tokens) or end - at != self.image_tokens[runs]:
                raise UserError(f"a prompt's image tokens do not match its images (a run of {end - at} "
                                f"<|image_pad|> where its image {runs} has {self._expected(runs)}); a prompt's text "
                                f"must not contain image tokens of its own.")
            out.append(self.image_token_id)
            runs, at = runs + 1, end
        if runs != len(self.image_tokens):
            raise UserError(f"a prompt has {len(self.image_tokens)} image(s) but {runs} run(s) of image tokens; every "
                            f"image needs its <image> placeholder in the prompt.")
        return out

    def _expected(self, index: int) -> str:
        return f"{self.image_tokens[index]}" if index < len(self.image_tokens) else "none"

    def request(self, tokens_prompt) -> Any:
        return tokens_prompt(prompt_token_ids=self.collapsed(),
                             multi_modal_data={"image": [image.pil() for image in self.images]})


def vision_requests(rows: list[list[int]], images, geometry: ImageGeometry, image_token_id: int) -> list:
    """Each row's request: a `VisionPrompt` for a row whose prompt has images (one object per prompt, shared by its
    rows), its plain ids otherwise. `images`: the rows' `PromptImages` (model/vision.py)."""
    per_prompt: dict[int, VisionPrompt | None] = {}
    out: list = []
    for ids, prompt in zip(rows, images.row_prompt):
        if prompt not in per_prompt:
            per_prompt[prompt] = _prompt_request(ids, images, prompt, geometry, image_token_id)
        request = per_prompt[prompt]
        out.append(ids if request is None else request)
    return out


def _prompt_request(ids: list[int], images, prompt: int, geometry: ImageGeometry,
                    image_token_id: int) -> VisionPrompt | None:
    first, last = images.image_spans[prompt]
    if first == last:
        return None
    grids = images.grid_thw[first:last].tolist()
    raw, at = [], images.patch_spans[prompt][0]
    for grid in grids:
        count = grid[0] * grid[1] * grid[2]
        raw.append(unpatch(images.pixel_values[at:at + count], grid, geometry))
        at += count
    return VisionPrompt(tuple(ids), tuple(raw), image_token_id, tuple(geometry.tokens(g) for g in grids))


def vllm_prompt(request, tokens_prompt):
    """A request as vLLM's `TokensPrompt`: plain ids, or a `VisionPrompt` with its images."""
    return request.request(tokens_prompt) if isinstance(request, VisionPrompt) else tokens_prompt(
        prompt_token_ids=request)


def check_expanded(requests: list, answers: list) -> None:
    """vLLM's prompt ids (its processor's expansion) must be the trainer's: the sampler's context is the scorer's."""
    for request, answer in zip(requests, answers):
        seen = getattr(answer, "prompt_token_ids", None)
        if isinstance(request, VisionPrompt) and seen is not None and list(seen) != list(request.ids):
            _expanded_differently(request, list(seen))


def _expanded_differently(request: "VisionPrompt", seen: list[int]) -> None:
    ours = sum(request.image_tokens)
    theirs = sum(1 for t in seen if t == request.image_token_id)
    raise UserError(f"vLLM expanded a prompt's {len(request.images)} image(s) to {theirs} image tokens ({len(seen)} "
                    f"prompt tokens) where the trainer's processor made {ours} ({len(request.ids)}); vLLM reads the "
                    f"processor of the model directory it loads, whose image settings (min_pixels, max_pixels, "
                    f"patch_size, merge_size) must be the trainer's processor's.")


def check_context(requests: list, max_tokens: int, max_model_len: int | None) -> None:
    """A prompt with its image tokens and a full response must fit vLLM's context, which would otherwise end the
    response early (vLLM caps a request at max_model_len), unlike the hf engine's."""
    if max_model_len is None:
        return
    longest = max((len(r.ids) for r in requests if isinstance(r, VisionPrompt)), default=0)
    if longest + max_tokens > max_model_len:
        raise UserError(f"a prompt with its image tokens has {longest} tokens, which with data.max_response_length="
                        f"{max_tokens} exceeds vLLM's context of {max_model_len}; set rollout.vllm_max_model_len to "
                        f"at least {longest + max_tokens}, or use smaller images (the processor's max_pixels).")


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to send a vision-language policy's rows: the processor's geometry and the image token."""

    geometry: ImageGeometry
    image_token_id: int

    @classmethod
    def of(cls, policy, model_path: str, precision: str = "auto") -> "VisionSpec | None":
        """For a vision-language policy, from the processor in the directory vLLM loads (the trainer's own: the run's
        initial model, or model.path); None for a text-only policy."""
        from portagrpo.model.vision import hf_config, is_vision_language, load_processor

        if not is_vision_language(policy):
            return None
        if precision == "fp8":
            raise UserError("rollout.precision=fp8 is not built for a vision-language policy (its vision tower's "
                            "layers are left out of the block-FP8 checkpoint); use rollout.precision=auto.")
        processor = load_processor(model_path)
        return cls(ImageGeometry.of(processor.image_processor), int(hf_config(policy).image_token_id))
