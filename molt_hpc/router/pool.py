"""The engines behind the router: who they are, whether they are healthy, how busy they are.

Engines are discovered from `rendezvous/engine-*.json` and re-scanned every health interval
(engines restart on new ports, extra pools join and leave). Only engines that answered their last
health check are on the ring; a failed connection takes an engine out at once, a passing check
brings it back. An engine joins the ring only once it serves the ring's newest weight version: one
that comes up on older weights (a restart, an extra pool) waits for the trainer's refit, which a
change of registrations triggers at once, so no request is answered by stale weights. While every engine is
out (health checks that time out under load), the ring's version is the newest it served when it last had
engines: an empty ring admits a stale engine only before any engine ever joined.
"""

import asyncio
import json
import re
from dataclasses import dataclass

import aiohttp

from molt_hpc.config.rollout import RouterConfig
from molt_hpc.engine.client import auth_headers
from molt_hpc.log import get_logger
from molt_hpc.router.ring import HashRing, choose
from molt_hpc.rundir import RunDir

ENGINE_FILE = re.compile(r"^engine-(\d+)\.json$")
EMPTY_POLL_S = 0.2
"""While no engine is on the ring the next look comes this soon (at most `health_interval_s`): a run that is
starting, or whose engines are all restarting, gets its first engine back within a fraction of the interval."""


@dataclass
class Engine:
    """One engine as the router sees it."""

    index: int
    url: str
    healthy: bool = False
    in_flight: int = 0
    total: int = 0
    failures: int = 0
    version: int | None = None
    """The weight version its last health check reported (None: it does not say)."""
    waiting: bool = False
    """Healthy but not on the ring: it serves older weights than the ring until the trainer refits it."""

    @property
    def node(self) -> str:
        return f"engine-{self.index}"


class EnginePool:
    """Membership, health and load of the engines; `pick` is the routing decision."""

    def __init__(self, run: RunDir, cfg: RouterConfig, token: str):
        self.run = run
        self.cfg = cfg
        self.token = token
        self.engines: dict[int, Engine] = {}
        self.ring = HashRing(cfg.virtual_nodes)
        self.served: int | None = None
        """The newest weight version the ring served when it last had engines (None: it never had any)."""

    def scan(self) -> None:
        """Pick up new, restarted (new URL) and removed engines from the rendezvous directory."""
        seen = set()
        for path in self.run.rendezvous.glob("engine-*.json"):
            match = ENGINE_FILE.match(path.name)
            try:
                url = json.loads(path.read_text())["url"] if match else None
            except (OSError, ValueError, KeyError):  # being replaced or half-gone: next scan reads it
                continue
            if not match or not url:
                continue
            index = int(match.group(1))
            seen.add(index)
            old = self.engines.get(index)
            if old is None or old.url != url:
                self.engines[index] = Engine(index, url, total=old.total if old else 0)
        for index in set(self.engines) - seen:
            del self.engines[index]
        self._rebuild()

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        self.scan()
        await asyncio.gather(*(self._check(session, e) for e in list(self.engines.values())))
        self._rebuild()

    async def run_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.refresh(session)
            empty = not any(e.healthy for e in self.engines.values())
            await asyncio.sleep(min(EMPTY_POLL_S, self.cfg.health_interval_s) if empty else self.cfg.health_interval_s)

    def pick(self, session_id: str | None, exclude: set[int]) -> Engine | None:
        """Consistent hash with bounded loads for a session; the least-loaded engine without one."""
        live = [e for e in self.engines.values() if e.healthy and e.index not in exclude]
        if not live:
            return None
        if session_id is None:
            return min(live, key=lambda e: (e.in_flight, e.total, e.index))
        by_node = {e.node: e for e in live}
        node = choose(self.ring, session_id, {n: e.in_flight for n, e in by_node.items()}, self.cfg.balance_factor)
        return by_node[node] if node else None

    def mark_failed(self, engine: Engine, why: str) -> None:
        if engine.healthy:
            get_logger().warning("engine %d (%s) left the ring: %s", engine.index, engine.url, why)
        engine.healthy = False
        engine.failures += 1
        self._rebuild()

    def metrics(self) -> dict:
        engines = [
            {
                "index": e.index,
                "url": e.url,
                "healthy": e.healthy,
                "in_flight": e.in_flight,
                "total": e.total,
                "failures": e.failures,
                "version": e.version,
                "waiting": e.waiting,
            }
            for e in sorted(self.engines.values(), key=lambda e: e.index)
        ]
        return {
            "engines": engines,
            "healthy": sum(e["healthy"] for e in engines),
            "in_flight": sum(e["in_flight"] for e in engines),
            "total": sum(e["total"] for e in engines),
        }

    async def _check(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.cfg.health_interval_s * 2))
        version = None
        try:
            async with session.get(engine.url + "/health", headers=auth_headers(self.token), timeout=timeout) as r:
                ok = r.status == 200
                if ok:
                    version = (await r.json(content_type=None)).get("weight_version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):  # unreachable or no JSON: unhealthy
            ok = False
        engine.version = version if isinstance(version, int) else engine.version
        if ok and not engine.healthy:
            serving = self.serving_version()
            if not admits(engine.version, serving):  # it joins once the trainer refitted it
                if not engine.waiting:
                    get_logger().info("engine %d (%s) serves weight version %s, the ring %s: it waits for the "
                                      "refit", engine.index, engine.url, engine.version, serving)  # fmt: skip
                engine.waiting = True
                return
            get_logger().info("engine %d (%s) joined the ring", engine.index, engine.url)
        engine.waiting = False
        if not ok:
            self.mark_failed(engine, "health check failed")
        engine.healthy = ok
        self.serving_version()  # remembered for a moment when every engine is out

    def serving_version(self) -> int | None:
        """The newest weight version an engine on the ring serves; while none is on it, the newest it served when
        it last had engines (a rollback lowers it: the ring's own engines report the older version)."""
        versions = [e.version for e in self.engines.values() if e.healthy and e.version is not None]
        if versions:
            self.served = max(versions)
        return self.served

    def _rebuild(self) -> None:
        self.ring.set_nodes({e.node for e in self.engines.values() if e.healthy})


def admits(version: int | None, serving: int | None) -> bool:
    """Whether an engine serving `version` may join a ring whose newest version is `serving`."""
    return serving is None or version is None or version >= serving
