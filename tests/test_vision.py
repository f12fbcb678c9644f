"""Vision-language pieces on a CPU: the tiny Qwen2-VL, placeholder expansion, multimodal positions, image rows,
images in the buffer, and the training batch (drops, positions, the trainer's log-probs).

Real parts throughout: `builtin:tiny-vl` built offline, transformers' own Qwen2-VL forward and rope index as
the references, real PNG files.
"""

import base64
import json
from pathlib import Path

import pytest
import torch

from molt_hpc.actor.batch import policy_logprobs
from molt_hpc.actor.head import FUSED_OK
from molt_hpc.actor.vision import ImageInputs
from molt_hpc.algorithm import make_experience
from molt_hpc.buffer.codec import decode_group, encode_group
from molt_hpc.config import MoltConfig
from molt_hpc.data import PromptDataset
from molt_hpc.models import load_causal_lm, load_tokenizer
from molt_hpc.parallel.attention import DocumentAttention, use_document_attention
from molt_hpc.trajectory import Group, TraceImage, Trajectory
from molt_hpc.vision.processor import Vision
from molt_hpc.vision.rope import rope_positions
from tests.conftest import molt, shape_png

QUESTION = [{"type": "image"}, {"type": "text", "text": "What colour?"}]


@pytest.fixture(scope="module")
def vision(tiny_vl_dir) -> Vision:
    return Vision(tiny_vl_dir)


@pytest.fixture(scope="module")
def model(tiny_vl_dir):
    return load_causal_lm(tiny_vl_dir)


def test_tiny_vl_builds_offline_and_reloads(tiny_vl_dir, vision) -> None:
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(tiny_vl_dir, local_files_only=True)
    text, vis = config.text_config, config.vision_config
    assert text.hidden_size // text.num_attention_heads == 64, "a head size vLLM's kernels serve"
    assert vis.embed_dim // vis.num_heads == 64
    assert sum(text.rope_parameters["mrope_section"]) == 64 // 2, "mRoPE covers the rotary half of a head"
    assert json.loads((tiny_vl_dir / "preprocessor_config.json").read_text())["image_processor_type"] == (
        "Qwen2VLImageProcessor"
    ), "a GPU node loads the same settings into its torchvision backend"
    assert type(AutoImageProcessor.from_pretrained(tiny_vl_dir, local_files_only=True)).__name__.endswith("Pil")
    tok = load_tokenizer(tiny_vl_dir)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert pad == config.image_token_id == vision.spec.image_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION * 2}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert sum(t == pad for t in ids) == 2, "one placeholder per image part"
    assert len(tok) == config.text_config.vocab_size == 108


def test_builtin_and_cli_build_tiny_vl(tmp_path) -> None:
    from molt_hpc.models import BUILTINS, resolve_model

    assert "builtin:tiny-vl" in BUILTINS
    cfg = MoltConfig().model.model_copy(update={"path": "builtin:tiny-vl"})
    first = resolve_model(cfg, tmp_path / "cache")
    assert resolve_model(cfg, tmp_path / "cache") == first, "built once, then found"
    result = molt("model", "build-tiny", str(tmp_path / "cli"), "--vl")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="64 or 128"):
        MoltConfig().model.tiny_vl.model_validate({"hidden_size": 128, "num_heads": 4})


@pytest.mark.parametrize(("side", "tokens"), [(28, 1), (56, 4), (100, 4)])
def test_expansion_follows_the_processor_grid(vision, side, tokens) -> None:
    # min_pixels = 28², max_pixels = 56²: an image is resized to a multiple of 28 in that range, and
    # every 2 x 2 block of its 14-pixel patches is one token.
    data = shape_png(side=side)
    grid = vision.grid(data)
    assert vision.tokens(grid) == grid[0] * grid[1] * grid[2] // 4 == tokens
    pad = vision.spec.image_token_id
    ids, placed = vision.expand([9, pad, 10, pad], [data, shape_png("blue", side=56)])
    assert ids == [9] + [pad] * tokens + [10] + [pad] * 4
    assert [(im.offset, im.length) for im in placed] == [(1, tokens), (2 + tokens, 4)]
    with pytest.raises(ValueError, match="2 image placeholder"):
        vision.expand([pad, pad], [data])


