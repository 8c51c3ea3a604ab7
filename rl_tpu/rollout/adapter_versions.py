"""Which LoRA adapter versions SGLang servers hold for one run, under which names, and when an
old one may go (the bookkeeping of weight_sync.py's adapter-only sync).

Names. A server holds adapters by name, and outlives the trainers that load into it: a run
resumed after a pre-emption finds the adapters its earlier life loaded still there (SGLang
refuses a second load under a name it holds, "already exists"), and several runs may share
one server. So a version is loaded as `<run id>-<version>`, the run id being the workdir's
(`run_id_of(weights_dir)`: the same for every life of one run, another for a run in another
workdir). At first contact with a server, process 0 unloads every adapter named with its run's
prefix (`earlier_life`): what an earlier life of this run left; other runs' are not touched.

Hosts. On several hosts sharing servers, process 0 alone loads and unloads. Another host may
name a version only once process 0 has loaded it: its `update` only `announce`s the version,
and `confirm` (on the main thread, after a barrier every host passes once process 0's load has
returned: rl_tpu/core/shared_weights.py) makes it the newest there. Process 0 in turn
unloads only versions no host may still name: at each such barrier every host reports the
oldest version it may name until the next one (`oldest_named`: the oldest its requests in
flight carry, else its newest; it only ever names newer ones), and process 0 keeps every
version from the oldest of those on (`hold`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Optional

RUN_ID_CHARS = 10  # hex digits of the workdir's hash in a run id


def run_id_of(weights_dir: str) -> str:
    """The run id of the run whose adapters go to `weights_dir` (module doc): "r" and the
    first hex digits of the hash of its absolute path."""
    digest = hashlib.sha256(os.path.abspath(weights_dir).encode()).hexdigest()
    return "r" + digest[:RUN_ID_CHARS]


def adapter_name(run_id: str, version: str) -> str:
    """The name a server holds `version` of run `run_id` under."""
    return f"{run_id}-{version}"


def earlier_life(run_id: str, served: dict[str, str]) -> list[str]:
    """The names in `served` (name -> path, a server's adapters) this run loaded: at first
    contact, what an earlier life of the run left there."""
    return sorted(name for name in served if name.startswith(run_id + "-"))


class AdapterVersions:
    """Which adapter versions the servers hold, the one new requests get (the newest), and
    how many of the engine's requests in flight carry each (thread-safe).

    `acquire` pins a request to the newest version and `release` unpins it; `add` makes a
    just-loaded version the newest. Both return the versions to unload now: the oldest
    beyond `keep`, never the newest, never one a request still carries (it waits for its
    last `release`), never one another host may still name (`hold`). `unloaded` forgets a
    version; `unload_failed` keeps it for the next try. Other hosts than process 0 use
    `announce` and `confirm` instead of `add` (module doc).
    """

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"keep_adapters={keep} must be >= 1 (the newest version is "
                             "always loaded)")
        self.keep = int(keep)
        self._lock = threading.Lock()
        self._loaded: list[str] = []  # oldest first
        self._in_flight: dict[str, int] = {}
        self._unloading: set[str] = set()
        self._announced: list[str] = []  # other hosts: loaded by process 0, maybe not yet
        self._held_from: list[str] = []  # process 0: the oldest each other host may name

    @property
    def newest(self) -> Optional[str]:
        with self._lock:
            return self._loaded[-1] if self._loaded else None

    def loaded(self) -> list[str]:
        """Versions loaded on the servers (or being unloaded), oldest first."""
        with self._lock:
            return list(self._loaded)

    def in_flight(self, version: str) -> int:
        with self._lock:
            return self._in_flight.get(version, 0)

    def acquire(self, count: int = 1) -> Optional[str]:
        """The newest version (None before the first load), now carried by `count` more
        requests."""
        with self._lock:
            if not self._loaded:
                return None
            version = self._loaded[-1]
            self._in_flight[version] = self._in_flight.get(version, 0) + count
            return version

    def release(self, version: Optional[str], count: int = 1) -> list[str]:
        if version is None:
            return []
        with self._lock:
            self._in_flight[version] -= count
            if self._in_flight[version] <= 0:
                del self._in_flight[version]
            return self._to_unload()

    def add(self, version: str) -> list[str]:
        with self._lock:
            if version in self._loaded:
                raise ValueError(f"adapter version {version!r} is loaded already")
            self._loaded.append(version)
            return self._to_unload()

    def announce(self, version: str) -> None:
        """Another host than process 0: `version` is being loaded by process 0; requests
        name it only after `confirm`."""
        with self._lock:
            if version in self._loaded or version in self._announced:
                raise ValueError(f"adapter version {version!r} is loaded already")
            self._announced.append(version)

    def confirm(self, version: str) -> list[str]:
        """Process 0 has loaded `version` (and every version announced before it): they become
        loaded here, `version` the newest. Nothing for a version not announced (confirmed
        already, or loaded by `add`). Returns the versions to forget now."""
        with self._lock:
            if version not in self._announced:
                return []
            upto = self._announced.index(version) + 1
            self._loaded += self._announced[:upto]
            del self._announced[:upto]
            return self._to_unload()

    def oldest_named(self) -> Optional[str]:
        """The oldest version this engine's requests may name from now on (the oldest one in
        flight, else the newest; None when none is loaded): it names no older one later."""
        with self._lock:
            carried = [v for v in self._loaded if v in self._in_flight]
            return carried[0] if carried else (self._loaded[-1] if self._loaded else None)

    def hold(self, oldest_elsewhere: list[Optional[str]]) -> list[str]:
        """Process 0: the oldest version each other host may name (`oldest_named` of theirs);
        no version from the oldest of them on is unloaded until the next `hold`. Returns the
        versions to unload now (those the previous hold kept that are free now)."""
        with self._lock:
            self._held_from = [v for v in oldest_elsewhere if v is not None]
            return self._to_unload()

    def unloaded(self, version: str) -> None:
        with self._lock:
            self._unloading.discard(version)
            if version in self._loaded:
                self._loaded.remove(version)

    def unload_failed(self, version: str) -> None:
        with self._lock:
            self._unloading.discard(version)

    def _to_unload(self) -> list[str]:
        """The versions past `keep` (oldest first) that no request carries and no other host
        may name, now marked unloading."""
        excess = self._loaded[:max(0, len(self._loaded) - self.keep)]
        held = [self._loaded.index(v) for v in self._held_from if v in self._loaded]
        if held:  # another host may still name these (a version unknown here is gone)
            excess = excess[:min(held)]
        out = [v for v in excess if v not in self._in_flight and v not in self._unloading]
        self._unloading.update(out)
        return out
