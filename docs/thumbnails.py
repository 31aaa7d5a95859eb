"""Draw the shipped workflows' thumbnails (``workflows/<name>.jpg``, what ComfyUI's Browse Templates
shows for a custom node's template: ``/api/workflow_templates/<pack>/<name>.jpg``).

Each is an illustrative card, not a rendered frame: the tiny test models' output is noise, and the
real models do not run here. It names what the workflow makes and sketches how: the prompt, the
pool's GPUs, the result. Run with any Python that has Pillow (ComfyUI's has it)::

    /path/to/comfy-venv/bin/python docs/thumbnails.py
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
SIZE = 512
FONTS = Path("/usr/share/fonts/truetype/dejavu")
INK, DIM, ACCENT, GPU, CARD = (236, 239, 244), (150, 160, 178), (255, 170, 60), (90, 170, 255), (38, 44, 58)


def font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    path = FONTS / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")
    return ImageFont.truetype(str(path), size) if path.is_file() else ImageFont.load_default(size)


def canvas() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(img)
    for y in range(SIZE):  # a dark vertical gradient
        t = y / SIZE
        draw.line([(0, y), (SIZE, y)], fill=(int(18 + 14 * t), int(22 + 12 * t), int(34 + 18 * t)))
    return img, draw


def header(draw: ImageDraw.ImageDraw, title: str, subtitle: str) -> None:
    draw.text((28, 26), "LTX-2 Multi-GPU", font=font(18, True), fill=ACCENT)
    draw.text((28, 52), title, font=font(34, True), fill=INK)
    draw.text((28, 96), subtitle, font=font(17), fill=DIM)


def box(draw: ImageDraw.ImageDraw, xy, label: str, sub: str = "", colour=CARD, outline=(70, 80, 100)) -> None:
    draw.rounded_rectangle(xy, radius=10, fill=colour, outline=outline, width=2)
    x0, y0, x1, y1 = xy
    f, g = font(16, True), font(13)
    w = draw.textlength(label, font=f)
    draw.text(((x0 + x1 - w) / 2, y0 + (10 if sub else (y1 - y0 - 18) / 2)), label, font=f, fill=INK)
    if sub:
        w = draw.textlength(sub, font=g)
        draw.text(((x0 + x1 - w) / 2, y0 + 32), sub, font=g, fill=DIM)


def arrow(draw: ImageDraw.ImageDraw, start, end, colour=DIM) -> None:
    draw.line([start, end], fill=colour, width=3)
    ang = math.atan2(end[1] - start[1], end[0] - start[0])
    for side in (-0.5, 0.5):
        draw.line([end, (end[0] - 12 * math.cos(ang + side), end[1] - 12 * math.sin(ang + side))], fill=colour,
                  width=3)


def gpus(draw: ImageDraw.ImageDraw, x: int, y: int, label: str, n: int = 4) -> None:
    """A pool: ``n`` GPU chips side by side, one share of the work each."""
    draw.rounded_rectangle((x, y, x + 456, y + 92), radius=12, outline=GPU, width=2)
    draw.text((x + 12, y + 8), label, font=font(14, True), fill=GPU)
    for i in range(n):
        cx = x + 16 + i * 110
        draw.rounded_rectangle((cx, y + 32, cx + 96, y + 80), radius=6, fill=(30, 60, 96), outline=GPU, width=1)
        draw.text((cx + 22, y + 47), f"GPU {i}", font=font(14, True), fill=INK)


def film(draw: ImageDraw.ImageDraw, x: int, y: int) -> None:
    """A strip of frames over a sound wave: video with its audio track."""
    palette = [(250, 140, 60), (240, 110, 70), (220, 90, 90), (190, 80, 120)]
    for i, c in enumerate(palette):
        fx = x + i * 112
        draw.rectangle((fx, y, fx + 100, y + 62), fill=c)
        draw.ellipse((fx + 60 - 6 * i, y + 12, fx + 84 - 6 * i, y + 36), fill=(255, 230, 180))  # a sun that moves
        draw.polygon([(fx, y + 62), (fx + 40, y + 30), (fx + 100, y + 62)], fill=(60, 40, 50))
    points = [(x + k * 4, y + 92 + 14 * math.sin(k / 3.0) * math.sin(k / 17.0)) for k in range(113)]
    draw.line(points, fill=ACCENT, width=3)


def text_to_video() -> Image.Image:
    img, d = canvas()
    header(d, "Text to video + sound", "one prompt, LTX-2 split over your GPUs")
    box(d, (28, 136, 484, 184), "\u201cA red fox trots through fresh snow\u2026\u201d", colour=(48, 52, 64))
    arrow(d, (256, 186), (256, 214))
    gpus(d, 28, 218, "the pool: Gemma 3, then the SP Sampler")
    arrow(d, (256, 312), (256, 340))
    film(d, 32, 348)
    d.text((28, 474), "MP4 with its audio track", font=font(16, True), fill=INK)
    return img


def encode_core_sampler() -> Image.Image:
    img, d = canvas()
    header(d, "Any ComfyUI sampler", "its own loop; each model call on every GPU")
    box(d, (28, 136, 236, 196), "ComfyUI sampler", "CFGGuider \u00b7 LTXVScheduler")
    box(d, (276, 136, 484, 196), "Model Loader", "comfy_model (MODEL)")
    arrow(d, (236, 166), (276, 166), ACCENT)
    arrow(d, (380, 198), (380, 226))
    gpus(d, 28, 230, "each call: sequence-parallel in the pool")
    arrow(d, (256, 324), (256, 350))
    film(d, 32, 356)
    d.text((28, 474), "MP4 with its audio track", font=font(16, True), fill=INK)
    return img


def precompute_prompts() -> Image.Image:
    img, d = canvas()
    header(d, "Precompute prompts", "a prompt list into the embedding cache")
    lines = ["A red fox trots through fresh snow\u2026", "A lighthouse on a cliff in a storm\u2026",
             "A busy night market in the rain\u2026", "A paper boat drifts down a gutter\u2026"]
    d.rounded_rectangle((28, 136, 484, 250), radius=10, fill=(48, 52, 64))
    for i, line in enumerate(lines):
        d.text((44, 146 + 25 * i), line, font=font(15), fill=INK)
    arrow(d, (256, 252), (256, 280))
    gpus(d, 28, 284, "Gemma 3 on each GPU, the prompts split")
    arrow(d, (256, 378), (256, 404))
    box(d, (96, 408, 416, 480), "embedding cache", "later runs never load Gemma", colour=(40, 70, 50),
        outline=(90, 200, 120))
    return img


CARDS = {"ltx_mgpu_text_to_video": text_to_video, "ltx_mgpu_encode_core_sampler": encode_core_sampler,
         "ltx_mgpu_precompute_prompts": precompute_prompts}


def main() -> None:
    for name, draw in CARDS.items():
        out = REPO / "workflows" / f"{name}.jpg"
        draw().save(out, "JPEG", quality=88, optimize=True)
        print(out)


if __name__ == "__main__":
    main()
