"""Tiers below the pool, end to end with the real model: a prefix that left the pool (eviction,
restart, another engine) comes back from host RAM, disk or Redis and gives the same tokens as
computing it; bad entries and outages only ever cost a recompute."""

from __future__ import annotations

import json
import os
import signal
import struct
import time
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from serving import start_server, stop_server, wait_healthy

from kvbank import LLM, SamplingParams, cli
from kvbank.cache import offload
from kvbank.cache.frames import Frame
from kvbank.cache.quant import FullPrecision, PerTokenInt8, codecs_for
from kvbank.cache.recall import FrameArchive, rotate
from kvbank.cache.tiers.entry import KEYED, MAGIC, PREFIX_BYTES, VERSION, EntryFormat, digest, pack, tier_key, unpack
from kvbank.cache.tiers.host import HostTier
from kvbank.config import EngineConfig

pytest_plugins = ["redis_servers"]

DATA = Path(__file__).parent / "data" / "austen_excerpt.txt"  # a fresh clone has no ../shared
GREEDY = SamplingParams(max_tokens=6, temperature=0)
# The default configuration (bfloat16, packed weights) with a small pool and chunks: a 600-token
# prompt is ten chunks, and two fillers evict everything.
SMALL = dict(num_gpu_blocks=96, kv_tier_chunk_tokens=64)


def _doc_tokens(llm: LLM, start: int, count: int) -> list[int]:
    text = DATA.read_text()[start * 8 : start * 8 + count * 8]
    return llm.get_tokenizer().encode(text)[:count]


def _run(llm: LLM, ids: list[int], salt: str | None = None) -> tuple[list[int], int]:
    prompt: dict = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    out = llm.generate(prompt, GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _fill_pool(llm: LLM) -> None:
    """Fill the pool with unrelated prompts so that pool pressure evicts every block of earlier prompts."""
    for k in range(2):
        llm.generate({"prompt_token_ids": [100 + k] * 1200}, SamplingParams(max_tokens=1))
    assert llm.stats()["num_blocks"] == SMALL["num_gpu_blocks"]


def _evict_pool(llm: LLM) -> None:
    """Evict every cached block of earlier prompts, as pool pressure does (the tiers see the same
    evictions: write-back stores them), without the cost of computing prompts to fill the pool."""
    assert llm.reset_prefix_cache() > 0


def _flush(llm: LLM) -> None:
    """Wait until the writer thread has handed every queued entry to the tiers."""
    assert llm.engine.offload.flush()


@pytest.fixture(scope="module")
def cold():
    """Reference outputs computed with no cache at all."""
    llm = LLM(**SMALL, enable_prefix_caching=False)
    ids = _doc_tokens(llm, 0, 600)
    tokens, cached = _run(llm, ids)
    assert cached == 0
    return ids, tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_host_tier_serves_an_evicted_prefix_with_identical_output(cold, kv_cache_dtype):
    ids, _ = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_cache_dtype=kv_cache_dtype) as llm:
        first, cached = _run(llm, ids)
        assert cached == 0
        _flush(llm)
        _evict_pool(llm)
        again, cached = _run(llm, ids)
        stats = llm.tier_stats()
    if kv_cache_dtype == "auto":
        assert first == cold[1]
    assert again == first
    assert cached == (len(ids) - 1) // 16 * 16  # every whole block but the one holding the last token
    assert stats["host"]["hits"] >= 9 and stats["offload"]["loads"] == 1
    assert stats["offload"]["load_tokens"] >= 512


def test_disk_tier_survives_a_restart_and_refuses_bad_entries(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 0)
        fmt = llm.engine.offload.format
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) == 10  # nine chunks of 64 tokens and the part-chunk the prompt ends with
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 592)
        assert llm.tier_stats()["disk"]["hits"] == 10

    first_chunk = next(f for f in files if unpack(fmt, f.read_bytes())[0].position == 0)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        for n, spoil in enumerate((_flip_byte, _truncate, lambda path: _rewrite_for_another_model(fmt, path))):
            spoil(first_chunk)
            assert _run(llm, ids) == (expected, 0)  # the first chunk is bad: nothing can chain after it
            assert llm.tier_stats()["offload"]["bad_entries"] == n + 1
            _flush(llm)
            unpack(fmt, first_chunk.read_bytes())  # deleted, then written anew by the recompute
            _evict_pool(llm)
        assert _run(llm, ids) == (expected, 592)
        assert llm.tier_stats()["disk"]["corrupt"] == 3


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _rewrite_for_another_model(fmt: EntryFormat, path: Path) -> None:
    """The same key and tokens, validly checksummed, but written by another model."""
    info, views = unpack(fmt, path.read_bytes())
    other = EntryFormat("0" * 32, fmt.dtype, fmt.kv_format, fmt.block_size, fmt.layout)

    def fill(out):
        for dst, src in zip(out, views):
            dst.copy_(src)

    path.write_bytes(pack(other, info, fill).numpy().tobytes())


