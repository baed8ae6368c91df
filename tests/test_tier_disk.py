"""The disk tier on real files: round trips, LRU by last read within a budget, restarts, disk full, corruption."""

import errno
import hashlib
import json
import logging
import os
import stat
import struct
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from kvbank.cache.tiers import disk, entry
from kvbank.cache.tiers.disk import DiskTier
from kvbank.cache.tiers.entry import BadEntry, EntryFormat, EntryInfo, pack, unpack

REAL_WRITE_ALL = disk._write_all
FMT = EntryFormat("m", "bfloat16", "auto", 16, (("bfloat16", (16, 3, 64)),))


def make_entry(seed: int, num_blocks: int = 2) -> tuple[bytes, bytes]:
    """A real entry of random K/V: (key, blob)."""
    key = hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=16).digest()
    info = EntryInfo(key, bytes(16), 0, num_blocks, tuple(range(16 * num_blocks)))
    gen = torch.Generator().manual_seed(seed)

    def fill(views: list[torch.Tensor]) -> None:
        for view in views:
            view.copy_(torch.randn(view.shape, generator=gen))

    return key, bytes(pack(FMT, info, fill).numpy())


ENTRIES = [make_entry(seed) for seed in range(6)]
SIZE = len(ENTRIES[0][1])
assert all(len(blob) == SIZE for _, blob in ENTRIES)


def entry_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*.kv"))


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/.tmp-*"))


def keys(*indices: int) -> list[bytes]:
    return [ENTRIES[i][0] for i in indices]


def test_batch_round_trip_returns_the_stored_bytes(tmp_path):
    tier = DiskTier(tmp_path, 10 * SIZE)
    (ka, a), (kb, b), (kc, c) = ENTRIES[:3]
    stored = tier.put(
        [(ka, a), (kb, bytearray(b)), (kc, memoryview(torch.frombuffer(bytearray(c), dtype=torch.uint8).numpy()))]
    )
    assert stored == 3
    got = tier.get([ka, ENTRIES[5][0], kb, kc])
    assert got[1] is None
    assert [bytes(g) for g in (got[0], got[2], got[3])] == [a, b, c]
    assert all(isinstance(g, bytearray) for g in (got[0], got[2], got[3]))
    assert [p.relative_to(tmp_path).as_posix() for p in entry_files(tmp_path)] == sorted(
        f"{k[0]:02x}/{k.hex()}.kv" for k in (ka, kb, kc)
    )
    assert temp_files(tmp_path) == []
    s = tier.stats
    assert (s.hits, s.misses, s.entries, s.bytes_used) == (3, 1, 3, 3 * SIZE)
    assert (s.load_bytes, s.store_bytes, s.stores_dropped, s.errors) == (3 * SIZE, 3 * SIZE, 0, 0)
    assert s.load_seconds > 0 and s.store_seconds > 0
    assert tier.capacity_bytes == 10 * SIZE and tier.name == "disk"


def test_contains_and_delete(tmp_path):
    tier = DiskTier(tmp_path, 10 * SIZE)
    tier.put(ENTRIES[:2])
    assert tier.contains(keys(0, 1, 2)) == [True, True, False]
    tier.delete(keys(0, 2))
    assert tier.contains(keys(0, 1, 2)) == [False, True, False]
    assert tier.get(keys(0)) == [None]
    assert [p.stem for p in entry_files(tmp_path)] == [ENTRIES[1][0].hex()]
    assert (tier.stats.entries, tier.stats.bytes_used) == (1, SIZE)


