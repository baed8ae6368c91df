"""What the tiers below the pool buy: TTFT from each tier, tier bandwidth, swap, and sharing.

1. TTFT of a 4,096-token prompt (real text) computed from scratch, and served from the pool,
   from host RAM, from disk and from Redis: each tier alone, the pool emptied before every warm
   run (`reset_prefix_cache`), so the prompt's K/V come back from that tier. Target: every tier at
   least 5x faster than recompute. Disk is measured twice: file pages still cached by the kernel
   (the usual case right after a restart) and, where this process may, after dropping the page
   cache (a cold disk).
2. GB/s of each tier, put and get, on the real entries of that prompt (16 chunks of 256 tokens
   in the default bfloat16 pool), batch by batch as the engine moves them. Target: Redis gets at
   >= 1 GB/s on loopback.
3. Preemption cost, swap against recompute, at 512 / 2k / 8k tokens (bench/preemption.py).
4. Two servers, 16 users: every user sends one shared 2k-token document plus an own question,
   half to each server; the document was computed once on the first server just before. The
   second server is cold: with a shared Redis it loads the document, without it recomputes it.
   TTFT p50 / p99 of the second server's users and of all 16, both configurations, servers
   started cold for every run, configurations alternated, medians of --repeats runs.

Starts its own redis-server on a free loopback port (needs `redis-server` on PATH).

    python bench/tiers.py [--repeats 3] [--skip-servers] [--out bench/results/tiers.json]

`--redis-load` measures only the Redis tier's store and load GB/s, per entry size and read path, and
prints a table: real entries of the engine's pool format (`pack`, bfloat16 KV of the bundled model), one
block and chunks of 64 / 256 (the default `--kv-tier-chunk-tokens`) / 1024 tokens, a batch of about
`--batch-mb` MB each, over TCP loopback and a unix socket, read the redis-py way (hiredis parser) and by
the direct path (recv_into buffers of each value's length). "load+verify" also unpacks every entry
(digest and header checks), which is what the engine pays before a chunk is used. Medians of --repeats.

    python bench/tiers.py --redis-load [--repeats 7] [--batch-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kvbank import LLM, SamplingParams  # noqa: E402
from kvbank.cache.tiers import build_tiers  # noqa: E402
from kvbank.config import EngineConfig  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "austen_all.txt"
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
GIB = 2**30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Redis:
    """A throwaway redis-server on loopback and a unix socket (no persistence)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.socket = workdir / "redis.sock"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(workdir), "--unixsocket", str(self.socket), "--unixsocketperm", "700"],
            stdout=subprocess.DEVNULL,
        )
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout.strip():
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def flush(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "flushall"], capture_output=True, check=True)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def prompt_tokens(llm: LLM, count: int, offset: int = 0) -> list[int]:
    text = CORPUS.read_text()[offset : offset + count * 8]
    ids = llm.get_tokenizer().encode(text)[:count]
    assert len(ids) == count
    return ids


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, ONE_TOKEN)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def tier_ttft(tokens: int, repeats: int, redis: Redis, workdir: Path) -> dict:
    """Median TTFT per source; each tier runs alone so a warm run can only be served by it.

    Every repeat uses another window of the corpus, so its cold run misses the pool and the tier.
    """
    setups = {
        "host": dict(kv_host_gb=2.0),
        "disk": dict(kv_disk_dir=str(workdir / "disk")),
        "redis": dict(kv_redis_url=redis.url),
    }
    results: dict[str, list[float]] = {k: [] for k in ("recompute", "pool", "host", "disk", "disk_cold", "redis")}
    cached: dict[str, int] = {}
    for name, options in setups.items():
        with LLM(**options) as llm:
            ttft(llm, prompt_tokens(llm, 64, offset=10**6))  # warm up kernels
            for r in range(repeats):
                ids = prompt_tokens(llm, tokens, offset=(r + 1) * 200_000 + 7_000 * list(setups).index(name))
                seconds, hit = ttft(llm, ids)
                assert hit == 0, f"{name}: the cold run hit {hit} tokens"
                results["recompute"].append(seconds)
                assert llm.engine.offload.flush()
                seconds, cached["pool"] = ttft(llm, ids)
                results["pool"].append(seconds)
                llm.reset_prefix_cache()
                seconds, cached[name] = ttft(llm, ids)
                results[name].append(seconds)
                if name == "disk" and drop_page_cache():
                    llm.reset_prefix_cache()
                    seconds, cached["disk_cold"] = ttft(llm, ids)
                    results["disk_cold"].append(seconds)
    medians = {k: statistics.median(v) for k, v in results.items() if v}
    recompute = medians["recompute"]
    return {
        "prompt_tokens": tokens,
        "ttft_s": medians,
        "speedup_vs_recompute": {k: recompute / v for k, v in medians.items() if k != "recompute"},
        "cached_tokens": cached,
    }


