"""The Mooncake Store clients of this process: one per set of options, shared by the tiers using it.

A Mooncake client is costly to have twice: each one mounts a segment of its own, and closing
one holds the GIL for 1-2.5 s (measured with 0.3.13: nothing else in the process runs
meanwhile, the event loop included). So `MooncakeTier`s of one process with the same master,
metadata, transport, host name and segment size share one client (`acquire` / `release`,
counted); the last to let go closes it. Each tier registers its own memory with the shared
client, counted too (two tiers may share one primary memory), and unregisters it when it
closes. `held` keeps a client open across tiers' openings and closings (a process that builds
tiers often: a test suite, a benchmark).

Everything here blocks (it sets clients up and closes them): a worker thread's work.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["ClientOptions", "SharedClient", "acquire", "held", "release"]

#: The client's own transfer buffer, for calls on unregistered memory, which tiers never make.
LOCAL_BUFFER_BYTES = 16 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    """What makes two clients interchangeable (checked by `MooncakeTier` before they get here)."""

    master: str
    segment_bytes: int
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str = "127.0.0.1"


@dataclass(slots=True)
class SharedClient:
    """A set-up client, its users and the memory they registered with it (address, bytes)."""

    client: Any
    users: int = 0
    registered: Counter[tuple[int, int]] = field(default_factory=Counter)

    def register(self, address: int, nbytes: int) -> None:
        with _lock:
            if not self.registered[address, nbytes]:
                rc = self.client.register_buffer(address, nbytes)
                if rc != 0:
                    raise ConnectionError(f"mooncake: registering {nbytes} bytes of memory failed: {rc}")
            self.registered[address, nbytes] += 1

    def unregister(self, address: int, nbytes: int) -> None:
        with _lock:
            self.registered[address, nbytes] -= 1
            if not self.registered[address, nbytes]:
                del self.registered[address, nbytes]
                self.client.unregister_buffer(address)


_lock = threading.Lock()
#: By process id too: a forked child must not use its parent's client (its threads stayed behind).
_clients: dict[tuple[int, ClientOptions], SharedClient] = {}


def import_store() -> Any:
    """The Mooncake Store client module (a first import loads shared libraries)."""
    try:
        from mooncake import store
    except ImportError as exc:
        raise ConfigError(
            "mooncake tier: the Mooncake client cannot be imported "
            "(pip install mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine with CUDA; "
            f"it needs libibverbs1): {exc}"
        ) from None
    return store


def acquire(options: ClientOptions) -> SharedClient:
    """The client for `options`, set up now if none is (under the lock: a second opener waits for
    it rather than make another); `release` it once done."""
    store = import_store()
    key = (os.getpid(), options)
    with _lock:
        shared = _clients.get(key)
        if shared is None:
            client = store.MooncakeDistributedStore()
            rc = client.setup(
                options.local_hostname,
                options.metadata,
                options.segment_bytes,
                LOCAL_BUFFER_BYTES,
                options.protocol,
                options.device,
                options.master,
            )
            if rc != 0:
                raise ConnectionError(
                    f"mooncake: setup with the master at {options.master} (metadata {options.metadata}, "
                    f"{options.protocol}) failed: {rc}"
                )
            shared = _clients[key] = SharedClient(client)
        shared.users += 1
        return shared


def release(options: ClientOptions) -> None:
    """Let go of the client `acquire` gave; the last user closes it (1-2.5 s, holding the GIL)."""
    key = (os.getpid(), options)
    with _lock:
        shared = _clients[key]
        shared.users -= 1
        if shared.users:
            return
        del _clients[key]
    shared.client.close()  # objects the master placed in its segment go with it


@contextlib.contextmanager
def held(options: ClientOptions) -> Iterator[SharedClient]:
    """Keep the client for `options` open meanwhile, whatever tiers open and close."""
    shared = acquire(options)
    try:
        yield shared
    finally:
        release(options)
