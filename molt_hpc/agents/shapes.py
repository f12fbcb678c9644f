"""The synthetic visual task's images: one coloured shape on a light background, drawn deterministically.

`draw(colour, shape, seed)` is a 56 x 56 RGB image (four image tokens for `builtin:tiny-vl`) of a
circle, square or triangle in pure red, green or blue, its size and position jittered by `seed`, on
a grey that varies a little too: the colour is the only thing that tells the answer.
`data/make_datasets.py` writes the shipped PNGs with it; the two-turn env draws its second image.
"""

import random

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (40, 60, 220)}
SHAPES = ("circle", "square", "triangle")
SIDE = 56


def draw(colour: str, shape: str, seed: int):
    """The image (a PIL image) of `shape` in `colour`, jittered by `seed`."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"shape:{colour}:{shape}:{seed}")
    grey = rng.randint(200, 245)
    image = Image.new("RGB", (SIDE, SIDE), (grey, grey, grey))
    size = rng.randint(24, 40)
    x, y = rng.randint(4, SIDE - size - 4), rng.randint(4, SIDE - size - 4)
    box = [x, y, x + size, y + size]
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def colour_reward(answer: str, label: str) -> float:
    """1 for the colour's name (surrounding whitespace aside), else the length of the prefix it gets right
    over the longer of the two: partial credit a policy learns the spelling from, starting with the
    first letter, which names the colour (r, g, b). A fixed answer's first letter is at most one label's,
    so a policy blind to the image averages at most 1/3."""
    answer = answer.strip()
    right = 0
    for a, b in zip(answer, label, strict=False):
        if a != b:
            break
        right += 1
    longest = max(len(answer), len(label))
    return right / longest if longest else 0.0