def chunk_sweep(tokens: int, repeats: int, redis: Redis, sizes: list[int]) -> dict:
    """Redis-served TTFT of a `tokens`-token prompt per entry size (tokens per chunk)."""
    out = {}
    for size in sizes:
        times = []
        with LLM(kv_redis_url=redis.url, kv_tier_chunk_tokens=size) as llm:
            ttft(llm, prompt_tokens(llm, 64, offset=10**6))
            for r in range(repeats):
                ids = prompt_tokens(llm, tokens, offset=(r + 1) * 150_000 + 11 * size)
                ttft(llm, ids)
                assert llm.engine.offload.flush()
                llm.reset_prefix_cache()
                seconds, cached = ttft(llm, ids)
                assert cached >= tokens - size - 16, (size, cached)
                times.append(seconds)
        out[size] = statistics.median(times)
        print(f"  chunk {size:5d} tokens: Redis-served TTFT {out[size] * 1e3:7.1f} ms")
    return out


def tier_bandwidth(tokens: int, repeats: int, redis: Redis, workdir: Path) -> dict:
    """put/get GB/s of each tier on the real entries of a `tokens`-token prompt, one batch each way."""
    with LLM(kv_host_gb=2.0) as llm:
        llm.generate({"prompt_token_ids": prompt_tokens(llm, tokens, offset=5_000)}, ONE_TOKEN)
        assert llm.engine.offload.flush()
        host = llm.engine.offload.tiers[0]
        entries = list(host._entries.items())
        namespace = llm.engine.cache_namespace
    total = sum(v.nbytes for _, v in entries)
    out: dict = {
        "entries": len(entries),
        "total_bytes": total,
        "largest_entry_bytes": max(v.nbytes for _, v in entries),
    }
    configs = {
        "host": EngineConfig(kv_host_gb=2.0),
        "disk": EngineConfig(kv_disk_dir=str(workdir / "bw-disk")),
        "redis": EngineConfig(kv_redis_url=redis.url),
    }
    keys = [k for k, _ in entries]
    for name, config in configs.items():
        (tier,) = build_tiers(config, namespace)
        puts, gets = [], []
        for _ in range(repeats):
            tier.delete(keys)
            start = time.perf_counter()
            stored = tier.put(entries)
            puts.append(time.perf_counter() - start)
            assert stored == len(entries), (name, stored)
            start = time.perf_counter()
            got = tier.get(keys)
            gets.append(time.perf_counter() - start)
            assert all(g is not None for g in got)
        tier.close()
        out[name] = {
            "put_GBps": total / statistics.median(puts) / 1e9,
            "get_GBps": total / statistics.median(gets) / 1e9,
        }
    return out


