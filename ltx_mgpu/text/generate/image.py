"""An image for Gemma 3's vision tower, prepared exactly as ComfyUI 0.20.1 prepares it:
:func:`tokenizer_image` (its tokenizer's step), :func:`vision_pixels` (its model's step).

ComfyUI's ``TextGenerate`` / ``TextGenerateLTX2Prompt`` pass a ComfyUI ``IMAGE`` (``[B, H, W, C]``
float, 0..1) to ``clip.tokenize(image=...)``:

1. ``Gemma3_Tokenizer.tokenize_with_weights`` (``comfy/text_encoders/lt.py``) scales it to about
   896 x 896 pixels keeping its aspect ratio: ``scale = sqrt(896 * 896 / (W * H))``, the new
   width and height Python's ``round`` of ``W * scale`` and ``H * scale``, resampled with
   ``torch.nn.functional.interpolate(mode="area")`` (``comfy.utils.common_upscale`` with
   ``"area"``, no crop), then keeps the first three channels. The whole batch is one image entry:
   it replaces the prompt's first ``<image_soft_token>``.
2. ``Gemma3_12B.preprocess_embed`` (``comfy/text_encoders/llama.py``) runs
   ``comfy.clip_model.clip_preprocess(size=image_size, mean=std=[0.5] * 3, crop=True)``: resized
   (bicubic, antialiased) so that the shorter side is ``image_size`` (each side Python's
   ``round`` of ``side * image_size / shorter``), unless it is already ``image_size`` square;
   centre-cropped to ``image_size`` square (the offset ``(side - image_size) // 2``); quantized to
   ``round(clip(255 x, 0, 255)) / 255``; normalized to ``(x - 0.5) / 0.5``.

Step 1 runs where ComfyUI's tokenizer runs (the CLIP's ``tokenize``, ComfyUI's process); its
result travels to the pool as raw float32 bytes, where step 2 runs with the loaded vision tower's
``image_size`` (``ltx_mgpu.pool.generate_jobs``), image by image (the same values as the batch at
once; the peak is one image's resize).

Where ltx_mgpu refuses what ComfyUI runs: an image whose long side is more than
:data:`MAX_ASPECT` times its short side. Step 2 resizes the short side to ``image_size`` (896),
so the long side grows with the ratio: a 1 x 1000 strip becomes 28 x 28,334 pixels in step 1 and
896 x 906,688 float32 pixels (9.7 GB) in step 2, of which the tower reads the centre 896 x 896.
The pool, which gets step 1's result, also refuses one larger than step 1 leaves an image
(:func:`check_tokenized`: a client that skipped it), on every rank before any work.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ltx_mgpu.finite import is_finite

__all__ = ["TOKENIZER_PIXELS", "MAX_IMAGES", "MAX_ASPECT", "check_image", "check_tokenized", "tokenizer_image",
           "vision_pixels"]

#: The pixel count ComfyUI's Gemma 3 tokenizer scales an image to (``896 * 896``).
TOKENIZER_PIXELS = 896 * 896
#: The most images (a batch's frames) one prompt takes: each is a ~9.6 MB float32 frame on the
#: wire and ``mm_tokens_per_image`` (256) prompt tokens.
MAX_IMAGES = 16
#: The largest ratio of an image's long side to its short side (module doc): step 2's resize of
#: one image is then at most 16 x 896 x 896 float32 pixels (154 MB).
MAX_ASPECT = 16


def check_image(image: object, what: str = "the image") -> torch.Tensor:
    """``image`` as a ComfyUI IMAGE: a 4-D floating tensor ``[B, H, W, C]``, 1 <= B <=
    :data:`MAX_IMAGES`, ``C >= 3``, sides at most :data:`MAX_ASPECT` to 1, finite values (one
    reduction, nothing of the image's size allocated).

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    if not isinstance(image, torch.Tensor):
        raise ValueError(f"{what} must be a ComfyUI IMAGE (a torch tensor [B, H, W, C]), got {type(image).__name__}")
    if image.ndim != 4 or not image.is_floating_point():
        raise ValueError(f"{what} must be a ComfyUI IMAGE, a floating tensor [B, H, W, C]; got {image.dtype} of "
                         f"shape {list(image.shape)}")
    b, h, w, c = image.shape
    if c < 3 or h < 1 or w < 1 or b < 1:
        raise ValueError(f"{what} has shape {list(image.shape)}; Gemma 3 reads RGB images [B, H, W, 3] (convert a "
                         "mask or a grey image to RGB first)")
    if b > MAX_IMAGES:
        raise ValueError(f"{what} is a batch of {b} images; give Gemma at most {MAX_IMAGES} (pick the frames first)")
    if max(h, w) > MAX_ASPECT * min(h, w):
        raise ValueError(f"{what} is {w} x {h} pixels, more than {MAX_ASPECT} to 1; Gemma 3 reads the centre square "
                         f"of it, and resizing it for that would take gigabytes: crop it (e.g. ImageCrop) to at most "
                         f"{MAX_ASPECT} to 1 first")
    if not is_finite(image):
        raise ValueError(f"{what} holds NaN or infinite values; fix the node that made it")
    return image


def check_tokenized(image: object, what: str = "the image") -> torch.Tensor:
    """``image`` as :func:`tokenizer_image` leaves one: :func:`check_image`'s, three channels, and
    no more pixels per image than step 1's rounding gives (``h * w <= TOKENIZER_PIXELS + (h + w) /
    2``: each side is at most half a pixel over its exact scaled size, whose product is
    ``TOKENIZER_PIXELS``).

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    image = check_image(image, what)
    h, w, c = image.shape[1:]
    if c != 3 or h * w > TOKENIZER_PIXELS + (h + w) / 2 + 1:
        raise ValueError(f"{what} is {w} x {h} pixels of {c} channels, more than ComfyUI's Gemma tokenizer leaves an "
                         "image (about 896 x 896, 3 channels): resize it first with "
                         "ltx_mgpu.text.generate.image.tokenizer_image (the CLIP's generate does)")
    return image


def tokenizer_image(image: torch.Tensor) -> torch.Tensor:
    """Step 1 of the module doc: ``[B, H, W, C]`` -> ``[B, h, w, 3]`` float32 contiguous on the CPU,
    ``h * w`` about :data:`TOKENIZER_PIXELS`.

    Raises:
        ValueError: as :func:`check_image`.
    """
    image = check_image(image)
    samples = image.movedim(-1, 1)
    scale = math.sqrt(TOKENIZER_PIXELS / (samples.shape[3] * samples.shape[2]))
    width, height = round(samples.shape[3] * scale), round(samples.shape[2] * scale)
    out = F.interpolate(samples, size=(height, width), mode="area").movedim(1, -1)
    return check_tokenized(out[..., :3].to(device="cpu", dtype=torch.float32).contiguous())


def vision_pixels(image: torch.Tensor, size: int) -> torch.Tensor:
    """Step 2 of the module doc: ``[B, h, w, 3]`` (:func:`tokenizer_image`'s) -> the vision
    tower's input ``[B, 3, size, size]``, in ``image``'s dtype and device; resized image by image.

    Raises:
        ValueError: as :func:`check_image`.
    """
    image = check_image(image)[..., :3]
    mean = torch.tensor([0.5, 0.5, 0.5], device=image.device, dtype=image.dtype).view(3, 1, 1)
    x = image.movedim(-1, 1)
    if not (x.shape[2] == size and x.shape[3] == size):
        scale = size / min(x.shape[2], x.shape[3])
        scaled = (round(scale * x.shape[2]), round(scale * x.shape[3]))
        top, left = (scaled[0] - size) // 2, (scaled[1] - size) // 2
        x = torch.cat([F.interpolate(one, size=scaled, mode="bicubic", antialias=True)[
            :, :, top:top + size, left:left + size] for one in x.split(1)])
    x = torch.clip(255.0 * x, 0, 255).round() / 255.0
    return (x - mean) / mean