# --- tamper evidence: the tier key, and hostile headers -----------------------------------------

TIER_KEY = "a-tier-key-of-32-characters-----"
OTHER_KEY = "another-key-of-enough-characters"


def _first_chunk(fmt: EntryFormat, directory: Path) -> Path:
    return next(f for f in directory.glob("*/*.kv") if unpack(fmt, f.read_bytes())[0].position == 0)


def _resign(blob: bytes | bytearray, header: bytes | None = None, flags: int = 0, payload_len: int | None = None):
    """`blob` with its header (and declared payload length) replaced and an unkeyed checksum that
    matches: what anyone who can write the store, but has no key, can make."""
    header_len, real_payload = struct.unpack_from("<IQ", blob, 8)
    if header is None:
        header = bytes(blob[PREFIX_BYTES : PREFIX_BYTES + header_len])
    header += b" " * (-(PREFIX_BYTES + len(header)) % 16)
    fields = struct.pack("<4sHHIQ", MAGIC, VERSION, flags, len(header), payload_len or real_payload)
    body = header + bytes(blob[PREFIX_BYTES + header_len :])
    return fields + digest(None, fields, body) + body


def _zero_payload(path: Path, flags: int = 0) -> None:
    """New K/V (zeros) under the same header, checksummed again."""
    blob = bytearray(path.read_bytes())
    header_len, payload_len = struct.unpack_from("<IQ", blob, 8)
    blob[PREFIX_BYTES + header_len :] = bytes(payload_len)
    path.write_bytes(_resign(blob, flags=flags))


def test_without_a_key_a_payload_rewritten_with_its_checksum_is_served(cold, tmp_path):
    """The documented trust boundary: without a key, whoever can write the store decides what is served."""
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 0)
        fmt = llm.engine.offload.format
    _zero_payload(_first_chunk(fmt, tmp_path))
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids)[1] == 592
        assert llm.tier_stats()["offload"]["bad_entries"] == 0


def test_with_a_key_a_payload_rewritten_without_it_is_refused_and_replaced(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_tier_key=TIER_KEY) as llm:
        assert _run(llm, ids) == (expected, 0)
        fmt = llm.engine.offload.format
    assert fmt.key == tier_key(TIER_KEY)
    first = _first_chunk(fmt, tmp_path)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_tier_key=TIER_KEY) as llm:
        for n, flags in enumerate((0, KEYED)):  # an honest unkeyed checksum, or one that claims the key
            _zero_payload(first, flags)
            assert _run(llm, ids) == (expected, 0)
            assert llm.tier_stats()["offload"]["bad_entries"] == n + 1
            _flush(llm)
            unpack(fmt, first.read_bytes())  # deleted, then written anew and signed
            _evict_pool(llm)
        assert _run(llm, ids) == (expected, 592)
        assert llm.tier_stats()["disk"]["corrupt"] == 2


def test_entries_of_another_key_or_of_none_are_refused_cleanly(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_tier_key=TIER_KEY) as llm:
        assert _run(llm, ids) == (expected, 0)
    for key in (OTHER_KEY, None):  # the first chunk breaks the run: one bad entry each
        with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_tier_key=key) as llm:
            assert _run(llm, ids) == (expected, 0)
            assert llm.tier_stats()["offload"]["bad_entries"] == 1
            assert llm.tier_stats()["disk"]["corrupt"] == 1


def _edit_header(change):
    def edit(blob: bytes) -> bytes:
        header_len = struct.unpack_from("<I", blob, 8)[0]
        header = json.loads(blob[PREFIX_BYTES : PREFIX_BYTES + header_len])
        change(header)
        return _resign(blob, json.dumps(header).encode())

    return edit


