"""The prompt dataset (step 1 of the RL loop): rows, chat templating, length-balanced order, a cursor.

Rows are objects `{"prompt": str | [chat messages], "label": ..., "tools": [...]?, "id": str?, "images": [...]?,
...}` from a JSONL file, a Parquet file or a `datasets.save_to_disk` directory (`molt_hpc.readers`;
`data.prompt_key` / `data.label_key` may be dotted paths such as `reward_model.ground_truth`); other keys
(ids, metadata) ride along in `Prompt.extra`. For a
vision-language model, image parts of the messages (and `<image>` marks) take the row's images (paths
relative to the data file, data URIs, base64): the images are read once, and their placeholders are
expanded to each image's token count before the length check (`molt_hpc.vision.prompt`).

Each epoch's order is a pure function of (seed, epoch): rows sorted by prompt length are cut into
`data.length_buckets` buckets, shuffled within each bucket, and drawn cycling through the buckets,
so every run of consecutive draws mixes short and long prompts alike. The `Cursor` is just
(epoch, position) over that order; saving and restoring it means no prompt is skipped or repeated.
"""

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_hpc.config.model import DataConfig
from molt_hpc.log import get_logger
from molt_hpc.readers import MISSING, exists, iter_rows, kind, row_value
from molt_hpc.trajectory import TraceImage
from molt_hpc.vision.images import image_bytes
from molt_hpc.vision.prompt import normalise

