"""A vLLM engine (`engines.kind = "vllm"`): `vllm serve` on loopback behind our token-checking front.

main.py   the engine process: check vLLM, start `vllm serve`, wait for it, serve the front, register
front.py  the front: the run's token, weight-version stamps, generate requests relayed to vLLM
streamed.py  a streamed generate: vLLM's chunks passed on as the builtin engine's events
mm.py     images through vLLM's HTTP API: our `mm` field to its render + `features`
span.py   an engine over several nodes: each node's part of vLLM's data parallelism and its flags
ipc.py    inside vLLM's GPU workers: the worker extension that takes the shared-memory refit
adapters.py  which LoRA adapter the engine serves: each refit's version loaded under a name of its own

Importing this package imports nothing from vLLM; the modules that need it import it.
"""
