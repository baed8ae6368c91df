"""The Redis tier against real redis-server processes: standalone (TCP and unix socket) and a 3-master cluster."""

import dataclasses
import logging
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import torch

from kvbank.cache.tiers.entry import BadEntry, EntryFormat, EntryInfo, pack, tier_key, unpack
from kvbank.cache.tiers.redis import BACKOFF_START_S, RedisTier, _ReplyReader

pytest_plugins = ["redis_servers"]  # redis_server, unix_redis_server, redis_cluster

TIMEOUT_S = 0.3


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def blob(i: int, size: int = 200_000) -> bytes:
    return bytes([i % 251]) * size + i.to_bytes(8, "big")


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Clock:
    """A clock that moves only when the test says: a tier timed by it backs off until the test ends the interval."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def traffic(watcher: redis.Redis) -> tuple[int, int]:
    """(connections accepted, commands run but INFO) by the server `watcher` is connected to, so far: all the
    tiers sent it once the watcher is connected (its own INFOs left out)."""
    connections = watcher.info("stats")["total_connections_received"]
    calls = watcher.info("commandstats")
    return connections, sum(stats["calls"] for name, stats in calls.items() if name != "cmdstat_info")


@pytest.fixture
def make_tier():
    tiers = []

    def make(url: str, namespace: str = "model-a:fp16", clock: Clock | None = None, **options) -> RedisTier:
        tiers.append(RedisTier(url, namespace, timeout_seconds=TIMEOUT_S, **options))
        if clock is not None:
            tiers[-1].clock = clock
        return tiers[-1]

    yield make
    for tier in tiers:
        tier.close()


@pytest.mark.parametrize("server", ["redis_server", "unix_redis_server", "redis_cluster"])
def test_batch_round_trip(server, request, make_tier):
    url = request.getfixturevalue(server).url
    tier = make_tier(url, namespace=f"round-trip-{server}")
    tensor = torch.arange(300_000, dtype=torch.int32)  # a non-byte buffer: stored by its bytes
    entries = [(key(i), blob(i)) for i in range(6)]
    entries += [(key(6), bytearray(blob(6))), (key(7), memoryview(tensor.numpy()))]

    assert tier.put(entries) == len(entries)
    got = tier.get([key(i) for i in range(10)])

    assert got[:7] == [blob(i) for i in range(7)]
    assert got[7] == tensor.numpy().tobytes()
    assert got[8:] == [None, None]
    assert all(isinstance(b, bytearray) for b in got[:8])  # the direct read path
    stored = sum(len(memoryview(b).cast("B")) for _, b in entries)
    assert (tier.stats.hits, tier.stats.misses, tier.stats.load_bytes, tier.stats.store_bytes) == (8, 2, stored, stored)
    assert (tier.stats.errors, tier.stats.stores_dropped) == (0, 0)


def test_cluster_spreads_a_batch_over_its_masters(redis_cluster, make_tier):
    tier = make_tier(redis_cluster.url, namespace="spread")
    assert tier.put([(key(i), blob(i, 100)) for i in range(32)]) == 32
    per_node = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            per_node.append(len(client.keys("kvbank:spread:*")))
    assert sum(per_node) == 32
    assert sum(n > 0 for n in per_node) > 1


def test_contains_and_delete(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    tier.put([(key(i), blob(i, 100)) for i in range(3)])
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, True, True, False]

    tier.delete([key(1), key(3)])

    assert tier.contains([key(0), key(1), key(2)]) == [True, False, True]
    assert tier.get([key(1)]) == [None]


def test_entries_live_under_the_namespaced_key(redis_server, make_tier):
    tier = make_tier(redis_server.url, namespace="smollm2:int8")
    tier.put([(key(5), b"entry")])
    with redis_server.client() as client:
        assert client.get(f"kvbank:smollm2:int8:{key(5).hex()}") == b"entry"


def test_namespaces_do_not_see_each_other(redis_server, make_tier):
    fp16 = make_tier(redis_server.url, namespace="model-a:fp16")
    int8 = make_tier(redis_server.url, namespace="model-a:int8")
    fp16.put([(key(1), b"fp16 entry")])

    assert int8.get([key(1)]) == [None]
    assert int8.contains([key(1)]) == [False]
    int8.delete([key(1)])
    assert fp16.get([key(1)]) == [b"fp16 entry"]


def test_ttl_expires_entries(redis_server, make_tier):
    tier = make_tier(redis_server.url, ttl_seconds=0.2)
    tier.put([(key(1), b"short-lived")])
    with redis_server.client() as client:
        assert 0 < client.pttl(f"{tier.prefix}{key(1).hex()}") <= 200
    assert wait_until(lambda: tier.contains([key(1)]) == [False])


def test_without_ttl_entries_do_not_expire(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    tier.put([(key(1), b"kept")])
    with redis_server.client() as client:
        assert client.pttl(f"{tier.prefix}{key(1).hex()}") == -1


def test_killed_server_gives_fast_misses_then_hits_after_restart(redis_server, make_tier, clock, caplog):
    tier = make_tier(redis_server.url, clock=clock)
    tier.put([(key(i), blob(i, 1000)) for i in range(4)])
    keys = [key(i) for i in range(4)]
    redis_server.kill()

    with caplog.at_level(logging.INFO, logger="kvbank.tiers"):
        for _ in range(20):
            assert tier.get(keys) == [None] * 4
            assert tier.contains(keys) == [False] * 4
            assert tier.put([(key(9), b"lost")]) == 0
            tier.delete(keys)

        assert tier.stats.errors == 1  # the first call faults; in the backoff the other 79 skip the network
        assert tier.stats.stores_dropped == 20
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
        assert redis_server.url in warnings[0].getMessage()

        redis_server.restart()  # same port, empty: what we store now must be served again
        clock.advance(BACKOFF_START_S)
        assert tier.put([(key(1), b"again")]) == 1
        assert tier.get([key(1)]) == [b"again"]

    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"redis tier at {redis_server.url} is back"
    ]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_backoff_skips_the_network_until_the_interval_has_passed(redis_server, make_tier, clock):
    tier = make_tier(redis_server.url, clock=clock)
    redis_server.kill()
    assert tier.get([key(1)]) == [None]
    assert tier.stats.errors == 1
    redis_server.start()  # back, but the tier does not know until its backoff ends

    with redis_server.client() as watcher:
        before = traffic(watcher)
        clock.advance(BACKOFF_START_S / 2)
        assert tier.get([key(1)]) == [None]
        assert tier.contains([key(1)]) == [False]
        assert traffic(watcher) == before  # not a connection, not a command
        assert tier.put([(key(1), b"x")]) == 0
        assert tier.stats.errors == 1

        clock.advance(BACKOFF_START_S / 2)
        assert tier.put([(key(1), b"x")]) == 1
        assert tier.get([key(1)]) == [b"x"]
        connections, commands = traffic(watcher)
    assert connections > before[0] and commands >= before[1] + 2


def test_a_stalled_server_costs_at_most_a_timeout(redis_server, make_tier, clock):
    tier = make_tier(redis_server.url, clock=clock)
    tier.put([(key(1), b"x")])
    with redis_server.client() as watcher:
        connections, commands = traffic(watcher)
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            assert tier.get([key(1)]) == [None]
            assert tier.get([key(1)]) == [None]
            assert tier.stats.errors == 1
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        # Resumed, the server runs what waited in its sockets before the watcher's INFO: one GET on the
        # pooled connection was all the tier sent, so the two calls waited out one timeout, not a second
        # one on a new connection (the redis-py way) or the network again (the backoff).
        assert traffic(watcher) == (connections, commands + 1)


def test_server_started_after_the_tier(redis_server, make_tier):
    redis_server.kill()
    tier = make_tier(redis_server.url)  # no server yet: constructing must not fail
    assert tier.get([key(1)]) == [None]

    redis_server.start()

    assert wait_until(lambda: tier.put([(key(1), b"late")]) == 1)
    assert tier.get([key(1)]) == [b"late"]


def test_cluster_node_outage_and_return(redis_cluster, make_tier, clock):
    tier = make_tier(redis_cluster.url, namespace="cluster-outage", clock=clock)
    keys = [key(i) for i in range(16)]
    tier.put([(k, b"v") for k in keys])
    node = redis_cluster.nodes[1]
    live = [n.client() for n in redis_cluster.nodes if n is not node]
    node.kill()
    try:
        assert tier.get(keys) == [None] * 16  # one master lost is an outage of the tier, answered as misses
        assert tier.stats.errors == 1
        sent = [traffic(watcher) for watcher in live]
        assert tier.put([(k, b"v") for k in keys]) == 0  # in the backoff: the live masters hear nothing
        assert [traffic(watcher) for watcher in live] == sent
        assert (tier.stats.errors, tier.stats.stores_dropped) == (1, 16)
    finally:
        for watcher in live:
            watcher.close()
        node.start()
        redis_cluster.wait_ok()
    clock.advance(BACKOFF_START_S)
    assert tier.put([(k, b"w") for k in keys]) == 16
    assert tier.get(keys) == [b"w"] * 16


def test_a_full_redis_drops_stores_without_an_outage(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    tier.put([(key(0), b"stored before")])
    with redis_server.client() as client:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 200_000)
    assert tier.put([(key(1), blob(1, 3_000_000)), (key(2), blob(2, 3_000_000))]) == 0

    assert (tier.stats.stores_dropped, tier.stats.errors) == (2, 2)
    assert tier.get([key(0)]) == [b"stored before"]  # answered at once: a refused write is not an outage


def test_threads_share_one_tier(redis_server, make_tier):
    tier = make_tier(redis_server.url)

    def round_trip(thread: int) -> bool:
        keys = [key(1000 * thread + i) for i in range(20)]
        tier.put([(k, blob(thread, 10_000) + k) for k in keys])
        return tier.get(keys) == [blob(thread, 10_000) + k for k in keys]

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, range(8)))
    assert (tier.stats.hits, tier.stats.errors) == (160, 0)


def test_a_stalled_cluster_master_costs_at_most_a_timeout(redis_cluster, make_tier, clock):
    tier = make_tier(redis_cluster.url, namespace="cluster-stall", clock=clock)
    keys = [key(i) for i in range(32)]
    tier.put([(k, b"v") for k in keys])
    node = redis_cluster.nodes[2]
    with node.client() as watcher:
        held = len(watcher.keys("kvbank:cluster-stall:*"))
        connections, commands = traffic(watcher)
        os.kill(node.process.pid, signal.SIGSTOP)
        try:
            assert tier.get(keys) == [None] * 32
            assert tier.get(keys) == [None] * 32
            assert tier.stats.errors == 1
        finally:
            os.kill(node.process.pid, signal.SIGCONT)
        # one batch of GETs, one per key it holds, on the pooled connection: one timeout waited, not two
        assert traffic(watcher) == (connections, commands + held)
    clock.advance(BACKOFF_START_S)
    assert tier.get(keys) == [b"v"] * 32


def test_refresh_stats_reports_the_store(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    tier.put([(key(i), blob(i, 500_000)) for i in range(4)])
    tier.refresh_stats()
    assert tier.stats.entries == 4
    assert tier.stats.bytes_used > 4 * 500_000
    assert tier.capacity_bytes is None


def test_refresh_stats_sums_the_cluster_masters(redis_cluster, make_tier):
    tier = make_tier(redis_cluster.url, namespace="refresh")
    tier.put([(key(i), b"v") for i in range(8)])
    tier.refresh_stats()
    assert tier.stats.entries >= 8
    assert tier.stats.bytes_used > 3 * 500_000  # each master's baseline is about 1 MB


@pytest.mark.parametrize("url", ["http://localhost:6379", "localhost:6379", "memcached://:secret@cache:11211"])
def test_bad_url_scheme_is_refused(url):
    with pytest.raises(ValueError, match="redis://, rediss://, unix://") as error:
        RedisTier(url, "ns")
    assert "secret" not in str(error.value)


def test_namespace_with_hash_tag_braces_is_refused():
    with pytest.raises(ValueError, match="braces"):
        RedisTier("redis://127.0.0.1:1", "model-{a}")


def test_password_is_masked_in_logs(make_tier, caplog):
    tier = make_tier("redis://:hunter2@127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers"):
        tier.get([key(1)])
    assert "hunter2" not in caplog.text and "redis://:***@127.0.0.1:1" in caplog.text


def test_a_signed_entry_changed_in_redis_without_the_key_is_refused(redis_server, make_tier):
    """Redis stores what anyone with access writes: only the tier key tells kvbank's entries apart."""
    fmt = EntryFormat("m", "bfloat16", "auto", 16, (("bfloat16", (16, 3, 64)),))
    keyed = dataclasses.replace(fmt, key=tier_key("a-tier-key-of-32-characters-----"))
    info = EntryInfo(key(1), bytes(16), 0, 2, tuple(range(32)))
    signed = bytes(pack(keyed, info, lambda views: [v.normal_() for v in views]).numpy())
    tier = make_tier(redis_server.url)
    assert tier.put([(key(1), signed)]) == 1
    assert unpack(keyed, tier.get([key(1)])[0])[0] == info
    with pytest.raises(BadEntry, match="signed with a tier key, and this engine has no tier key"):
        unpack(fmt, tier.get([key(1)])[0])  # a reader without the key: refused, not a crash

    forged = pack(fmt, info, lambda views: [v.zero_() for v in views])  # all an attacker can sign
    redis_server.client().set(f"{tier.prefix}{key(1).hex()}", bytes(forged.numpy()))
    with pytest.raises(BadEntry) as refused:
        unpack(keyed, tier.get([key(1)])[0])
    assert refused.value.reason == "mac"
    assert unpack(fmt, tier.get([key(1)])[0])[0] == info  # without a key it would be served


