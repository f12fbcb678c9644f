"""Images for vision-language models: from a dataset row or an env to placeholder tokens and pixels.

spec.py       `VisionSpec`: a model directory's vision token ids and merge size (no torch)
images.py     image references (paths, data URIs, base64, bytes, PIL images) to encoded bytes and back
rope.py       Qwen2-VL's multimodal (3-D) rotary positions of a token sequence with images (pure)
prompt.py     chat messages with image parts: the `<image>` mark, inline `image_url`s, the template's
              placeholders expanded to each image's token count, once (token in, trace out)
processor.py  `Vision`: a model directory's image processor and vision token ids (PIL backend, no
              torchvision), grids and pixel values of encoded images

Importing this package loads neither transformers nor PIL; the modules that need them import them.
"""