ROLES = ("system", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image", "image_url")


@dataclass(frozen=True)
class Prompt:
    """One dataset row, validated and tokenised."""

    prompt_id: str
    """Stable id: the row's `id`, else `<file name>:<line>`."""
    row_index: int
    """Index among the file's valid rows."""
    prompt: str | list[dict[str, Any]]
    """The prompt as written in the row (text or chat messages)."""
    label: Any
    """The row's label, passed to the environment."""
    token_ids: list[int]
    """The prompt after chat templating, tokenised once."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key of the row (`tools`, `id`, the image references, metadata)."""
    images: tuple[TraceImage, ...] = ()
    """Vision-language models: the prompt's images, placed at their (expanded) placeholder runs."""


NO_VISION = (
    "image parts need a vision-language model: model.path must name one (its config.json has a vision_config), "
    "e.g. builtin:tiny-vl"
)


def message_problem(msg: Any, vision: bool = False) -> str | None:
    if not isinstance(msg, dict) or msg.get("role") not in ROLES:
        return f"each chat message must be an object with a role in {ROLES}"
    content = msg.get("content")
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not all(isinstance(p, dict) and "type" in p for p in content):
        return "a message's content must be text or a list of typed parts"
    if any(p["type"] in IMAGE_PART_TYPES for p in content) and not vision:
        return NO_VISION
    if any(p["type"] not in IMAGE_PART_TYPES and (p["type"] != "text" or not isinstance(p.get("text"), str))
           for p in content):  # fmt: skip
        return "only text and image parts ({'type': 'text', 'text': ...}, {'type': 'image'}) are supported"
    return None


def text_prompt_ids(tokenizer, row: dict, cfg) -> list[int]:
    """The prompt tokens of a text row (no images), as the dataset and the pre-flight render it."""
    return render_prompt(
        tokenizer,
        row_value(row, cfg.prompt_key),
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
        tools=row.get("tools"),
    )


def row_problem(row: Any, cfg: DataConfig, vision: bool = False) -> str | None:
    """What is wrong with a parsed row, or None when it is usable (before the length check); `vision`:
    the model is a vision-language model."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    if row_value(row, cfg.prompt_key) is MISSING:
        return f"missing {cfg.prompt_key!r}"
    if row_value(row, cfg.label_key) is MISSING:
        return f"missing {cfg.label_key!r}"
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "'tools' must be a list of objects (tool schemas)"
    images = row.get(cfg.image_key)
    if images is not None and not isinstance(images, list):
        return f"{cfg.image_key!r} must be a list of images (paths, data URIs or base64)"
    if images and not vision:
        return NO_VISION.replace("image parts", "rows with images")
    if images and not cfg.apply_chat_template:
        return "images need data.apply_chat_template = true (the template writes their placeholders)"
    prompt = row_value(row, cfg.prompt_key)
    if isinstance(prompt, str):
        return None if prompt.strip() else f"{cfg.prompt_key!r} is empty"
    if not isinstance(prompt, list) or not prompt:
        return f"{cfg.prompt_key!r} must be text or a non-empty list of chat messages, got {type(prompt).__name__}"
    if not cfg.apply_chat_template:
        return "chat-message prompts need data.apply_chat_template = true"
    for msg in prompt:
        if problem := message_problem(msg, vision):
            return problem
    return None


def as_messages(prompt: str | list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """Chat messages of a prompt; `system_prompt` is prepended unless the prompt has its own system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template (with the generation prompt), or raw."""
    if not apply_chat_template:
        assert isinstance(prompt, str), "raw prompts are text"
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: set data.apply_chat_template = false")
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        as_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=False, **kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt_images(
    tokenizer: Any,
    vision: Any,
    prompt: str | list[dict[str, Any]],
    images: list[Any],
    *,
    base_dir: Path | None = None,
    system_prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[TraceImage]]:
    """A vision-language prompt: token ids with every image's placeholders expanded, and its images placed
    there. `images` are references (`molt_hpc.vision.images`), paths relative to `base_dir`."""
    messages, refs = normalise(as_messages(prompt, system_prompt), images)
    datas = [image_bytes(ref, base_dir) for ref in refs]
    return vision.expand(render_prompt(tokenizer, messages, tools=tools), datas)


class PromptDataset:
    """The validated, tokenised rows of one data file."""

    def __init__(self, prompts: list[Prompt], path: str, bad_rows: Counter | None = None):
        if not prompts:
            raise ValueError(f"{path}: no usable rows; check data.path and data.prompt_key / data.label_key")
        self.prompts = prompts
        self.path = path
        self.bad_rows = bad_rows or Counter()
        """Skipped rows by reason (`on_bad_row = "skip"`)."""

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    @property
    def fingerprint(self) -> str:
        """Identifies the row set, so a cursor is never restored onto a different dataset."""
        return hashlib.sha256("\n".join(p.prompt_id for p in self.prompts).encode()).hexdigest()[:16]

    @classmethod
    def load(
        cls,
        cfg: DataConfig,
        tokenizer: Any,
        path: str | None = None,
        limit: int | None = None,
        *,
        vision: Any = None,
        max_images: int | None = None,
    ):
        """Read and check `path` (default `cfg.path`); bad rows raise or are skipped per `cfg.on_bad_row`.
        `vision` (a `molt_hpc.vision.processor.Vision`) lets rows carry images, at most `max_images` each."""
        path = path or cfg.path
        if not exists(path):
            raise ValueError(f"data file {path} not found (data.path is relative to the working directory)")
        unit = "line" if kind(path) == "jsonl" else "row"
        prompts: list[Prompt] = []
        bad: Counter = Counter()
        for number, row, problem in iter_rows(path):
            if limit is not None and len(prompts) >= limit:
                break
            where = _Where(Path(path), number, len(prompts))
            prompt = None
            if problem is None:
                prompt, problem = _parse_row(row, where, cfg, tokenizer, vision, max_images)
            if problem is None:
                prompts.append(prompt)
            elif cfg.on_bad_row == "skip":
                bad[problem.split(" (")[0]] += 1
            else:
                raise ValueError(f'{path}, {unit} {number}: {problem}; fix the row or set data.on_bad_row = "skip"')
        if bad:
            get_logger().warning("%s: skipped %d bad rows: %s", path, sum(bad.values()), dict(bad))
        return cls(prompts, str(path), bad)


@dataclass(frozen=True)
class _Where:
    path: Path
    line_no: int
    index: int


def _parse_row(
    row: Any, where: _Where, cfg: DataConfig, tokenizer: Any, vision: Any, max_images: int | None
) -> tuple[Prompt | None, str | None]:
    if problem := row_problem(row, cfg, vision is not None):
        return None, problem
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.label_key)}
    images: list[TraceImage] = []
    if vision is None:
        ids = text_prompt_ids(tokenizer, row, cfg)
    else:
        try:
            ids, images = render_prompt_images(
                tokenizer, vision, row_value(row, cfg.prompt_key), row.get(cfg.image_key) or [],
                base_dir=where.path.parent, system_prompt=cfg.system_prompt, tools=row.get("tools"),
            )  # fmt: skip
        except ValueError as err:
            return None, f"bad images ({err})"
        if max_images is not None and len(images) > max_images:
            return None, f"too many images ({len(images)} > rollout.max_images = {max_images})"
    if len(ids) > cfg.max_prompt_tokens:
        return None, f"prompt too long ({len(ids)} tokens > data.max_prompt_tokens = {cfg.max_prompt_tokens})"
    prompt_id = str(row["id"]) if "id" in row else f"{where.path.name}:{where.line_no}"
    prompt, label = row_value(row, cfg.prompt_key), row_value(row, cfg.label_key)
    return Prompt(prompt_id, where.index, prompt, label, ids, extra, tuple(images)), None


def epoch_order(lengths: list[int], buckets: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Row indices of one epoch: sorted by length, cut into buckets, shuffled inside each, drawn round-robin."""
    ranked = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n_buckets = max(1, min(buckets, len(ranked)))
    parts = [ranked[b * len(ranked) // n_buckets : (b + 1) * len(ranked) // n_buckets] for b in range(n_buckets)]
    if shuffle:
        rng = random.Random(f"molt-data:{seed}:{epoch}")  # str seeds hash the same in every process
        for part in parts:
            rng.shuffle(part)
    longest = max(len(p) for p in parts)
    return [part[r] for r in range(longest) for part in parts if r < len(part)]


@dataclass(frozen=True)
class Position:
    """Where a draw came from: the epoch and the index in that epoch's order."""

    epoch: int
    index: int

    @property
    def group_id(self) -> str:
        """Deterministic group id: a re-issued draw gets the same id, so the buffer can refuse a duplicate."""
        return f"e{self.epoch}-i{self.index}"


class Cursor:
    """A deterministic, resumable walk over the dataset, epoch after epoch."""

    def __init__(self, dataset: PromptDataset, cfg: DataConfig, seed: int, epoch: int = 0, position: int = 0):
        self.dataset = dataset
        self.buckets = cfg.length_buckets
        self.shuffle = cfg.shuffle
        self.seed = seed
        self.epoch = epoch
        self.position = position
        self._lengths = [len(p.token_ids) for p in dataset.prompts]
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self._lengths, self.buckets, self.seed, epoch, self.shuffle)}
        return self._orders[epoch]

    def at(self, pos: Position) -> Prompt:
        """The prompt drawn at `pos` (to re-issue it after a restart)."""
        return self.dataset[self.order(pos.epoch)[pos.index]]

    def next(self) -> tuple[Prompt, Position]:
        """The next prompt and where it came from; moves past the end of an epoch into the next."""
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        pos = Position(self.epoch, self.position)
        self.position += 1
        return self.at(pos), pos

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "dataset": self.dataset.fingerprint}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved `state()`; refuses one saved for another dataset or seed."""
        if state["dataset"] != self.dataset.fingerprint or state["seed"] != self.seed:
            raise ValueError(
                f"the saved data cursor belongs to another dataset or seed (dataset {state['dataset']}, seed "
                f"{state['seed']}; now {self.dataset.fingerprint}, {self.seed}): keep data.path and run.seed "
                "unchanged when resuming, or start a new run"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