# --- the direct read path: GET replies received into buffers of each value's length --------------------------------

SCRATCH = _ReplyReader.SCRATCH_BYTES


def pattern(size: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()


@pytest.mark.parametrize("server", ["redis_server", "unix_redis_server", "redis_cluster"])
def test_direct_reads_are_exact_around_the_scratch_buffer(server, request, make_tier):
    """Values of every size around the reader's scratch buffer, big ones before small ones, nils between: the
    headers and values straddle buffer edges in every way, and each value comes back byte for byte."""
    tier = make_tier(request.getfixturevalue(server).url, namespace=f"direct-{server}")
    sizes = [3_000_001, 0, 1, SCRATCH - 1, SCRATCH, SCRATCH + 1, 2 * SCRATCH + 3, 17, 5_898_240, SCRATCH - 6, 2]
    values = [pattern(size, seed) for seed, size in enumerate(sizes)]
    assert tier.put([(key(i), v) for i, v in enumerate(values)]) == len(values)
    wanted = [key(i) for i in range(len(values))]
    wanted.insert(3, key(999))  # a miss in the middle of the pipeline
    wanted.append(key(998))

    got = tier.get(wanted)

    assert got[3] is None and got[-1] is None
    del got[3], got[-1]
    assert [len(g) for g in got] == sizes
    assert all(isinstance(g, bytearray) for g in got)  # read by the direct path, not redis-py
    assert got == values
    assert (tier.stats.hits, tier.stats.misses, tier.stats.errors) == (len(sizes), 2, 0)
    by_redis_py = make_tier(tier._raw_url, namespace=f"direct-{server}", direct_reads=False).get(wanted)
    assert by_redis_py == [*values[:3], None, *values[3:], None]
    assert all(isinstance(b, bytes) for b in by_redis_py if b is not None)


def test_a_corrupted_or_truncated_value_is_never_served(redis_server, make_tier):
    """The direct path hands over what Redis holds; the entry's checksum and lengths refuse anything changed."""
    fmt = EntryFormat("m", "bfloat16", "auto", 16, (("bfloat16", (16, 3, 64)),))
    info = EntryInfo(key(1), bytes(16), 0, 8, tuple(range(128)))
    entry = bytes(pack(fmt, info, lambda views: [v.normal_() for v in views]).numpy())
    tier = make_tier(redis_server.url)
    tier.put([(key(1), entry)])
    assert unpack(fmt, tier.get([key(1)])[0])[0] == info
    name = f"{tier.prefix}{key(1).hex()}"
    flipped = bytearray(entry)
    flipped[len(entry) // 2] ^= 0x40
    with redis_server.client() as client:
        for changed, reason in ((entry[:-1], "truncated"), (entry + b"\0", "truncated"), (flipped, "checksum")):
            client.set(name, bytes(changed))
            with pytest.raises(BadEntry) as refused:
                unpack(fmt, tier.get([key(1)])[0])
            assert refused.value.reason == reason


def test_an_error_reply_is_a_miss_and_the_rest_of_the_batch_is_served(redis_server, make_tier):
    tier = make_tier(redis_server.url)
    tier.put([(key(1), blob(1)), (key(3), blob(3))])
    with redis_server.client() as client:
        client.rpush(f"{tier.prefix}{key(2).hex()}", "not a string")  # GET answers WRONGTYPE

    assert tier.get([key(1), key(2), key(3)]) == [blob(1), None, blob(3)]
    assert tier.get([key(1), key(3)]) == [blob(1), blob(3)]  # the connection is still in step
    assert tier.stats.errors == 1


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        (b"$10\r\nhello", redis.ConnectionError),  # the server went away inside the value
        (b"$3\r\nhelXX\r\n", redis.InvalidResponse),  # longer than its length
        (b"$-7\r\n", redis.InvalidResponse),
        (b"+OK\r\n", redis.InvalidResponse),
        (b"$" + b"9" * 2000, redis.InvalidResponse),  # a header that never ends
    ],
)
def test_the_reply_reader_refuses_a_broken_stream(stream, error):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(5)
        theirs.sendall(b"$5\r\nhello\r\n$-1\r\n_\r\n" + stream)
        theirs.shutdown(socket.SHUT_WR)
        reader = _ReplyReader(ours)
        assert reader.values(3) == [bytearray(b"hello"), None, None]
        with pytest.raises(error):
            reader.values(1)
