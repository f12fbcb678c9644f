"""The built-in inference engine: a transformers causal LM behind vLLM's token-in/token-out HTTP protocol.

client.py     async client of the HTTP protocol (generate, pause, resume, health)
sampling.py   request validation and the per-token processing (temperature, top-k, top-p, min-p)
kvcache.py    the batch KV cache: rows join (left padding), leave, and are re-prefilled
batch.py      rows, the prefill and decode forwards, sampling a batch
fuse.py       fused projections: one matmul for q/k/v and one for gate/up per layer
slots.py      on a GPU: the preallocated KV cache (one slot per row) and its runner
prefill.py    on a GPU: the prefill written straight into the slots, replayed as CUDA graphs per shape bucket
graphs.py     on a GPU: the decode step recorded and replayed as CUDA graphs (unless enforce_eager)
exact_slots.py  under engines.exact: the slot runner's decode and prefill attention, the trainer's exact kernels
scheduler.py  the scheduler thread: admission, pause modes, atomic weight updates
load.py       the engine's load logged over fixed windows: the bottleneck, or idle waiting for requests?
routing.py    routing capture: the experts every forwarded token went to, in vLLM 0.26's format
stream.py     a streamed generate call: the answer's tokens as they are sampled, kept when the call breaks
(the HTTP edge and the request bodies it shares with the router and the fronts: `molt_hpc.protocol`)
server.py     the aiohttp app: validation, the generate and control routes
vision.py     images of a request (`mm`) checked and turned into pixels; the VLM prefill (3-D positions)
weights.py    the weight-transfer routes (vLLM's names) around the refit receiver
lora.py       LoRA refits: the adapters merged into the weights, or kept in LoRA layers of the engine's own
main.py       the engine process: load, serve, register in the run directory
vllm/         a `vllm serve` engine behind our token-checking front (see vllm/__init__.py)
"""