HOSTILE = {
    "missing model": _edit_header(lambda h: h.pop("model")),
    "nested 10,000 deep": lambda blob: _resign(blob, b"[" * 10_000 + b"]" * 10_000),
    "wrong types": _edit_header(lambda h: h.update(block_size="16", position=[0])),
    "huge declared size": lambda blob: _resign(blob, payload_len=2**62),
}


def test_hostile_headers_with_a_valid_checksum_are_deleted_and_counted(cold, tmp_path, caplog):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 0)
        fmt = llm.engine.offload.format
    first = _first_chunk(fmt, tmp_path)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        for n, spoil in enumerate(HOSTILE.values()):
            first.write_bytes(spoil(first.read_bytes()))
            assert _run(llm, ids) == (expected, 0)
            assert llm.tier_stats()["offload"]["bad_entries"] == n + 1
            _flush(llm)
            unpack(fmt, first.read_bytes())  # deleted, then written anew by the recompute
            _evict_pool(llm)
        assert llm.tier_stats()["disk"]["corrupt"] == len(HOSTILE)
    assert "loading KV blocks from the tiers failed" not in caplog.text  # no traceback: a bad entry


def _frame_archive(host: HostTier, key: str | None, codecs) -> FrameArchive:
    """A FrameArchive on `host` with tier key `key`, storing layers through `codecs`."""
    fmt = EntryFormat("m", "float32", "auto", 16, (), key=tier_key(key))
    offload = types.SimpleNamespace(
        tiers=[host],
        format=fmt,
        store_later=lambda tier, k, data: tier.put([(k, data)]) == 1,
        delete_later=lambda tier, keys: tier.delete(keys),
        flush=lambda: True,
    )
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    return FrameArchive(offload, b"namespace", inv_freq, limit=8, codecs=codecs)


def test_archived_frames_are_signed_with_the_tier_key():
    host = HostTier(2**20)

    def archive(key: str | None) -> FrameArchive:
        return _frame_archive(host, key, [(FullPrecision(torch.float32), FullPrecision(torch.float32))] * 2)

    keys, values = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    frame = Frame(index=0, start=0, length=3, digest=bytes(16), embeds=None, sink=False)

    def stored(writer: str | None, reader: str | None) -> int:
        host.delete(list(host._entries))
        written, read = archive(writer), archive(reader)
        written.store(frame, [1, 2, 3], keys, values, first=0)
        found = read.load(list(written.frames), (2, 1, 8), torch.float32)
        assert read.stats.corrupt == 1 - len(found)
        return len(found)

    assert [stored(TIER_KEY, TIER_KEY), stored(None, None)] == [1, 1]
    assert [stored(None, TIER_KEY), stored(OTHER_KEY, TIER_KEY), stored(TIER_KEY, None)] == [0, 0, 0]


def test_archived_frames_take_the_pools_format_and_another_format_never_reads_them():
    """On an int8 pool a frame is archived as the pool holds it, int8 codes and a float16 scale per
    token and head (a bfloat16 copy's bytes about halved), and loads back as those codes' values;
    an archive of another format refuses it (the formats are part of its key and its header)."""
    host = HostTier(2**20)
    layers, tokens, heads, dim = 2, 5, 3, 8
    keys = torch.randn(layers, tokens, heads, dim).to(torch.bfloat16)
    values = torch.randn(layers, tokens, heads, dim).to(torch.bfloat16)
    frame = Frame(index=0, start=0, length=tokens, digest=bytes(16), embeds=None, sink=False)
    sizes = {}
    for name in ("auto", "int8"):
        host.delete(list(host._entries))
        archive = _frame_archive(host, None, [codecs_for(name, torch.bfloat16)] * layers)
        archive.store(frame, list(range(tokens)), keys, values, first=0)
        sizes[name] = sum(len(blob) for blob in host._entries.values())
        ((_, k, v),) = archive.load(list(archive.frames), (layers, heads, dim), torch.bfloat16)
        assert archive.stats.recalled == 1 and archive.stats.corrupt == 0
        plain = rotate(keys, -torch.arange(tokens), archive.inv_freq).to(torch.bfloat16)  # keys at no position
        if name == "int8":
            codec = PerTokenInt8()
            for got, wanted in ((k, plain), (v, values)):
                assert torch.equal(got, codec.dequantize(codec.quantize(wanted), torch.float32).to(torch.bfloat16))
                assert not torch.equal(got, wanted)  # really stored as codes
        else:
            assert torch.equal(k, plain) and torch.equal(v, values)
        other = _frame_archive(host, None, [codecs_for("fp8_e4m3" if name == "int8" else "int8", torch.bfloat16)] * 2)
        other.frames.extend(archive.frames)
        refused_by_tier = host.stats.corrupt
        assert other.load(list(other.frames), (layers, heads, dim), torch.bfloat16) == []
        # the entry is another format's: refused, never served (by the tier when it is longer than this format's)
        assert other.stats.corrupt + host.stats.corrupt - refused_by_tier == 1
    payload = layers * tokens * heads * 2  # [layers, tokens, heads] per side
    assert sizes["auto"] - sizes["int8"] == payload * (2 * dim - (dim + 2))