def test_putting_a_key_again_replaces_its_entry(tmp_path):
    tier = DiskTier(tmp_path, 10 * SIZE)
    key, _ = ENTRIES[0]
    replacement = ENTRIES[1][1][: SIZE // 2]
    tier.put([ENTRIES[0]])
    assert tier.put([(key, replacement)]) == 1
    assert bytes(tier.get([key])[0]) == replacement
    assert (tier.stats.entries, tier.stats.bytes_used) == (1, len(replacement))


def test_restart_sees_the_entries_and_their_last_use(tmp_path):
    first = DiskTier(tmp_path, 3 * SIZE)
    first.put(ENTRIES[:3])
    first.get(keys(0))  # 0 is now the most recently used, 1 the least

    second = DiskTier(tmp_path, 3 * SIZE)
    assert (second.stats.entries, second.stats.bytes_used) == (3, 3 * SIZE)
    assert [bytes(g) for g in second.get(keys(2))] == [ENTRIES[2][1]]
    second.put([ENTRIES[3]])
    assert second.contains(keys(0, 1, 2, 3)) == [True, False, True, True]


def test_eviction_removes_the_least_recently_read_first(tmp_path):
    tier = DiskTier(tmp_path, 3 * SIZE)
    tier.put(ENTRIES[:3])
    tier.get(keys(0))
    tier.put([ENTRIES[3]])
    assert tier.contains(keys(0, 1, 2, 3)) == [True, False, True, True]
    tier.get(keys(2))
    tier.put([ENTRIES[4]])
    assert tier.contains(keys(0, 2, 3, 4)) == [False, True, True, True]
    assert len(entry_files(tmp_path)) == 3
    assert (tier.stats.entries, tier.stats.bytes_used) == (3, 3 * SIZE)


def test_entry_larger_than_the_budget_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, SIZE - 1)
    assert tier.put([ENTRIES[0]]) == 0
    assert tier.stats.stores_dropped == 1
    assert (tier.stats.entries, tier.stats.bytes_used) == (0, 0)
    assert entry_files(tmp_path) == [] and temp_files(tmp_path) == []


def test_constructor_removes_temp_files_of_dead_writers_only(tmp_path):
    DiskTier(tmp_path, 10 * SIZE).put([ENTRIES[0]])
    sub = entry_files(tmp_path)[0].parent
    (sub / ".tmp-999999999-0badc0de").write_bytes(b"half an entry")  # pid above any pid_max
    (sub / ".tmp-garbled").write_bytes(b"x")
    live = sub / f".tmp-{os.getpid()}-0123abcd"  # a writer of this very process, mid-write
    live.write_bytes(b"y")
    tier = DiskTier(tmp_path, 10 * SIZE)
    assert temp_files(tmp_path) == [live]
    assert (tier.stats.entries, tier.stats.bytes_used) == (1, SIZE)


