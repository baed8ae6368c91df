"""KV cache events in vLLM's published format, for routers that score replicas by their cache.

Wire format (that of vLLM's `vllm/distributed/kv_events.py`, which llm-d's KV cache manager and
NVIDIA Dynamo read): every engine step whose cache changed is one ZMQ multipart message on a PUB
socket, `(topic, sequence number as 8 bytes big-endian, payload)`, sequence numbers counting up
from 0 with no gap. The payload is a msgpack array `[ts, events]`: an `EventBatch` without its
optional third field, the data-parallel rank. vLLM's publisher fills that in (0 for an engine
without data parallelism); kvbank has no data-parallel ranks and sends none, which vLLM's decoder
reads as its default, None. Each event is an array whose first element is its tag:

- `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`:
  full blocks that became findable in the prefix cache, one chain in order; `parent_block_hash`
  is the hash of the block before the first one (None at the start of a sequence), `token_ids`
  the blocks' tokens one after the other (an empty list when the publisher sends hashes only:
  vLLM's decoders require the field, not its content), `lora_id` and `lora_name` None.
- `["BlockRemoved", block_hashes, medium]`: blocks that left the prefix cache (evicted, reset).
- `["AllBlocksCleared"]`: the cache is empty (sent once when the engine starts).

Hashes are unsigned 64-bit integers: the low 64 bits of the engine's 16-byte block hash read
big-endian, the form vLLM sends by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) and the one
consumers index by. `medium` names where the blocks live: "GPU" for a pool on a CUDA device,
"CPU" for a pool in host memory (vLLM's names). Blocks a tier loads back into the pool are stored
events of the pool like any other; the tiers themselves publish nothing. A document's blocks
(engine/blend.py) are stored as a chain of their own that starts with the document (parent None),
hashed under the document's root: a router matching a plain prompt's hashes never matches them,
and one that reads the events' token ids can find a prompt's documents among them.

Whoever connects reads every tenant's token ids (as with vLLM's events; ZMQ has no authentication
here), so an endpoint is bound only on loopback (or ipc://, inproc://) unless the caller says it may
be public, and `token_ids=False` keeps the prompts' tokens out of the events altogether.

A ROUTER socket (the replay endpoint, optional) resends the last batches: a request
`(identity, b"", start sequence as 8 bytes big-endian)` is answered with one
`(identity, b"", sequence, payload)` per buffered batch from that sequence on, then
`(identity, b"", -1 as 8 signed bytes, b"")`.

The engine thread only appends to a list and, once a step, hands that list to a queue; a
publisher thread encodes and sends (a PUB socket drops what a slow subscriber cannot take).
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("kvbank")

#: batches kept for replay (vLLM's default)
REPLAY_BUFFER_BATCHES = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HASH_MASK = (1 << 64) - 1
_SCHEMES = ("tcp://", "ipc://", "inproc://")


class CacheEvents(Protocol):
    """What the cache manager reports: blocks entering and leaving the prefix index, and where a step ends."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

    def flush(self) -> None:
        """Publish what was reported since the last flush as one batch (nothing if nothing was)."""

    def close(self) -> None: ...


def external_hash(block_hash: bytes) -> int:
    """The hash as published: the low 64 bits of the engine's hash, read big-endian."""
    return int.from_bytes(block_hash, "big") & _HASH_MASK