def test_rope_positions_match_transformers(model, vision) -> None:
    pad = vision.spec.image_token_id
    ids, placed = vision.expand([9, 9, pad, 10, 11, pad, 12, 13, 14], [shape_png(side=28), shape_png(side=56)])
    mine, delta = rope_positions(len(ids), placed, vision.spec.merge)
    ids_t = torch.tensor([ids])
    types = (ids_t == pad).int()
    grids = torch.tensor([im.grid for im in placed])
    want, want_delta = model.model.get_rope_index(ids_t, mm_token_type_ids=types, image_grid_thw=grids)
    # each image lags by its tokens minus the positions it uses: 1 - 1 for the 1 x 1 grid, 4 - 2 for the 2 x 2
    assert torch.equal(mine, want[:, 0]) and delta == int(want_delta) == -2
    assert torch.equal(rope_positions(5, [], 2)[0], torch.arange(5).expand(3, 5)), "text counts up on every axis"


def _dataset(tmp_path: Path, rows: list[dict], tokenizer, vision, **data) -> PromptDataset:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = MoltConfig().data.model_copy(update={"path": str(tmp_path / "rows.jsonl"), "on_bad_row": "skip"} | data)
    return PromptDataset.load(cfg, tokenizer, vision=vision, max_images=2)


def test_rows_with_images(tmp_path, tiny_vl_dir, vision) -> None:
    (tmp_path / "img").mkdir()
    red, blue = shape_png("red"), shape_png("blue", side=28)
    (tmp_path / "img" / "red.png").write_bytes(red)
    uri = "data:image/png;base64," + base64.b64encode(blue).decode()
    user = {"role": "user", "content": QUESTION}
    rows = [
        {"id": "path", "prompt": [user], "images": ["img/red.png"], "label": "red"},  # relative to the data file
        {"id": "uri", "prompt": [user], "images": [uri], "label": "blue"},
        {"id": "b64", "prompt": [user], "images": [base64.b64encode(blue).decode()], "label": "blue"},
        {"id": "mark", "prompt": "<image>What colour?<image>", "images": ["img/red.png", uri], "label": "x"},
        {
            "id": "inline",
            "prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}],
            "label": "blue",
        },
        {"id": "front", "prompt": "What colour?", "images": ["img/red.png"], "label": "red"},
        {"id": "extra", "prompt": [user], "images": ["img/red.png", uri], "label": "x"},
        {"id": "missing", "prompt": [user], "images": ["img/none.png"], "label": "x"},
        {"id": "three", "prompt": "<image><image><image>", "images": ["img/red.png"] * 3, "label": "x"},
    ]
    tok = load_tokenizer(tiny_vl_dir)
    ds = _dataset(tmp_path, rows, tok, vision)
    got = {p.prompt_id: p for p in ds.prompts}
    assert sorted(got) == ["b64", "front", "inline", "mark", "path", "uri"]
    assert dict(ds.bad_rows) == {"bad images": 2, "too many images": 1}
    pad = vision.spec.image_token_id
    for p in got.values():
        assert sum(t == pad for t in p.token_ids) == sum(im.length for im in p.images)
        assert all(p.token_ids[im.offset : im.end] == [pad] * im.length for im in p.images)
    assert [im.data for im in got["path"].images] == [red] and got["path"].images[0].length == 4
    assert got["uri"].images[0].data == got["b64"].images[0].data == blue and got["uri"].images[0].length == 1
    assert [im.data for im in got["mark"].images] == [red, blue]
    assert got["front"].token_ids == got["path"].token_ids, "images given for plain text go before it"

    text_tok = load_tokenizer(tiny_vl_dir)
    (tmp_path / "rows.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = MoltConfig().data.model_copy(update={"path": str(tmp_path / "rows.jsonl")})
    with pytest.raises(ValueError, match="line 1: rows with images need a vision-language model"):
        PromptDataset.load(cfg, text_tok)  # no vision: a text model
    n = len(got["path"].token_ids)  # with its 4 image tokens; 3 fewer before expansion
    with pytest.raises(ValueError, match=rf"prompt too long \({n} tokens > data.max_prompt_tokens = {n - 1}\)"):
        _dataset(tmp_path, rows[:1], tok, vision, max_prompt_tokens=n - 1, on_bad_row="error")


def test_image_parts_take_the_images_in_order() -> None:
    from molt_hpc.vision.prompt import normalise

    image = {"type": "image"}
    msgs, refs = normalise([{"role": "user", "content": "a<image>b<image>"}], ["x", "y"])
    assert msgs[0]["content"] == [{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}, image]
    assert refs == ["x", "y"]
    inline = {"type": "image_url", "image_url": {"url": "data:u"}}
    msgs, refs = normalise([{"role": "user", "content": [image, inline, {"type": "image", "image": "z"}]}], ["x"])
    assert msgs[0]["content"] == [image] * 3 and refs == ["x", "data:u", "z"]
    sys_user = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    msgs, _ = normalise(sys_user, ["x"])
    assert msgs[0]["content"] == "s" and msgs[1]["content"] == [image, {"type": "text", "text": "q"}]
    msgs, _ = normalise([{"role": "tool", "content": "out"}], ["x"])  # a tool's observation with a screenshot
    assert msgs[0]["content"] == [image, {"type": "text", "text": "out"}]
    with pytest.raises(ValueError, match="more image parts than the 1"):
        normalise([{"role": "user", "content": "<image><image>"}], ["x"])
    with pytest.raises(ValueError, match="2 image"):
        normalise([{"role": "user", "content": "<image>"}], ["x", "y"])


def _sample(
    prompt_ids: list[int], images: list[TraceImage], action: list[int], extra: list[int] = (), **kw
) -> Trajectory:
    tokens = prompt_ids + action + list(extra)
    n = len(prompt_ids)
    return Trajectory(tokens, n, [(n, n + len(action))], [-0.5] * len(action), [0] * len(action), 1.0,
                      images=images, **kw)  # fmt: skip


def test_buffer_stores_each_image_once(vision) -> None:
    pad = vision.spec.image_token_id
    red, blue = shape_png("red"), shape_png("blue")
    ids, images = vision.expand([9, pad, 10], [red])
    second = TraceImage(blue, len(ids) + 3, 4, (1, 4, 4))
    samples = [_sample(ids, images, [20, 21], group_id="g", rollout_id=f"g.s{i}") for i in range(3)]
    samples.append(_sample(ids, [*images, second], [20, 21, 22], [pad] * 4, group_id="g", rollout_id="g.s3"))
    samples.append(Trajectory([5, 6, 7], 2, [(2, 3)], [-1.0], [0], 0.0, group_id="g", rollout_id="g.s4"))
    group = Group("g", "p", samples)
    raw = encode_group(group)
    back = decode_group(raw)
    assert back == group
    from safetensors.numpy import load

    stored = load(raw)
    assert len(stored["image_bytes"]) == len(red) + len(blue), "each distinct image once per group"
    assert stored["image_offsets"].tolist() == [0, 1, 2, 3, 5, 5]
    assert "image_bytes" not in load(encode_group(Group("t", "p", [samples[-1]]))), "text groups carry none"


def test_experience_drops_what_cannot_train(vision) -> None:
    spec, pad = vision.spec, vision.spec.image_token_id
    ids, images = vision.expand([9, 9, pad, 10], [shape_png()])
    ok = _sample(ids, images, [20, 21])
    cut = _sample(ids, images, [20, 21])
    media = _sample(ids, images, [20, pad])
    obs_image = TraceImage(shape_png("blue"), len(ids) + 4, 4, (1, 4, 4))
    two = _sample(ids, [*images, obs_image], [20, 21], [30, 31] + [pad] * 4 + [32])
    exp = make_experience([ok, media, two], max_len=len(ids) + 3, vision=spec, pad_id=0)
    assert exp.stats["media_token"] == 1 and exp.stats["vlm_truncation"] == 0
    assert exp.images[0] == images and exp.images[1] == [] and exp.images[2] == images, "image 2 is past the cut"
    assert not exp.action_mask[exp.seq_index == 1].any(), "a generated image pad: the sample trains nothing"
    assert exp.sequences[1].tolist()[:1] == [0] and exp.attention_mask[1].sum() == 1
    want, _ = rope_positions(len(ok.tokens), images, spec.merge)
    assert torch.equal(exp.rope_position_ids[0, : len(ok.tokens)].T, want)
    assert torch.equal(exp.rope_position_ids[1, :, 0], exp.position_ids[1]), "text positions elsewhere"

    whole = make_experience([two], max_len=obs_image.end, vision=spec)  # the cut right after image 2 keeps it
    assert whole.images == [[*images, obs_image]] and whole.stats["vlm_truncation"] == 0
    inside = make_experience([cut, two], max_len=4, vision=spec)  # the cut falls inside the first image's pads
    assert inside.stats["vlm_truncation"] == 2 and inside.num_action_tokens == 0 and inside.images == [[], []]
    with pytest.raises(ValueError, match="VisionSpec"):
        make_experience([ok], max_len=64)


def test_trainer_logprobs_match_the_model_alone(tiny_vl_dir, vision, model) -> None:
    """Packed rows (document attention) and padded rows give every sample the log-probs of its own forward
    with its pixels; a micro-batch without images (a dummy-image row added) those of a text forward."""
    pad = vision.spec.image_token_id
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(8, 100, (n,), generator=g).tolist()

    ids_a, ims_a = vision.expand([*rand(3), pad, *rand(4)], [shape_png("green")])
    ids_b, ims_b = vision.expand([*rand(2), pad, *rand(2), pad, *rand(3)], [shape_png(side=28), shape_png("blue")])
    trajs = [_sample(ids_a, ims_a, rand(5)), _sample(ids_b, ims_b, rand(4)), _sample(rand(6), [], rand(3))]
    inputs = ImageInputs(vision)

    def alone(t: Trajectory) -> torch.Tensor:
        kw = {}
        if t.images:
            pixels, grids = vision.pixels([im.data for im in t.images])
            kw = {"pixel_values": pixels, "image_grid_thw": grids}
        pos = rope_positions(len(t.tokens), t.images, vision.spec.merge)[0][:, None]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.tokens]), position_ids=pos, **kw).logits[0]
        s, e = t.action_ranges[0]
        return torch.log_softmax(logits[s - 1 : e - 1], -1).gather(-1, torch.tensor(t.tokens[s:e])[:, None]).view(-1)

    packed_model = load_causal_lm(tiny_vl_dir)
    use_document_attention(packed_model, DocumentAttention("sdpa", torch.device("cpu")))
    full_logits = load_causal_lm(tiny_vl_dir)
    setattr(full_logits, FUSED_OK, False)  # the fallback: log-probs from the model's full logits
    for m, pack in ((model, False), (packed_model, True), (full_logits, False)):
        exp = make_experience(trajs, max_len=64, pack=pack, vision=vision.spec)
        with torch.no_grad():
            logp, _ = policy_logprobs(m, exp, 1.0, 8, images=inputs)
        for n, t in enumerate(trajs):
            got = logp[exp.seq_index == n][exp.action_mask[exp.seq_index == n]]
            assert torch.allclose(got, alone(t), atol=1e-5), (pack, n, (got - alone(t)).abs().max())
    # Qwen2-VL's head is a plain tied linear layer: the fused log-probs (hidden states x head weight) serve it
    assert getattr(model, FUSED_OK) is True and getattr(packed_model, FUSED_OK) is True
    text_only = make_experience(trajs[2:], max_len=64, vision=vision.spec)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, text_only, 1.0, 8, images=inputs)
    assert logp.shape == text_only.sequences.shape, "the dummy-image row is not in the output"
    got = logp[text_only.action_mask]
    assert torch.allclose(got, alone(trajs[2]), atol=1e-5)
