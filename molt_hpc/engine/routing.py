"""Routing capture in the builtin engine: the experts every forwarded token went to, in vLLM 0.26's format.

vLLM 0.26 with `--enable-return-routed-experts` answers each request with `routed_experts`: base64 of
an `.npy` file of shape `[prompt + generated - 1, layers, top_k]`, one row per position it forwarded
(every token but the last sampled one), global expert ids, uint8 when the model has at most 256
experts else uint16, the layer axis every decoder layer (a dense layer's rows are 0), the first
`sampling_params.routed_experts_prompt_start` rows left out. The builtin engine answers the same,
so router replay runs end to end on a CPU.

Forward hooks on the routers (found by class, `molt_hpc.models.moe`) keep each layer's top-k indices
of the forward in flight; the scheduler hands them to the rows after every prefill and decode step.
A row's routing is written by position: a row re-prefilled after a weight update gets the routing of
the new weights for its whole context (what produced the cache its next tokens attend to).
"""

import base64
import functools
import io
from typing import TYPE_CHECKING

import numpy as np

from molt_hpc.models.moe import find_routers, num_layers

if TYPE_CHECKING:  # no torch at import: the engine client decodes routing in torch-free processes
    import torch


def routing_dtype(num_experts: int) -> type:
    """vLLM's dtype of `routed_experts`: uint8 up to 256 experts, else uint16."""
    return np.uint8 if num_experts <= 256 else np.uint16


def encode_routing(rows: np.ndarray) -> str:
    """`[n, layers, top_k]` as vLLM sends it: base64 of the `.npy` bytes."""
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routing(text: str) -> np.ndarray:
    """The array of a `routed_experts` string (vLLM's or ours); a `ValueError` when it is not one."""
    try:
        rows = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"routed_experts is not a base64 .npy array: {err}") from None
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        raise ValueError(
            f"routed_experts must be an integer [tokens, layers, top_k] array, got {rows.dtype} {rows.shape}"
        )
    return rows


class RowRouting:
    """One request's routing rows by position (`[positions, layers, top_k]`, grown as it goes)."""

    def __init__(self, layers: int, top_k: int, dtype: type):
        self.data = np.zeros((0, layers, top_k), dtype=dtype)
        self.rows = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.data):
            grown = np.zeros((max(end, 2 * len(self.data)), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[: self.rows] = self.data[: self.rows]
            self.data = grown
        self.data[start:end] = rows
        self.rows = max(self.rows, end)

    def encode(self, prompt_start: int) -> str:
        """Rows `[prompt_start, forwarded)`: what vLLM returns for this request."""
        return encode_routing(self.data[prompt_start : self.rows])


class RoutingRecorder:
    """Hooks on every router of `model`; `take` returns the last forward's routing per position."""

    def __init__(self, model):
        routers = find_routers(model)
        if not routers:
            raise ValueError(
                f"actor.router_replay = true but {type(model).__name__} has no MoE router to record: "
                "set actor.router_replay = false for a dense model"
            )
        self.layers = num_layers(model)
        self.top_k = int(routers[0].module.top_k)
        self.dtype = routing_dtype(int(routers[0].module.num_experts))
        self._seen: dict[int, torch.Tensor] = {}
        for r in routers:
            r.module.register_forward_hook(functools.partial(self._hook, r.layer))

    def _hook(self, layer: int, module, args, output) -> None:
        index = output[2]
        assert index.dim() == 2 and index.shape[1] == self.top_k, "a router returns (logits, weights, [T, top_k])"
        self._seen[layer] = index

    def new_row(self) -> RowRouting:
        return RowRouting(self.layers, self.top_k, self.dtype)

    def take(self, rows: int, columns: int) -> np.ndarray:
        """`[rows, columns, layers, top_k]` of the forward just run over `rows × columns` tokens (row-major,
        as the routers saw them); dense layers stay 0."""
        out = np.zeros((rows * columns, self.layers, self.top_k), dtype=self.dtype)
        for layer, index in self._seen.items():
            assert index.shape[0] == rows * columns, "one routing row per token of the forward"
            out[:, layer] = index.cpu().numpy()
        self._seen.clear()
        return out.reshape(rows, columns, self.layers, self.top_k)
