"""Moving KV blocks between the pool and the tiers below it (host RAM, disk, Redis).

Entries are *chunks*: up to `chunk_blocks` consecutive blocks of one prefix chain that start at a
multiple of `chunk_blocks`, stored under the chain key of their last block. A chunk that ends
early (a prompt's last whole blocks, an eviction in mid-chunk) is stored as far as it goes.

Storing. Write-through offloads a chunk as soon as its last block is computed and indexed (and
a sequence's trailing part-chunk when it finishes); write-back offloads a chunk when the pool
evicts its last block. Either way a chunk leaves only once its last block has been reused
`min_hits` times. The K/V are copied out of the pool on the engine thread (a memcpy), then a
writer thread hands the entry to every tier; when its bounded queue is full, the entry is dropped.

Loading. When a request arrives, the blocks of its prompt that the pool lacks are looked up in
the tiers, in order, by a loader thread: it finds the longest run of chunks some tier holds,
fetches and verifies them (checksum, model, format, chain keys, token ids) and deletes what fails.
Meanwhile the scheduler passes the sequence over. The engine thread copies the verified blocks
into free pool blocks, indexes them like computed ones and holds them for the sequence, a few
chunks per step while other sequences run, so no step waits long. A load that has not landed by
the time recomputing would have finished is abandoned and the prompt is computed instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kvbank.cache.blocks import Block
from kvbank.cache.manager import KVCacheManager, Sequence
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers.base import Buffer, Tier
from kvbank.cache.tiers.entry import BadEntry, EntryFormat, EntryInfo, pack, unpack

log = logging.getLogger("kvbank.tiers")

WRITE_POLICIES = ("write_through", "write_back")
#: a tier load is given at least this long, however short the prompt
MIN_LOAD_SECONDS = 0.1
#: blocks installed per step while other sequences run (about 6 MB of bfloat16 K/V for SmolLM2)
INSTALL_BLOCKS_PER_STEP = 16


@dataclass(slots=True)
class LoadedChunk:
    """A verified chunk: chain positions [position, position + num_blocks) and its tensors."""

    position: int
    num_blocks: int
    views: list[torch.Tensor]
    tier: str


@dataclass
class LoadJob:
    """One sequence's lookup: chain keys and tokens of its whole prompt blocks, from `first` on;
    blocks from `usable` on are fetched with their chunk but not installed."""

    seq: Sequence
    #: the sequence the scheduler passes over until the load lands: `seq`, or the prompt that
    #: places the document `seq` holds (engine/blend.py)
    waiter: Sequence
    keys: list[bytes]
    token_ids: tuple[int, ...]
    root: bytes
    first: int
    usable: int
    deadline: float
    chunks: list[LoadedChunk] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    installed: int = 0


@dataclass
class OffloadCounters:
    """What the controller did, across tiers."""

    loads: int = 0
    load_tokens: int = 0
    load_timeouts: int = 0
    stores: int = 0
    store_queue_full: int = 0
    bad_entries: int = 0


class KVOffload:
    """Keeps the pool's prefix chains in `tiers` and brings them back on a pool miss."""

    def __init__(
        self,
        tiers: list[Tier],
        manager: KVCacheManager,
        storage: KVStorage,
        entry_format: EntryFormat,
        chunk_blocks: int,
        write_policy: str,
        min_hits: int,
        load_timeout: float | None,
        queue_size: int = 16,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_tier_write_policy={write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        assert tiers and chunk_blocks > 0
        self.tiers = tiers
        self.manager = manager
        self.pool = manager.pool
        self.storage = storage
        self.format = entry_format
        self.chunk_blocks = chunk_blocks
        self.write_through = write_policy == "write_through"
        self.min_hits = min_hits
        self.counters = OffloadCounters()
        self.seconds_per_token = 1e-3  # refined from the engine's measured prefill speed
        #: a fixed bound on a load's wait; None: the time computing the prompt is estimated to take
        self.load_timeout = load_timeout
        self.pin = storage.device.type == "cuda"
        self._jobs: list[LoadJob] = []
        self._loads: queue.Queue[LoadJob | None] = queue.Queue(maxsize=queue_size)
        #: (tiers, key, entry to put, or None to delete the key) for the store thread, in order
        self._stores: queue.Queue[tuple[list[Tier], bytes, torch.Tensor | bytes | None] | None] = queue.Queue(
            maxsize=queue_size
        )
        self._landed = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvbank-tier-load", daemon=True),
            threading.Thread(target=self._store_loop, name="kvbank-tier-store", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if not self.write_through:
            self.pool.on_evict = self._on_evict

    # --- storing ----------------------------------------------------------------------------

    def on_commit(self, seq: Sequence) -> None:
        """Write-through: offload the chunks of `seq` that its last step completed."""
        if not self.write_through:
            return
        for end in range(self.chunk_blocks - 1, len(seq.chain_serials), self.chunk_blocks):
            self._offload_chunk(seq, end)

    def on_finish(self, seq: Sequence) -> None:
        """Write-through: offload the part-chunk of whole blocks a finished sequence ends with."""
        if self.write_through and seq.chain_serials:
            self._offload_chunk(seq, len(seq.chain_serials) - 1)

    def on_admit(self, seq: Sequence) -> None:
        """Write-through with `min_hits`: a hit may have made a pool chunk worth offloading."""
        if self.write_through and self.min_hits:
            self.on_commit(seq)

    def _offload_chunk(self, seq: Sequence, end: int) -> None:
        # The serial names the indexed block with this content, which may be another sequence's.
        serial = seq.chain_serials[end] if end < len(seq.chain_serials) else None
        block_id = self.pool.by_serial.get(serial) if serial is not None else None
        if block_id is not None:
            self._offload(self.pool.blocks[block_id])

    def _on_evict(self, block: Block) -> None:
        self._offload(block)

    def spill(self, limit: int, tried: set[int]) -> int:
        """Write-back: queue up to `limit` chunks the pool holds that never reached the tiers, as
        evicting them would (without evicting), skipping blocks in `tried` and adding those it
        tries; returns how many were queued, or -1 when none is left to try (or nothing to do:
        write-through stores chunks when they are computed). On the engine thread."""
        if self.write_through:
            return -1
        # Deepest first: a chunk's last block sends the chunk and marks its blocks as sent.
        blocks = sorted(
            (b for b in self.pool.blocks if b.hash is not None and not b.offloaded and b.block_id not in tried),
            key=lambda b: -b.position,
        )
        if not blocks:
            return -1
        stores = self.counters.stores
        for block in blocks:
            if self.counters.stores - stores >= limit:
                break
            tried.add(block.block_id)
            self._offload(block)  # nothing if it left already with a deeper block of its chunk
        return self.counters.stores - stores

    def _offload(self, last: Block) -> None:
        """Send the chunk that ends at `last` (from its chunk boundary on) to the tiers, once."""
        if last.offloaded or last.hits < self.min_hits:
            return
        chain = [last]
        while chain[-1].position % self.chunk_blocks:
            parent = self.pool.parent_block(chain[-1])
            if parent is None:  # part of the chunk already left the pool: it cannot be stored whole
                return
            chain.append(parent)
        chain.reverse()
        first = chain[0]
        parent_key = self.pool.parent_block(first)
        info = EntryInfo(
            key=last.hash,
            parent=parent_key.hash if parent_key is not None else first.parent,
            position=first.position,
            num_blocks=len(chain),
            token_ids=tuple(t for block in chain for t in block.token_ids),
        )
        if not isinstance(info.parent, bytes):
            return
        ids = [block.block_id for block in chain]
        blob = pack(self.format, info, lambda views: self.storage.read_blocks(ids, views), pin=self.pin)
        for block in chain:
            block.offloaded = True
        if self._queue_store(self.tiers, last.hash, blob):
            self.counters.stores += 1

    def store_later(self, tier: Tier, key: bytes, data: bytes) -> bool:
        """Put `data` under `key` in `tier` on the store thread, so that a slow tier never stalls the
        engine; False if the queue is full (the entry is dropped)."""
        return self._queue_store([tier], key, data)

    def delete_later(self, tier: Tier, keys: list[bytes]) -> None:
        """Delete `keys` from `tier` on the store thread, after the puts queued before."""
        if self._closed:
            return
        for key in keys:
            self._stores.put(([tier], key, None))  # waits for room: a delete is never dropped

    def _queue_store(self, tiers: list[Tier], key: bytes, data: torch.Tensor | bytes) -> bool:
        if self._closed:
            return False
        try:
            self._stores.put_nowait((tiers, key, data))
        except queue.Full:
            self.counters.store_queue_full += 1
            return False
        return True

    def _store_loop(self) -> None:
        while (item := self._stores.get()) is not None:
            tiers, key, data = item
            for tier in tiers:
                if data is None:
                    tier.delete([key])
                else:
                    tier.put([(key, memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)])
            self._stores.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued entry has reached the tiers; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._stores.all_tasks_done:
            while self._stores.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._stores.all_tasks_done.wait(remaining)
        return True

    # --- loading ----------------------------------------------------------------------------

    def request_load(self, seq: Sequence, waiter: Sequence | None = None) -> bool:
        """Look for `seq`'s missing prompt blocks in the tiers; True if a load is under way.

        With a `waiter`, `seq` is a document of the waiter's prompt (engine/blend.py): every whole
        block of it is wanted, the loaded blocks are held for `seq` (the waiter frees it) and the
        waiter is passed over until the load lands."""
        bs = self.manager.block_size
        whole = len(seq.token_ids) // bs
        # The last token is always computed (as on a pool hit), but an entry may run up to the
        # prompt's last whole block: it is loaded and only the blocks before that one installed.
        usable = whole if waiter is not None else min(len(seq.token_ids) - 1, seq.prefix_limit) // bs
        if not self.manager.enable_prefix_caching or seq.no_prefix_cache or usable == 0:
            return False
        cached = len(self.manager.cached_prefix(seq, whole))
        if cached >= usable:
            return False
        first = cached - cached % self.chunk_blocks
        tokens = (usable - first) * bs
        job = LoadJob(
            seq,
            waiter or seq,
            list(seq.block_hashes[:whole]),
            tuple(seq.token_ids[: whole * bs]),
            seq.root_hash,
            first,
            usable,
            deadline=time.monotonic() + self._load_seconds(tokens),
        )
        try:
            self._loads.put_nowait(job)
        except queue.Full:
            return False
        job.waiter.loading = True
        self._jobs.append(job)
        return True

    def _load_seconds(self, tokens: int) -> float:
        if self.load_timeout is not None:
            return self.load_timeout
        return max(MIN_LOAD_SECONDS, tokens * self.seconds_per_token)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn how fast this engine computes prompts, which bounds how long a load may take."""
        if tokens >= 64:
            self.seconds_per_token = 0.8 * self.seconds_per_token + 0.2 * seconds / tokens

    @property
    def loading(self) -> bool:
        return bool(self._jobs)

    def wait(self, timeout: float) -> None:
        """Block until some load lands or `timeout` passes (when nothing else can run)."""
        with self._landed:
            if not any(job.done.is_set() for job in self._jobs):
                self._landed.wait(timeout)

    def poll(self, running: int) -> None:
        """Install landed loads and abandon overdue ones.

        With `running` sequences in flight, a bounded slice of blocks is installed per call and
        that many blocks are left free for them to grow into.
        """
        now = time.monotonic()
        budget = INSTALL_BLOCKS_PER_STEP if running else None
        for job in list(self._jobs):
            if job.done.is_set():
                budget = self._install(job, budget, keep_free=running)
                if job.chunks is None or job.installed >= len(job.chunks):
                    self._finish(job)
            elif now > job.deadline:
                self.counters.load_timeouts += 1
                job.cancelled = True
                self._finish(job)
            if budget is not None and budget <= 0:
                break

    def forget(self, seq: Sequence) -> None:
        """`seq` ended before its loads landed: drop them (held blocks go with manager.free)."""
        for job in [job for job in self._jobs if job.waiter is seq]:
            job.cancelled = True
            self._finish(job)

    def _finish(self, job: LoadJob) -> None:
        self._jobs.remove(job)
        job.waiter.loading = any(other.waiter is job.waiter for other in self._jobs)

    def _install(self, job: LoadJob, budget: int | None, keep_free: int) -> int | None:
        """Copy landed chunks into free pool blocks, index them and hold them for the sequence."""
        bs = self.manager.block_size
        chunks = job.chunks or []
        while job.installed < len(chunks) and (budget is None or budget > 0):
            chunk = chunks[job.installed]
            count = min(chunk.num_blocks, job.usable - chunk.position)
            have = self.manager.cached_prefix(job.seq, chunk.position + count)
            skip = max(0, len(have) - chunk.position)
            if len(have) < chunk.position or self.pool.num_free - keep_free < count - skip:
                job.installed = len(chunks)  # the chain broke or the pool is full: compute the rest
                break
            # Hold the chain up to here too: without its head, the loaded blocks could not be found.
            self.manager.hold(job.seq, have[len(job.seq.held_blocks) :])
            blocks = [self.pool.take() for _ in range(count - skip)]
            self.storage.write_blocks([b.block_id for b in blocks], [v[skip:count] for v in chunk.views])
            parent: bytes | int = have[-1].serial if have else job.root
            for i, block in enumerate(blocks):
                position = chunk.position + skip + i
                tokens = job.token_ids[position * bs : (position + 1) * bs]
                serial = self.pool.register(block, job.keys[position], tokens, parent, position)
                assert serial == block.serial, "a block the walk did not find is indexed"
                block.offloaded = True
                parent = serial
            self.manager.hold(job.seq, blocks)
            for block in blocks:
                self.pool.release(block)  # the hold keeps it; take()'s own reference goes
            self.counters.load_tokens += len(blocks) * bs
            job.installed += 1
            if budget is not None:
                budget -= len(blocks)
        if job.installed and job.installed == len(chunks):
            self.counters.loads += 1
        return budget

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            if not job.cancelled and time.monotonic() < job.deadline:
                try:
                    job.chunks = self._fetch(job)
                except Exception:  # a tier bug must not kill the loader; the prompt is computed instead
                    log.exception("loading KV blocks from the tiers failed")
            job.done.set()
            with self._landed:
                self._landed.notify_all()

    def _fetch(self, job: LoadJob) -> list[LoadedChunk]:
        """The longest verified run of chunks, from `job.first` on, that the tiers hold."""
        keys = job.keys[job.first :]
        where: dict[bytes, Tier] = {}
        for tier in self.tiers:
            missing = [key for key in keys if key not in where]
            if not missing or time.monotonic() > job.deadline:
                break
            for key, present in zip(missing, tier.contains(missing)):
                if present:
                    where[key] = tier
        plan = self._longest_run(job, where)
        blobs: dict[bytes, Buffer | None] = {}
        for tier in self.tiers:
            runs = [(start, end) for start, end in plan if where[job.keys[end]] is tier]
            if runs and time.monotonic() < job.deadline:
                wanted = [job.keys[end] for _, end in runs]
                # a value larger than its chunk can be is refused before it is read (a shared store's writer)
                limits = [self.format.max_entry_bytes(end - start + 1) for start, end in runs]
                blobs.update(zip(wanted, tier.get(wanted, limits)))
        chunks: list[LoadedChunk] = []
        for position, end in plan:
            key = job.keys[end]
            blob = blobs.get(key)
            loaded = None if blob is None else self._verify(job, where[key], key, blob, position, end)
            if loaded is None:
                break
            chunks.append(loaded)
            host = self.tiers[0]
            if where[key] is not host and host.name == "host":  # promote, as the next hit is likely soon
                host.put([(key, blob)])
        return chunks

    def _longest_run(self, job: LoadJob, where: dict[bytes, Tier]) -> list[tuple[int, int]]:
        """(first, last) block positions of each chunk in the run; a chunk that ends early ends it."""
        run = []
        n = len(job.keys)
        for start in range(job.first, n, self.chunk_blocks):
            stop = min(start + self.chunk_blocks, n)
            end = next((e for e in range(stop - 1, start - 1, -1) if job.keys[e] in where), None)
            if end is None:
                break
            run.append((start, end))
            if end < start + self.chunk_blocks - 1:
                break
        return run

    def _verify(
        self, job: LoadJob, tier: Tier, key: bytes, blob: Buffer, position: int, end: int
    ) -> LoadedChunk | None:
        bs = self.manager.block_size
        parent = job.keys[position - 1] if position else job.root
        expected = job.token_ids[position * bs : (end + 1) * bs]
        try:
            info, views = unpack(self.format, blob)
            if (info.key, info.parent, info.position, info.num_blocks, info.token_ids) != (
                key,
                parent,
                position,
                end - position + 1,
                expected,
            ):
                raise BadEntry("mismatch", "the entry's chain key, position or tokens are not the ones asked for")
        except BadEntry as e:
            self.counters.bad_entries += 1
            tier.stats.corrupt += 1
            log.warning("dropped a bad KV entry %s from the %s tier (%s)", key.hex(), tier.name, e)
            tier.delete([key])
            return None
        return LoadedChunk(position, end - position + 1, views, tier.name)

    # --- lifetime ---------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, float]]:
        """Every tier's counters and capacity (None where the store keeps its own) by tier name, and
        the controller's own under "offload"."""
        out = {tier.name: {**tier.stats.as_dict(), "capacity_bytes": tier.capacity_bytes} for tier in self.tiers}
        out["offload"] = dict(vars(self.counters))
        return out

    def close(self) -> None:
        """Stop the threads (queued stores are written first) and close the tiers."""
        self._closed = True
        self._loads.put(None)
        self._stores.put(None)
        for thread in self._threads:
            thread.join(timeout=30)
        for tier in self.tiers:
            tier.close()


def chunk_blocks_for(chunk_tokens: int, block_size: int) -> int:
    """Blocks per chunk; the chunk must be a whole number of blocks."""
    if chunk_tokens <= 0 or chunk_tokens % block_size:
        raise ValueError(f"kv_tier_chunk_tokens={chunk_tokens} must be a positive multiple of block_size={block_size}")
    return chunk_tokens // block_size