def check_endpoint(name: str, endpoint: str | None, public: bool = False) -> None:
    """Raise ValueError naming `name` unless `endpoint` is None or a ZMQ address this engine can bind: a
    loopback one (tcp://127.x.x.x, tcp://[::1], tcp://localhost; ipc://, inproc://), or with `public` any."""
    if endpoint is None:
        return
    if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
        raise ValueError(
            f"{name}={endpoint!r} is not a ZMQ endpoint: use tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557), "
            "ipc://PATH or inproc://NAME"
        )
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host or not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{name}={endpoint!r} needs a host and a port from 1 to 65535 (tcp://HOST:PORT)")
        if not public and not _is_loopback(host):
            raise ValueError(
                f"{name}={endpoint!r} is not a loopback address: KV events carry every tenant's token ids to "
                "whoever connects; bind tcp://127.0.0.1:PORT (or ipc://PATH), or pass kv_events_public=True "
                "(--kv-events-public) to publish to the network (consider kv_events_token_ids='off')"
            )


def _is_loopback(host: str) -> bool:
    name = host.removeprefix("[").removesuffix("]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # an interface name or a wildcard ("*", "eth0"): anything may reach it
        return False


def _require(module: str, option: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise RuntimeError(
            f"{option} needs the {module!r} package (pip install 'kvbank[fleet]' installs pyzmq and msgpack)"
        ) from None


class ZmqEventPublisher:
    """Publishes the cache events of one engine on a ZMQ PUB socket, in vLLM's format (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        medium: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        token_ids: bool = True,
    ) -> None:
        self._zmq = zmq = _require("zmq", "kv_events_endpoint")
        self._msgpack = _require("msgpack", "kv_events_endpoint")
        self.block_size, self.medium = block_size, medium
        self.token_ids = token_ids
        self._topic = topic.encode()
        self._pending: list[tuple] = []
        self._queue: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        self._context = zmq.Context()
        # Bound here so a taken port fails the engine's start; only the publisher thread uses them afterwards.
        self._pub = self._bind(zmq.PUB, endpoint, "kv_events_endpoint")
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._bind(zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint")
        self._thread = threading.Thread(target=self._run, name="kvbank-kv-events", daemon=True)
        self._thread.start()
        self._queue.put([("cleared",)])  # whatever a subscriber knew of this engine is gone

    def _bind(self, kind: int, endpoint: str, option: str) -> Any:
        socket = self._context.socket(kind)
        socket.setsockopt(self._zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except self._zmq.ZMQError as e:
            socket.close()
            self._context.term()
            raise ValueError(f"{option}={endpoint!r} cannot be bound: {e}") from None
        return socket

    # --- engine thread ------------------------------------------------------------------------

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        self._pending.append(("stored", block_hash, parent_hash, token_ids))

    def removed(self, block_hash: bytes) -> None:
        self._pending.append(("removed", block_hash))

    def flush(self) -> None:
        if self._pending:
            self._queue.put(self._pending)
            self._pending = []

    def close(self) -> None:
        """Send what is pending and stop; the sockets are closed when the thread has sent everything."""
        if not self._thread.is_alive():
            return
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5)

    # --- publisher thread ---------------------------------------------------------------------

    def encode(self, events: list[tuple]) -> list:
        """The EventBatch of one step as plain msgpack-ready lists: runs of stored blocks that chain
        become one BlockStored, runs of removed ones one BlockRemoved."""
        out: list[list] = []
        last_hash: bytes | None = None
        for event in events:
            kind = event[0]
            if kind == "stored":
                _, block_hash, parent, tokens = event
                run = out[-1] if out and out[-1][0] == "BlockStored" and parent == last_hash else None
                if run is None:
                    parent_id = None if parent is None else external_hash(parent)
                    run = ["BlockStored", [], parent_id, [], self.block_size, None, self.medium, None]
                    out.append(run)
                run[1].append(external_hash(block_hash))
                if self.token_ids:
                    run[3].extend(tokens)
                last_hash = block_hash
            elif kind == "removed":
                if not (out and out[-1][0] == "BlockRemoved"):
                    out.append(["BlockRemoved", [], self.medium])
                out[-1][1].append(external_hash(event[1]))
                last_hash = None
            else:
                out.append(["AllBlocksCleared"])
                last_hash = None
        return [time.time(), out]

    def _run(self) -> None:
        zmq = self._zmq
        buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_BATCHES)
        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay(buffer)
                try:
                    events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    break
                try:
                    payload = self._msgpack.packb(self.encode(events), use_bin_type=True)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except Exception:  # a lost batch shows as a gap in the sequence numbers
                    log.exception("kv events: batch %d not sent", seq)
                else:
                    buffer.append((seq, payload))
                seq += 1
        finally:
            self._pub.close(linger=200)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._context.term()

    def _serve_replay(self, buffer: deque[tuple[int, bytes]]) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: replay request of %d frames ignored (identity, b'', 8-byte sequence)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def build_events(
    endpoint: str | None,
    replay_endpoint: str | None,
    topic: str,
    block_size: int,
    device_type: str,
    token_ids: bool = True,
) -> ZmqEventPublisher | None:
    """The publisher the options ask for, or None when `endpoint` is None; `token_ids=False` publishes
    hashes only (BlockStored's token ids an empty list)."""
    if endpoint is None:
        if replay_endpoint is not None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        return None
    medium = "GPU" if device_type == "cuda" else "CPU"
    return ZmqEventPublisher(endpoint, block_size, medium, replay_endpoint, topic, token_ids)
