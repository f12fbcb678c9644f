"""What every HTTP server of a run shares at its edge, and the engines' request bodies. A leaf package: the
engine, router, scorer, chat endpoint, vLLM front and refit receiver import it; it imports none of them.

edge.py      the run token, one JSON reader (UTF-8, finite numbers only), typed parsing with a 400 naming
             the field, body-size limits, session ids and forwardable paths, the two error shapes
requests.py  the engine protocol's typed bodies: generate and its sampling parameters, refit init /
             start / update / finish, pause, the vLLM front's RPC
"""
