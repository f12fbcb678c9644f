"""The HTTP side of a refit: the same call to every engine at once, one error naming every engine that failed.

Both senders (the built-in engines' and vLLM's) drive their engines through these calls; the bytes go
over the communicator meanwhile, so a call that blocks (`/update_weights`) runs in a thread.
"""

import http.client
import json
import select
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

HTTP_GRACE_S = 30.0
"""An engine's own waits (joining the group, a bucket) last up to the refit timeout: its HTTP answer,
which says why it failed, gets this much longer to arrive."""


_local = threading.local()
"""Each thread's open connections by `host:port`: a refit makes a few calls per engine and step, and a
new TCP connection for each would cost more than the call."""


def _connection(netloc: str, timeout_s: float) -> http.client.HTTPConnection:
    """This thread's keep-alive connection to `netloc`, opened anew when the engine closed the old one."""
    conns: dict[str, http.client.HTTPConnection] = _local.__dict__.setdefault("conns", {})
    conn = conns.get(netloc)
    if conn is not None and conn.sock is not None and _readable(conn.sock):
        conn.close()  # an idle connection with something to read was closed by the server (its idle timeout)
    if conn is None:
        conn = conns[netloc] = http.client.HTTPConnection(netloc, timeout=timeout_s)
    conn.timeout = timeout_s
    if conn.sock is not None:
        conn.sock.settimeout(timeout_s)
    return conn


def _readable(sock) -> bool:
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


def _call(method: str, url: str, body: dict[str, Any] | None, token: str, timeout_s: float) -> dict[str, Any]:
    """One request with the run's token on a kept-alive connection; a non-2xx answer raises `RuntimeError`
    with its message. A request that fails on the way is never sent again: it may have been carried out."""
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme == "http", f"engines answer plain HTTP on their private network, not {url}"
    conn = _connection(parts.netloc, timeout_s)
    headers = {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except http.client.HTTPException as err:  # a garbled answer: this connection is done
        conn.close()
        raise RuntimeError(f"{url}: {type(err).__name__}: {err}") from None
    except OSError:
        conn.close()
        raise
    if not 200 <= resp.status < 300:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {raw.decode(errors='replace')}")
    return json.loads(raw or b"{}")


def post_json(url: str, body: dict[str, Any], token: str, timeout_s: float) -> dict[str, Any]:
    """POST `body` to `url` with the run's token; a non-2xx answer raises `RuntimeError` with its message."""
    return _call("POST", url, body, token, timeout_s)


def get_json(url: str, token: str, timeout_s: float) -> dict[str, Any]:
    """GET `url` with the run's token; a non-2xx answer raises `RuntimeError` with its message."""
    return _call("GET", url, None, token, timeout_s)


class EngineCalls:
    """Concurrent calls to engines with the run's token."""

    def __init__(self, token: str, timeout_s: float):
        self.token = token
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="refit-http")

    def post(self, url: str, path: str, body: dict[str, Any]) -> Future:
        return self.pool.submit(self._post_now, url, path, body)

    def _post_now(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_json(url.rstrip("/") + path, body, self.token, self.timeout_s + HTTP_GRACE_S)

    def wait(self, calls: list[Future], urls: Sequence[str], what: str) -> list[dict[str, Any]]:
        """Every call's answer, or one `RuntimeError` listing each engine that failed."""
        results, errors = [], []
        for url, call in zip(urls, calls, strict=True):
            try:
                results.append(call.result())
            except (RuntimeError, OSError) as err:  # collect every engine's failure into one message
                errors.append(f"{url}: {err}")
        if errors:
            raise RuntimeError(f"{what} failed on {len(errors)} engine(s): " + "; ".join(errors))
        return results

    def places(self, urls: Sequence[str]) -> list[dict[str, Any] | None]:
        """Where each engine runs, from its `/health` (`host_id`, `device_uuids`); None if it does not say."""
        calls = [self.pool.submit(get_json, url.rstrip("/") + "/health", self.token, self.timeout_s) for url in urls]
        answers = self.wait(calls, urls, "health")
        return [a if "device_uuids" in a else None for a in answers]

    def round(self, urls: Sequence[str], path: str, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The same POST to every engine, waited for: the first from this thread (one hand-off fewer per
        round), the others from the pool meanwhile."""
        if not urls:
            return []
        rest = [self.post(url, path, body or {}) for url in urls[1:]]
        first: Future = Future()
        try:
            first.set_result(self._post_now(urls[0], path, body or {}))
        except (RuntimeError, OSError) as err:  # reported with the others' failures by `wait`
            first.set_exception(err)
        return self.wait([first, *rest], urls, path.lstrip("/"))

    def check(self, calls: list[Future], urls: Sequence[str]) -> None:
        """An engine that refused the update early would leave the broadcast hanging: fail now instead."""
        for url, call in zip(urls, calls, strict=True):
            if call.done() and call.exception() is not None:
                raise RuntimeError(f"engine {url} refused the weight update: {call.exception()}")

    def form(self, join: Callable[[], Any], calls: list[Future], urls: Sequence[str], what: str) -> Any:
        """Run `join` (this side's part of the group rendezvous) while the engines' init `calls` are in
        flight; its result once every call succeeded. An engine that cannot join fails its call at once,
        while the group would wait for it until the timeout: stop at the first failed call (the abandoned
        group times out on its own)."""
        forming = self.pool.submit(join)
        done, _ = wait([forming, *calls], timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        if forming not in done:
            self.wait(calls, urls, "init_weight_transfer_engine")
            raise RuntimeError(f"{what} did not form within {self.timeout_s:.0f}s")
        self.wait(calls, urls, "init_weight_transfer_engine")
        return forming.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