def test_the_tier_key_flag_defaults_to_the_environment_and_is_never_shown(monkeypatch, capsys):
    monkeypatch.setenv("KVBANK_TIER_KEY", TIER_KEY)
    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).kv_tier_key == TIER_KEY
    assert parser.parse_args(["serve", "--kv-tier-key", OTHER_KEY]).kv_tier_key == OTHER_KEY
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--kv-tier-key KEY" in shown and TIER_KEY not in shown
    assert TIER_KEY not in repr(EngineConfig(kv_tier_key=TIER_KEY))
    with pytest.raises(ValueError, match="kv_tier_key must be a string of at least 16 characters, got 6 characters"):
        EngineConfig(kv_tier_key="hunter")


def test_keyed_redis_entries_rewritten_without_the_key_are_deleted(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_host_gb=0.25, kv_tier_key=TIER_KEY) as llm:
        assert _run(llm, ids) == (expected, 0)
        _flush(llm)
        fmt = llm.engine.offload.format
        host = llm.engine.offload.tiers[0]
        signed = [struct.unpack_from("<H", blob, 6)[0] == KEYED for blob in host.get(list(host._entries))]
        assert len(signed) == 10 and all(signed)  # the host tier's entries are signed too
    client = redis_server.client()
    first = next(k for k in client.keys("kvbank:*") if unpack(fmt, client.get(k))[0].position == 0)
    blob = bytearray(client.get(first))
    header_len, payload_len = struct.unpack_from("<IQ", blob, 8)
    blob[PREFIX_BYTES + header_len :] = bytes(payload_len)
    client.set(first, _resign(blob))
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_tier_key=TIER_KEY) as llm:
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["redis"]["corrupt"] == 1
        _flush(llm)
        unpack(fmt, client.get(first))  # deleted, then written anew and signed


def test_disk_full_stops_writing_and_keeps_serving(cold, tmp_path):
    ids, expected = cold
    entry_bytes = 64 * 30 * 2 * 3 * 64 * 2  # one chunk: 64 tokens x 30 layers x K, V x 3 heads x 64 x 2 bytes
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_disk_gb=2.5 * entry_bytes / 2**30) as llm:
        assert _run(llm, ids) == (expected, 0)
        _flush(llm)
        disk = llm.tier_stats()["disk"]
        assert 0 < disk["bytes_used"] <= 2.5 * entry_bytes and disk["entries"] < 10
        _evict_pool(llm)
        assert _run(llm, ids)[0] == expected


def test_salted_entries_never_reach_another_salt(cold, tmp_path):
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids, salt="tenant-a") == (expected, 0)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids, salt="tenant-b") == (expected, 0)
        assert _run(llm, ids, salt=None)[1] == 0
        assert llm.tier_stats()["disk"]["hits"] == 0
        _evict_pool(llm)
        assert _run(llm, ids, salt="tenant-a") == (expected, 592)


def test_write_back_offloads_only_what_the_pool_evicts(cold):
    ids, expected = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_tier_write_policy="write_back") as llm:
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["offload"]["stores"] == 0
        _fill_pool(llm)  # real pool pressure
        assert llm.tier_stats()["offload"]["stores"] >= 9
        _flush(llm)
        assert _run(llm, ids) == (expected, 592)