def fail_with(code: int):
    calls = []

    def write_all(fd, data):
        calls.append(len(data))
        os.write(fd, data[: len(data) // 2])
        raise OSError(code, os.strerror(code))

    return write_all, calls


def test_disk_full_stops_writes_until_a_delete_keeps_reads(tmp_path, monkeypatch, caplog):
    tier = DiskTier(tmp_path, 10 * SIZE)
    tier.put(ENTRIES[:2])
    write_all, calls = fail_with(errno.ENOSPC)
    monkeypatch.setattr(disk, "_write_all", write_all)
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers"):
        assert tier.put(ENTRIES[2:5]) == 0
    assert len(calls) == 1  # the first failure stopped writing; the others did not touch the disk
    assert (tier.stats.errors, tier.stats.stores_dropped) == (1, 3)
    assert len([r for r in caplog.records if r.name == "kvbank.tiers"]) == 1
    assert temp_files(tmp_path) == []
    assert [bytes(g) for g in tier.get(keys(0, 1))] == [ENTRIES[0][1], ENTRIES[1][1]]

    monkeypatch.undo()
    assert tier.put([ENTRIES[2]]) == 0  # still paused
    tier.delete(keys(0))
    assert tier.put([ENTRIES[2]]) == 1
    assert tier.contains(keys(0, 1, 2)) == [False, True, True]
    assert (tier.stats.entries, tier.stats.bytes_used) == (2, 2 * SIZE)


def test_disk_full_pause_ends_by_itself_and_warns_once_per_outage(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk, "DISK_FULL_PAUSE_S", 0.0)
    tier = DiskTier(tmp_path, 10 * SIZE)
    write_all, calls = fail_with(errno.EDQUOT)
    monkeypatch.setattr(disk, "_write_all", write_all)
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers"):
        assert tier.put(ENTRIES[:2]) == 0
        assert len(calls) == 2  # no pause left: both tried, one warning for the outage
        assert len(caplog.records) == 1
        monkeypatch.setattr(disk, "_write_all", REAL_WRITE_ALL)
        assert tier.put(ENTRIES[:2]) == 2
        monkeypatch.setattr(disk, "_write_all", write_all)
        assert tier.put(ENTRIES[2:3]) == 0
        assert len(caplog.records) == 2  # a new outage after a write succeeded
    assert tier.stats.errors == 3


def test_other_write_errors_drop_the_entry_without_pausing(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 10 * SIZE)
    write_all, _ = fail_with(errno.EIO)
    monkeypatch.setattr(disk, "_write_all", write_all)
    assert tier.put([ENTRIES[0]]) == 0
    monkeypatch.undo()
    assert tier.put([ENTRIES[0]]) == 1
    assert (tier.stats.errors, tier.stats.stores_dropped, tier.stats.entries) == (1, 1, 1)


def mount_tmpfs(mnt: Path, options: str, purpose: str) -> None:
    """Mount a tmpfs with `options` on `mnt`. Skipped where mounting is not permitted (a developer's
    unprivileged shell), but a failure under CI=true: CI must run `purpose` for real."""
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
        refused = mounted.stderr.decode().strip() if mounted.returncode else None
    except FileNotFoundError:
        refused = "no mount command"
    if refused is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must be able to mount a tmpfs for {purpose}: {refused}")
        pytest.skip(f"cannot mount a tmpfs here: {refused}")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, where a real write fails with ENOSPC."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_tmpfs(mnt, "size=1m,mode=0700", "the real disk-full test")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_real_disk_full_on_a_tiny_tmpfs(tiny_tmpfs, caplog):
    big = [make_entry(100 + i, num_blocks=40) for i in range(8)]  # about 250 KB each, 2 MB in all
    tier = DiskTier(tiny_tmpfs, 100 << 20)
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers"):
        stored = tier.put(big)
    assert 0 < stored < len(big)
    assert tier.stats.errors == 1 and tier.stats.stores_dropped == len(big) - stored
    assert len(caplog.records) == 1 and "full" in caplog.records[0].getMessage()
    assert temp_files(tiny_tmpfs) == []
    assert [bytes(g) for g in tier.get([k for k, _ in big[:stored]])] == [b for _, b in big[:stored]]
    assert tier.stats.bytes_used == sum(p.stat().st_size for p in entry_files(tiny_tmpfs))


def test_flipped_byte_and_truncation_are_refused_by_the_entry(tmp_path):
    tier = DiskTier(tmp_path, 10 * SIZE)
    tier.put(ENTRIES[:2])
    info, views = unpack(FMT, tier.get(keys(0))[0])
    assert info.key == ENTRIES[0][0] and views[0].shape == (2, 16, 3, 64)

    flipped, truncated = entry_files(tmp_path)[0], entry_files(tmp_path)[1]
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x01
    flipped.write_bytes(data)
    truncated.write_bytes(truncated.read_bytes()[: SIZE // 2])

    by_name = {p.stem: p for p in (flipped, truncated)}
    for key, blob in zip(keys(0, 1), tier.get(keys(0, 1))):
        reason = "checksum" if by_name[key.hex()] == flipped else "truncated"
        with pytest.raises(BadEntry) as refused:
            unpack(FMT, blob)
        assert refused.value.reason == reason
    assert tier.stats.bytes_used == SIZE + SIZE // 2  # the size the truncated file really has


def test_file_evicted_by_another_process_reads_as_a_miss(tmp_path):
    ours, theirs = DiskTier(tmp_path, 10 * SIZE), DiskTier(tmp_path, 10 * SIZE)
    ours.put(ENTRIES[:2])
    theirs.put(ENTRIES[:2])
    theirs.delete(keys(0))
    assert ours.get(keys(0, 1))[0] is None
    assert (ours.stats.misses, ours.stats.hits, ours.stats.errors) == (1, 1, 1)
    assert ours.contains(keys(0)) == [False]
    assert (ours.stats.entries, ours.stats.bytes_used) == (1, SIZE)


def test_concurrent_loader_and_writer_keep_the_index_exact(tmp_path):
    tier = DiskTier(tmp_path, 3 * SIZE)
    errors = []

    def writer():
        for i in range(60):
            tier.put([ENTRIES[i % len(ENTRIES)]])

    def loader():
        for i in range(60):
            for key, blob in zip(keys(i % 6, (i + 3) % 6), tier.get(keys(i % 6, (i + 3) % 6))):
                if blob is not None and bytes(blob) != dict(ENTRIES)[key]:
                    errors.append(key)

    threads = [threading.Thread(target=writer), threading.Thread(target=loader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    on_disk = entry_files(tmp_path)
    assert tier.stats.entries == len(on_disk) <= 3
    assert tier.stats.bytes_used == sum(p.stat().st_size for p in on_disk) <= 3 * SIZE
    assert temp_files(tmp_path) == []


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="a-file"):
        DiskTier(blocker / "kv", SIZE)
    with pytest.raises(ValueError, match="positive"):
        DiskTier(tmp_path / "kv", 0)


@pytest.fixture
def read_only_dir(tmp_path):
    """A private directory this process cannot write to: mode 500 for a user; for root, who writes
    through any permission, a read-only tmpfs."""
    directory = tmp_path / "ro"
    if os.geteuid() != 0:
        directory.mkdir(mode=0o500)
        yield directory
        return
    directory.mkdir(mode=0o700)
    mount_tmpfs(directory, "ro,mode=0700", "the read-only directory test as root")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


def test_read_only_directory_is_a_clear_error(read_only_dir):
    with pytest.raises(ValueError, match=rf"'{read_only_dir}' is not a writable directory"):
        DiskTier(read_only_dir, SIZE)


# --- privacy and tamper evidence -------------------------------------------------------------


@pytest.fixture
def open_umask():
    """A umask that takes no bits off: modes must come from the code, not from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path, open_umask):
    root = tmp_path / "cache" / "kv"
    tier = DiskTier(root, 10 * SIZE)
    tier.put(ENTRIES[:2])
    (file, _) = entry_files(root)
    assert [oct(stat_mode(p)) for p in (tmp_path / "cache", root, file.parent, file)] == [
        "0o700",
        "0o700",
        "0o700",
        "0o600",
    ]


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_directory_others_may_read_is_made_private(tmp_path):
    shared = tmp_path / "kv"
    shared.mkdir()
    shared.chmod(0o755)
    DiskTier(shared, SIZE)
    assert stat_mode(shared) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_directory_group_or_others_may_write_is_refused(tmp_path, mode):
    shared = tmp_path / "kv"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(
        ValueError, match=rf"disk tier directory '{shared}' is writable by group or others \(mode {mode:o}\)"
    ):
        DiskTier(shared, SIZE)
    assert stat_mode(shared) == mode


def test_a_directory_of_another_user_is_refused_by_its_stat():
    other = os.geteuid() + 1
    st = os.stat_result((stat.S_IFDIR | 0o700, 0, 0, 1, other, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match=rf"'/srv/kv' is owned by uid {other}, not by this process's uid"):
        disk.check_private(Path("/srv/kv"), st, "disk tier directory")
    mine = os.stat_result((stat.S_IFDIR | 0o700, 0, 0, 1, os.geteuid(), 0, 0, 0, 0, 0))
    disk.check_private(Path("/srv/kv"), mine, "disk tier directory")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="only root can give a directory away")
def test_a_directory_owned_by_nobody_is_refused(tmp_path):
    foreign = tmp_path / "kv"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ValueError, match=f"'{foreign}' is owned by uid 65534"):
        DiskTier(foreign, SIZE)


def test_a_file_larger_than_the_tier_is_removed_before_it_is_allocated(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 10 * SIZE)
    tier.put(ENTRIES[:2])
    huge = tier._path(ENTRIES[0][0])
    os.truncate(huge, 1 << 40)  # sparse: a terabyte that takes no disk
    allocated = []
    monkeypatch.setattr(disk, "bytearray", lambda n: allocated.append(n) or bytearray(n), raising=False)
    assert tier.get(keys(0, 1))[0] is None
    assert allocated == [SIZE]  # the second entry only
    assert not huge.exists() and tier.contains(keys(0)) == [False]
    assert (tier.stats.corrupt, tier.stats.entries, tier.stats.bytes_used) == (1, 1, SIZE)


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_symlink_or_fifo_under_an_entry_name_is_never_read(tmp_path, plant):
    secret = tmp_path / "secret"
    secret.write_bytes(ENTRIES[1][1])  # a valid entry, elsewhere: following the link would serve it
    tier = DiskTier(tmp_path / "kv", 10 * SIZE)
    tier.put(ENTRIES[:1])
    path = tier._path(ENTRIES[0][0])
    path.unlink()
    if plant == "symlink":
        path.symlink_to(secret)
    else:
        os.mkfifo(path)
    assert tier.get(keys(0)) == [None]  # at once: a FIFO is not waited on
    assert not path.exists() and not path.is_symlink() and secret.exists()
    assert (tier.stats.corrupt, tier.stats.entries) == (1, 0)


def forge(header: dict | bytes, payload_len: int = 0, declared: tuple[int, int] | None = None) -> bytes:
    """An entry whose header says what the caller wants, with a valid unkeyed checksum over it."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-(entry.PREFIX_BYTES + len(text)) % 16)
    header_len, declared_payload = declared or (len(text), payload_len)
    fields = struct.pack("<4sHHIQ", entry.MAGIC, entry.VERSION, 0, header_len, declared_payload)
    body = text + bytes(payload_len)
    return fields + entry.digest(None, fields, body) + body


def valid_header(num_blocks: int = 2) -> dict:
    return {
        "model": FMT.model,
        "dtype": FMT.dtype,
        "kv_format": FMT.kv_format,
        "block_size": FMT.block_size,
        "layout": [[dtype, list(shape)] for dtype, shape in FMT.layout],
        "kind": "chunk",
        "key": ENTRIES[0][0].hex(),
        "parent": bytes(16).hex(),
        "position": 0,
        "num_blocks": num_blocks,
        "token_ids": list(range(16 * num_blocks)),
    }


def without(name: str) -> dict:
    header = valid_header()
    del header[name]
    return header


def with_field(**fields) -> dict:
    return {**valid_header(), **fields}


HOSTILE = {
    "missing model": without("model"),
    "missing token ids": without("token_ids"),
    "nested 10,000 deep": b"[" * 10_000 + b"]" * 10_000,
    "nested inside a field": with_field(kind=json.loads("[" * 50 + "]" * 50)),
    "not an object": b'"just a string"',
    "block size as text": with_field(block_size="16"),
    "block size as bool": with_field(block_size=True),
    "token ids as text": with_field(token_ids=[str(t) for t in range(32)]),
    "negative token id": with_field(token_ids=[-1] * 32),
    "token id past int32": with_field(token_ids=[2**31] * 32),
    "token ids as bools": with_field(token_ids=[True] * 32),
    "too few token ids": with_field(token_ids=[1] * 5),
    "layout of numbers": with_field(layout=[1, 2]),
    "key not hex": with_field(key="zz" * 16),
    "short key": with_field(key="ab"),
    "zero blocks": with_field(num_blocks=0, token_ids=[]),
    "not JSON": b"{not json",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_header_with_a_valid_checksum_is_a_bad_entry(name):
    blob = forge(HOSTILE[name], FMT.payload_bytes(2))
    with pytest.raises(BadEntry) as refused:
        unpack(FMT, blob)
    assert refused.value.reason == "header"


def test_the_forged_header_is_accepted_when_it_is_valid():
    """The hostile headers above fail for their flaw, not for how they are forged."""
    info, views = unpack(FMT, forge(valid_header(), FMT.payload_bytes(2)))
    assert info.num_blocks == 2 and views[0].shape == (2, 16, 3, 64)


def test_another_layout_is_another_format():
    header = valid_header()
    for layout in (header["layout"][:-1], [[dtype, [*shape[:-1], shape[-1] + 1]] for dtype, shape in header["layout"]]):
        with pytest.raises(BadEntry) as refused:
            unpack(FMT, forge(with_field(layout=layout), FMT.payload_bytes(2)))
        assert refused.value.reason == "format"


@pytest.mark.parametrize(
    "declared", [(2**32 - 16, 0), (16, 2**63), (2**20, FMT.payload_bytes(2))], ids=["header", "payload", "both"]
)
def test_huge_declared_sizes_are_refused_before_anything_is_read(declared):
    blob = forge(valid_header(), FMT.payload_bytes(2), declared=declared)
    with pytest.raises(BadEntry) as refused:
        unpack(FMT, blob)
    assert refused.value.reason == "truncated"


def test_a_header_longer_than_its_blocks_can_need_is_refused():
    padded = json.dumps(valid_header()).encode() + b" " * FMT.max_header_bytes(FMT.payload_bytes(2))
    with pytest.raises(BadEntry, match="header is more than"):
        unpack(FMT, forge(padded, FMT.payload_bytes(2)))


def test_an_entry_of_an_older_format_version_is_refused_cleanly():
    blob = bytearray(ENTRIES[0][1])
    struct.pack_into("<H", blob, 4, entry.VERSION - 1)
    with pytest.raises(BadEntry, match="format version 1, this kvbank reads version 2"):
        unpack(FMT, blob)
