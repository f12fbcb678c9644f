"""Which LoRA adapter a vLLM engine serves: a LoRA run's refits load each version's adapter under a name of its own.

vLLM loads an adapter from a PEFT directory (`/v1/load_lora_adapter`) and applies it to the requests that
name it in `model`. A refit of version v loads `molt-v<v>`; from then on new requests get that name, while
requests already running finish under the adapter they started with: an answer comes from one version,
so its tokens are stamped with the version it started at, exactly. The adapter retired by a refit is
unloaded once its last request finished (vLLM holds the current and the retired one meanwhile: its
`--max-loras 2`). No torch and no HTTP here: the front (`front.py`) calls vLLM; this keeps the count.
"""

from collections import Counter

PREFIX = "molt-v"


def adapter_name(version: int) -> str:
    """The name vLLM serves version `version`'s adapter under."""
    return f"{PREFIX}{version}"


class AdapterSlots:
    """The adapter new requests get, and how many requests each adapter has in flight."""

    def __init__(self) -> None:
        self.current: str | None = None
        """None until the first refit: version 0 is the base model (peft starts B at zero)."""
        self.inflight: Counter[str] = Counter()
        self.retired: set[str] = set()
        """Replaced adapters that still have requests in flight: unloaded when the last one ends."""

    def take(self) -> str | None:
        """The adapter for a request that starts now (counted in flight until `release`)."""
        if self.current is not None:
            self.inflight[self.current] += 1
        return self.current

    def release(self, name: str | None) -> list[str]:
        """A request under `name` ended; the adapters that can be unloaded now."""
        if name is None:
            return []
        self.inflight[name] -= 1
        if self.inflight[name] > 0:
            return []
        del self.inflight[name]
        if name in self.retired:
            self.retired.discard(name)
            return [name]
        return []

    def switch(self, name: str) -> list[str]:
        """New requests get `name` from now on; the adapters that can be unloaded now."""
        old, self.current = self.current, name
        if old is None or old == name:
            return []
        if self.inflight[old] > 0:
            self.retired.add(old)
            return []
        self.inflight.pop(old, None)
        return [old]