def test_write_back_spill_sends_what_the_pool_never_evicted_and_another_engine_loads_it(cold, tmp_path):
    """What a draining write-back server does before it exits (kvbank serve on SIGTERM)."""
    ids, expected = cold
    with LLM(**SMALL, kv_disk_dir=str(tmp_path), kv_tier_write_policy="write_back") as llm:
        assert _run(llm, ids) == (expected, 0)
        offload, tried = llm.engine.offload, set()
        assert offload.counters.stores == 0
        assert offload.spill(4, tried) == 4  # at most the limit per call
        while offload.spill(4, tried) >= 0:
            pass
        assert offload.counters.stores == 10  # every chunk of the prompt, once
        assert offload.spill(4, set()) == -1  # nothing left that never reached the tiers
        _flush(llm)
    with LLM(**SMALL, kv_disk_dir=str(tmp_path)) as llm:
        assert _run(llm, ids) == (expected, 592)


def test_min_hits_delays_offload_until_a_prefix_is_reused(cold):
    ids, expected = cold
    with LLM(**SMALL, kv_host_gb=0.25, kv_offload_min_hits=1) as llm:
        _run(llm, ids)
        assert llm.tier_stats()["offload"]["stores"] == 0
        assert _run(llm, ids) == (expected, 592)  # a pool hit: now the chunks are worth keeping
        assert llm.tier_stats()["offload"]["stores"] == 10


@pytest.mark.parametrize("store", ["redis_server", "redis_cluster"])
def test_engines_share_a_prefix_through_redis(cold, store, request):
    ids, expected = cold
    url = request.getfixturevalue(store).url
    with LLM(**SMALL, kv_redis_url=url) as first:
        assert _run(first, ids) == (expected, 0)
        _flush(first)
    with LLM(**SMALL, kv_redis_url=url) as second:
        assert _run(second, ids) == (expected, 592)
        assert second.tier_stats()["redis"]["hits"] == 10


def test_redis_outage_costs_only_recompute_and_hits_resume(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_redis_timeout=0.5) as llm:
        redis_server.kill()
        assert _run(llm, ids) == (expected, 0)
        _flush(llm)
        _evict_pool(llm)
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["redis"]["errors"] >= 1
        redis_server.start()
        # Chunks offered while the tier backs off (at most 8 s) are dropped, and the backoff may end
        # halfway through a prompt's chunks: send new prompts until one is stored with none dropped.
        deadline = time.monotonic() + 60
        for shift in range(1, 100):
            other = ids[shift * 7 :] + ids[: shift * 7]
            before = llm.tier_stats()["redis"]
            _run(llm, other)
            _flush(llm)
            after = llm.tier_stats()["redis"]
            if after["store_bytes"] > before["store_bytes"] and after["stores_dropped"] == before["stores_dropped"]:
                break
            assert time.monotonic() < deadline, f"no prompt was stored whole after the restart: {after}"
        _evict_pool(llm)
        assert _run(llm, other)[1] == 592


def test_redis_killed_while_a_request_runs_costs_nothing_but_the_counted_error(cold, redis_server):
    # The tier answers when the request starts; it dies between two of the request's steps, before
    # the chunk its generated tokens complete (tokens 600..640) is written through.
    ids, _ = cold
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = LLM(**SMALL, enable_prefix_caching=False).generate({"prompt_token_ids": ids}, params)[0]
    with LLM(**SMALL, kv_redis_url=redis_server.url, kv_redis_timeout=0.5) as llm:
        killed_after = None
        for partial in llm.stream({"prompt_token_ids": ids}, params):
            if killed_after is None:
                killed_after = len(partial.outputs[0].token_ids)
                redis_server.kill()
        _flush(llm)
        stats = llm.tier_stats()["redis"]
    assert killed_after is not None and killed_after < 40
    assert partial.outputs[0].token_ids == expected.outputs[0].token_ids
    assert partial.outputs[0].finish_reason == "length"
    assert stats["errors"] >= 1


def test_bad_redis_entries_are_deleted_and_never_served(cold, redis_server):
    ids, expected = cold
    with LLM(**SMALL, kv_redis_url=redis_server.url) as llm:
        _run(llm, ids)
        _flush(llm)
        fmt = llm.engine.offload.format
    client = redis_server.client()
    keys = sorted(client.keys("kvbank:*"))
    by_position = {unpack(fmt, client.get(k))[0].position: k for k in keys}
    value = bytearray(client.get(by_position[0]))
    value[PREFIX_BYTES + 5000] ^= 1
    client.set(by_position[0], bytes(value))
    with LLM(**SMALL, kv_redis_url=redis_server.url) as llm:
        assert _run(llm, ids) == (expected, 0)
        assert llm.tier_stats()["redis"]["corrupt"] == 1
        _flush(llm)
        unpack(fmt, client.get(by_position[0]))  # deleted, then written anew by the recompute
        _evict_pool(llm)
        client.set(by_position[4], client.get(by_position[4])[:-10])
        assert _run(llm, ids) == (expected, 64)  # the truncated second chunk ends the run
        assert llm.tier_stats()["redis"]["corrupt"] == 2


