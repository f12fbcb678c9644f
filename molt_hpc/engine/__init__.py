"""The built-in inference engine: a transformers causal LM behind vLLM's token-in/token-out HTTP protocol.

client.py     async client of the HTTP protocol (generate, pause, resume, health)
sampling.py   request validation and the per-token processing (temperature, top-k, top-p, min-p)
kvcache.py    the batch KV cache: rows join (left padding), leave, and are re-prefilled
batch.py      one decode step of the running batch: prefill newcomers, decode, sample
scheduler.py  the scheduler thread: admission, pause modes, atomic weight updates
server.py     the aiohttp app: auth, validation, the generate and control routes
main.py       the engine process: load, serve, register in the run directory
"""
