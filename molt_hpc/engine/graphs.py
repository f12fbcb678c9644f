"""CUDA graphs of the engine's decode step (on a GPU unless `engines.enforce_eager`).

A decode step of a small model is hundreds of small kernels whose launch costs (Python, transformers,
the driver) far exceed their run time. `DecodeGraphs` records the whole step, embedding to logits with
the KV writes, once per (batch bucket, width bucket) and replays it. Rows are padded up to the batch
bucket with dummy rows (token 0 at position 0 of free slots; their logits are dropped) and the
attended width is rounded up to a multiple of `WIDTH_STEP` (the mask hides the extra columns), so a
handful of graphs serve every step. Inputs live in static buffers that each step overwrites; the
graphs share one memory pool and only one runs at a time (the scheduler thread). A refit copies new
weights into the same tensors, so the graphs stay valid.

With `sampling`, a second kind of graph records the step *and* the sampling of the common RL case
(`plain_sample`: temperature per row, no top-k/top-p/min-p, no top log-probs, seeded or not): each row's
32 random bits travel in with its token and position, the replay leaves each row's token and its log-prob
in one small buffer, read back in one copy, so no `[b, V]` logits leave the graph and no sampling kernel
is launched from Python. Rows that ask for anything else take the logits graph and `sample_rows`.

A graph is recorded the first time its bucket is needed: one eager warm-up step (it writes the same
K/V the replay will write, so it changes nothing) and the capture. A capture that fails leaves the
runner eager for good, with a warning.
"""

import torch
from torch import Tensor

from molt_hpc.engine.sampling import inverse_cdf
from molt_hpc.log import get_logger

WIDTH_STEP = 128


def batch_bucket(rows: int, most: int) -> int:
    """Rows a graph runs for `rows` live rows: a power of two up to 16, then a multiple of 16."""
    bucket = 1 << max(0, rows - 1).bit_length() if rows <= 16 else -(-rows // 16) * 16
    return min(bucket, most)


def width_bucket(width: int, capacity: int) -> int:
    return min(-(-width // WIDTH_STEP) * WIDTH_STEP, capacity)


def plain_sample(logits: Tensor, temperature: Tensor, bits: Tensor) -> Tensor:
    """`[2, b]` float64: a token per row drawn from softmax(logits / temperature) with its random `bits`
    (`sampling.inverse_cdf`; argmax where the temperature is 0) and its log-prob (at temperature 1 for greedy
    rows), as `processed_logprobs` + `sample` give them without filters: a fixed number of kernels, no host
    sync, no generator state."""
    greedy = temperature <= 0
    z = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    logp = z - torch.logsumexp(z, -1, keepdim=True)
    tokens = torch.where(greedy, z.argmax(-1), inverse_cdf(logp, bits))
    return torch.stack([tokens.double(), logp.gather(1, tokens[:, None]).squeeze(1).double()])


class DecodeGraphs:
    """The decode graphs of one `SlotRunner`, keyed by (batch bucket, width bucket)."""

    def __init__(self, runner, sampling: bool = False) -> None:
        self.runner = runner
        slots = runner.slots
        self.inputs = torch.zeros(3, slots.slots, dtype=torch.long, device=runner.device)
        self.ids = self.inputs[0, :, None]  # [slots, 1] token ids
        self.positions = self.inputs[1]
        self.bits = self.inputs[2]  # each row's random bits (sampling graphs)
        self.temperature = torch.ones(slots.slots, dtype=torch.float32, device=runner.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sampled: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sampling = sampling
        self.pool = torch.cuda.graph_pool_handle()

    def run_sampled(self, last: list[int], positions: list[int], temperatures: list[float], bits: list[int]):
        """(tokens, log-probs) of one decode step with sampling in the graph, or None when this runner
        has no sampling graphs (the caller samples the logits of `run`)."""
        if not self.sampling:
            return None
        n, slots = len(last), self.runner.slots
        b = batch_bucket(n, slots.slots)
        width = width_bucket(max(positions) + 1, slots.capacity)
        pad = [0] * (b - n)
        self.inputs[:, :b].copy_(torch.tensor([last + pad, positions + pad, bits + pad]))
        self.temperature[:b].copy_(torch.tensor(temperatures + [1.0] * (b - n)))
        key = (b, width)
        if key not in self.sampled:
            recorded = self._capture(b, width, sampled=True)
            if recorded is None:
                self.sampling = False
                return None
            self.sampled[key] = recorded
        graph, out = self.sampled[key]
        graph.replay()
        tokens, logps = out[:, :n].tolist()  # the step's one read-back
        return [int(t) for t in tokens], logps

    def run(self, last: list[int], positions: list[int]) -> torch.Tensor:
        """Next-token logits `[len(last), V]` of one decode step (valid until the next step)."""
        n, slots = len(last), self.runner.slots
        b = batch_bucket(n, slots.slots)
        width = width_bucket(max(positions) + 1, slots.capacity)
        pad = [0] * (b - n)
        self.inputs[:, :b].copy_(torch.tensor([last + pad, positions + pad]))  # one host-to-device copy
        key = (b, width)
        if key not in self.graphs:
            recorded = self._capture(b, width)
            if recorded is None:
                return self.runner.step(self.ids[:b], self.positions[:b], width)[:n]
            self.graphs[key] = recorded
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _capture(self, b: int, width: int, sampled: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Record the step for `b` rows at `width` (`sampled`: the step and `plain_sample`)."""

        def step() -> torch.Tensor:
            logits = self.runner.step(self.ids[:b], self.positions[:b], width)
            return plain_sample(logits, self.temperature[:b], self.bits[:b]) if sampled else logits

        side = torch.cuda.Stream(device=self.ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the capture: library handles and workspaces come into being here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = step()
        except RuntimeError:  # this model cannot be captured: serve it eagerly, as enforce_eager would
            get_logger().warning("CUDA graph capture of the decode step failed; decoding eagerly", exc_info=True)
            self.runner.graphs = None
            return None
        get_logger().info(
            "captured the decode step%s for %d rows x %d columns (%d graphs)",
            " with sampling" if sampled else "", b, width,
            len(self.graphs) + len(self.sampled) + 1,
        )  # fmt: skip
        return graph, logits