class StoppedClock:
    """The offload code's `time`: its clock moves only when the test sets `now`, and counts its reads."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now

    def set_and_wait_for_a_poll(self, now: float) -> None:
        """Set the clock, and return once the engine has looked at it again twice (a whole poll since)."""
        self.now, seen = now, self.reads
        _wait_for(lambda: self.reads >= seen + 2, "the engine's next poll")


@pytest.mark.parametrize("load_timeout", [None, 3.0])
def test_overdue_load_is_abandoned_for_recompute(cold, redis_server, load_timeout, monkeypatch):
    ids, expected = cold
    options = dict(kv_redis_url=redis_server.url, kv_redis_timeout=30.0, kv_tier_load_timeout=load_timeout)
    clock = StoppedClock()
    with LLM(**SMALL, **options) as llm, ThreadPoolExecutor(1) as pool:
        _run(llm, ids)
        _flush(llm)
        _evict_pool(llm)
        offload_state = llm.engine.offload
        # the configured bound, or what computing the 592 tokens to load is expected to take
        bound = load_timeout or max(offload.MIN_LOAD_SECONDS, 592 * offload_state.seconds_per_token)
        monkeypatch.setattr(offload, "time", clock)
        os.kill(redis_server.process.pid, signal.SIGSTOP)  # a server that hangs rather than fails
        try:
            run = pool.submit(_run, llm, ids)
            _wait_for(lambda: offload_state.loading, "the load")
            clock.set_and_wait_for_a_poll(clock.now + 0.99 * bound)
            assert offload_state.loading and llm.tier_stats()["offload"]["load_timeouts"] == 0  # not given up early
            clock.now += 0.02 * bound
            assert run.result(timeout=120) == (expected, 0)
            # computed while the fetch still waits on the hung server: abandoned, not after the socket timeout
            assert llm.tier_stats()["redis"]["errors"] == 0
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        assert llm.tier_stats()["offload"]["load_timeouts"] == 1


def test_two_servers_share_a_long_prompt_through_redis(redis_server, kvbank_env, tmp_path):
    args = ["--kv-redis-url", redis_server.url, "--kv-tier-chunk-tokens", "64"]
    servers = [start_server(args, kvbank_env, tmp_path / f"server{i}.log") for i in range(2)]
    try:
        for i, (process, url) in enumerate(servers):
            wait_healthy(process, url, tmp_path / f"server{i}.log")
        prompt = DATA.read_text()[:4000]
        first = _complete(servers[0][1], prompt)
        # The write-through entries leave on the writer thread: wait until every chunk is in Redis.
        chunks = -(-first["usage"]["prompt_tokens"] // 64)
        _wait_for(lambda: len(redis_server.client().keys("kvbank:*")) >= chunks, "the first server's chunks")
        second = _complete(servers[1][1], prompt)
    finally:
        for process, _ in servers:
            stop_server(process)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= second["usage"]["prompt_tokens"] - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_restarted_server_serves_its_disk_tier_with_the_same_output(kvbank_env, tmp_path):
    # Two real processes, one after the other, on one --kv-disk-dir: the second starts with an
    # empty pool, so every cached token it reports came from the files the first one wrote.
    args = ["--kv-disk-dir", str(tmp_path / "kv"), "--kv-tier-chunk-tokens", "64"]
    prompt = DATA.read_text()[:3000]
    answers = []
    for run in range(2):
        log = tmp_path / f"run{run}.log"
        process, url = start_server(args, kvbank_env, log)
        try:
            wait_healthy(process, url, log)
            answers.append(_complete(url, prompt))
            if run == 0:
                chunks = -(-answers[0]["usage"]["prompt_tokens"] // 64)
                _wait_for(lambda n=chunks: len(list((tmp_path / "kv").glob("*/*.kv"))) >= n, "the chunk files")
        finally:
            stop_server(process)
    first, second = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"] - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def _wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not arrive in {timeout_s} s"
        time.sleep(0.1)


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
