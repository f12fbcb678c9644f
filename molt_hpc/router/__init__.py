"""The router: an HTTP proxy in front of the engines that keeps each session on one engine.

ring.py   consistent hashing with virtual nodes and bounded loads (pure)
pool.py   the engines: discovery from the run directory, health checks, in-flight counts
main.py   the router process: the proxy routes, /metrics, registration
vllm_router.py  `router.kind = "vllm-router"`: vLLM's Rust router in front of the engines, started and watched
"""