def redis_load(redis: Redis, repeats: int, batch_mb: float, chunk_tokens: list[int]) -> list[dict]:
    """Store and load GB/s of the Redis tier per entry size, transport and read path (medians)."""
    from kvbank.cache.tiers.entry import EntryInfo, pack, unpack  # noqa: PLC0415
    from kvbank.cache.tiers.redis import RedisTier  # noqa: PLC0415

    with LLM(kv_host_gb=0.1) as llm:  # the pool format the engine writes and accepts
        fmt = llm.engine.offload.format
    rows = []
    transports = {"tcp": redis.url, "unix": f"unix://{redis.socket}"}
    for tokens in chunk_tokens:
        blocks = tokens // fmt.block_size
        count = max(2, round(batch_mb * 1e6 / fmt.payload_bytes(blocks)))
        entries = []
        for i in range(count):
            key = (10**6 * tokens + i).to_bytes(16, "big")
            info = EntryInfo(key, bytes(16), 0, blocks, tuple(range(tokens)))
            entries.append((key, pack(fmt, info, lambda views: [v.normal_() for v in views]).numpy()))
        keys = [k for k, _ in entries]
        total = sum(e.nbytes for _, e in entries)
        for transport, url in transports.items():
            tiers = {
                path: RedisTier(url, "bench-load", direct_reads=path == "direct") for path in ("redis-py", "direct")
            }
            times: dict[str, dict[str, list[float]]] = {p: {"store": [], "load": [], "verify": []} for p in tiers}
            for _ in range(repeats):
                for path, tier in tiers.items():  # alternated, so both see the same machine load
                    tier.delete(keys)
                    start = time.perf_counter()
                    assert tier.put(entries) == count
                    times[path]["store"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    got = tier.get(keys)
                    times[path]["load"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    for blob in got:
                        assert blob is not None and unpack(fmt, blob)[0].num_blocks == blocks
                    times[path]["verify"].append(time.perf_counter() - start)
            for path, tier in tiers.items():
                tier.delete(keys)
                tier.close()
                median = {k: statistics.median(v) for k, v in times[path].items()}
                rows.append(
                    {
                        "entry_tokens": tokens,
                        "entry_bytes": total // count,
                        "entries": count,
                        "transport": transport,
                        "path": path,
                        "store_GBps": total / median["store"] / 1e9,
                        "load_GBps": total / median["load"] / 1e9,
                        "load_verify_GBps": total / (median["load"] + median["verify"]) / 1e9,
                    }
                )
                print_load_row(rows[-1])
    return rows


def print_load_row(r: dict) -> None:
    if not hasattr(print_load_row, "header"):
        print_load_row.header = True
        print(
            f"\n{'tokens':>6} {'entry MB':>9} {'entries':>7} {'via':>5} {'read path':>9} {'store GB/s':>10} "
            f"{'load GB/s':>9} {'load+verify':>11}"
        )
    print(
        f"{r['entry_tokens']:6d} {r['entry_bytes'] / 1e6:9.2f} {r['entries']:7d} {r['transport']:>5} {r['path']:>9} "
        f"{r['store_GBps']:10.2f} {r['load_GBps']:9.2f} {r['load_verify_GBps']:11.2f}"
    )


# --- two servers ------------------------------------------------------------------------------


def start_server(port: int, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvbank", "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def wait_healthy(urls: list[str], timeout: float = 180) -> None:
    import urllib.request  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not come up") from None
                time.sleep(0.5)


async def first_token_seconds(client, url: str, prompt: str) -> float:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None
    return first


async def sixteen_users(urls: list[str], document: str) -> list[float]:
    """TTFT of 16 users, 8 per server, each asking about the shared document."""
    try:
        import httpx  # noqa: PLC0415
    except ImportError:
        import httpx2 as httpx  # noqa: PLC0415
    async with httpx.AsyncClient() as client:
        await first_token_seconds(client, urls[0], document + "\n\nQuestion 0: who is speaking?\nAnswer:")
        await asyncio.sleep(1.0)  # write-through entries leave on the writer thread
        prompts = [document + f"\n\nQuestion {u + 1}: what happens next?\nAnswer:" for u in range(16)]
        return await asyncio.gather(*(first_token_seconds(client, urls[u // 8], p) for u, p in enumerate(prompts)))


def two_servers(repeats: int, redis: Redis, workdir: Path, document_tokens: int = 2048) -> dict:
    text = CORPUS.read_text()
    document = text[300_000 : 300_000 + document_tokens * 4]
    runs: dict[str, list[dict]] = {"with_redis": [], "without_redis": []}
    for r in range(repeats):
        for config in ("with_redis", "without_redis") if r % 2 == 0 else ("without_redis", "with_redis"):
            redis.flush()
            args = ["--kv-redis-url", redis.url] if config == "with_redis" else []
            ports = [free_port(), free_port()]
            servers = [start_server(p, args, workdir / f"server-{config}-{r}-{i}.log") for i, p in enumerate(ports)]
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            try:
                wait_healthy(urls)
                seconds = asyncio.run(sixteen_users(urls, document))
            finally:
                for server in servers:
                    server.terminate()
                    server.wait()
            second = sorted(seconds[8:])
            runs[config].append(
                {
                    "second_server_p50": statistics.median(second),
                    "second_server_p99": _p99(second),
                    "all_p50": statistics.median(seconds),
                    "all_p99": _p99(seconds),
                }
            )
    return {
        config: {key: statistics.median(run[key] for run in values) for key in values[0]}
        for config, values in runs.items()
    } | {"runs": runs}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--skip-servers", action="store_true")
    parser.add_argument("--skip-preemption", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tiers.json")
    parser.add_argument("--redis-load", action="store_true", help="only the Redis tier's store/load GB/s table")
    parser.add_argument("--batch-mb", type=float, default=64.0, help="--redis-load: MB of entries per batch")
    args = parser.parse_args()
    results: dict = {}
    if args.redis_load:
        with tempfile.TemporaryDirectory() as tmp:
            redis = Redis(Path(tmp))
            try:
                results["redis_load"] = redis_load(redis, args.repeats, args.batch_mb, [16, 64, 256, 1024])
            finally:
                redis.stop()
        out = args.out.with_name("redis_load.json") if args.out.name == "tiers.json" else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = Redis(workdir)
        try:
            results["ttft"] = tier_ttft(args.tokens, args.repeats, redis, workdir)
            print_ttft(results["ttft"])
            print("\nentry size (Redis, median):")
            results["chunk_sweep"] = chunk_sweep(args.tokens, args.repeats, redis, [64, 128, 256, 512, 1024])
            results["bandwidth"] = tier_bandwidth(args.tokens, args.repeats, redis, workdir)
            print_bandwidth(results["bandwidth"])
            if not args.skip_preemption:
                from preemption import preemption_costs  # noqa: PLC0415

                results["preemption"] = preemption_costs([512, 2048, 8192])
                print("\npreemption cost:", json.dumps(results["preemption"], indent=1))
            if not args.skip_servers:
                results["two_servers"] = two_servers(args.repeats, redis, workdir)
                print_servers(results["two_servers"])
        finally:
            redis.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


def print_ttft(r: dict) -> None:
    print(f"\nTTFT of a {r['prompt_tokens']}-token prompt (median):")
    print(f"  {'source':<10} {'TTFT ms':>9} {'x faster':>9} {'cached tokens':>14}")
    for source, seconds in r["ttft_s"].items():
        speedup = r["speedup_vs_recompute"].get(source)
        cached = r["cached_tokens"].get(source, 0)
        print(f"  {source:<10} {seconds * 1e3:9.1f} {speedup or 1.0:9.1f} {cached:14d}")


def print_bandwidth(r: dict) -> None:
    print(f"\ntier bandwidth ({r['entries']} entries, {r['total_bytes'] / 1e6:.1f} MB):")
    for name in ("host", "disk", "redis"):
        print(f"  {name:<6} put {r[name]['put_GBps']:6.2f} GB/s   get {r[name]['get_GBps']:6.2f} GB/s")


def print_servers(r: dict) -> None:
    print("\ntwo servers, 16 users on a shared 2k-token document (TTFT s, median of runs):")
    for config in ("with_redis", "without_redis"):
        v = r[config]
        print(
            f"  {config:<14} second server p50 {v['second_server_p50']:.2f} p99 {v['second_server_p99']:.2f}"
            f"   all p50 {v['all_p50']:.2f} p99 {v['all_p99']:.2f}"
        )


if __name__ == "__main__":
    main()
