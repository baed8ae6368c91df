"""A steady-state model of a large fleet: --replicas kvbank replicas, --users chatting users, one
Redis tier: where one Redis instance saturates, and how many Redis Cluster shards the fleet needs.

Measured inputs: one replica's prefill and decode tok/s (the `calibration` of
bench/results/fleet.json, written by bench/fleet.py, or --prefill-tok-s / --decode-tok-s), one
Redis instance's bandwidth (--redis-gbps; default the Redis get GB/s of bench/results/tiers.json,
else 1 GB/s), and the K/V bytes per token of the model, from its config: layers x KV heads x head
dim x 2 (K and V) x bytes per element (--kv-bytes, 2 for the bfloat16 pool).

The workload and the cache (every assumption is an option, and all are printed):

- every user runs conversations of --turns turns over one of --docs shared documents of
  --doc-tokens tokens, --question-tokens tokens a question, --reply-tokens a reply, and thinks
  --think-s seconds between turns, so the fleet gets users / think_s turns per second (the time a
  turn takes is small beside the think time and is left out);
- turn t's prompt is the document, t questions and replies and the new question; what it reuses
  is the previous turn's prompt (turn 0: the document); the reply and the new question are
  computed (the reply is re-read as prompt text);
- the router is cache-aware: a document and a conversation stay on one replica, so documents
  spread evenly (docs / replicas per replica) and each replica holds users / replicas
  conversations;
- the replica's pool (--pool-gb) keeps its documents first (hot: many users touch them), and of
  the conversations only the share that fits: a reused token is found in the pool with
  probability min(1, room / working set), documents and conversations apart (a random-reuse LRU);
  everything else that is reused comes from Redis, which holds every chunk ever computed
  (write-through; its memory is not the limit here);
- Redis moves each computed token once (the write: write-through stores every chunk, so with a
  pool that holds the working set Redis traffic is mostly writes) and each token reused from it
  once (the read); a shard is full at --redis-utilization of its bandwidth, and a cluster spreads
  keys evenly over its shards; losing a replica adds a burst of reads (its users' contexts);
- a replica is busy prefill_tokens / prefill_tok_s + decode_tokens / decode_tok_s seconds per
  second (loads from Redis overlap compute); it saturates at 1.

    python bench/fleet_sim.py                             # 64 replicas, 10,000 users
    python bench/fleet_sim.py --replicas 64 --users 10000 --redis-gbps 1.0 --pool-gb 8
    python bench/fleet_sim.py --prefill-tok-s 300 --decode-tok-s 120 --json /tmp/sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FLEET_JSON = ROOT / "bench" / "results" / "fleet.json"
TIERS_JSON = ROOT / "bench" / "results" / "tiers.json"
DEFAULT_REDIS_GBPS = 1.0  # bench/tiers.py's target for one instance's gets on loopback
SWEEP = (1_000, 2_500, 5_000, 10_000, 20_000, 50_000)


@dataclass
class Point:
    """The fleet at one user count."""

    users: int
    turns_per_s: float
    pool_hit: float  # share of prompt tokens found in the replica's own pool
    redis_hit: float  # share loaded from Redis
    computed: float  # share computed
    redis_read_GBps: float
    redis_write_GBps: float
    redis_GBps: float
    shards: int
    replica_busy: float  # fraction of each replica's time spent computing


def kv_bytes_per_token(model: str | None, element_bytes: float) -> tuple[float, dict]:
    from kvbank.models.loader import describe_model

    config = describe_model(model).config
    shape = {"layers": config.num_layers, "kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    return config.num_layers * config.num_kv_heads * config.head_dim * 2 * element_bytes, shape


def per_turn(args) -> dict:
    """Mean tokens of one turn, averaged over a conversation's turns."""
    s, q, a, n = args.doc_tokens, args.question_tokens, args.reply_tokens, args.turns
    prompt = reused_doc = reused_private = computed = 0.0
    for t in range(n):
        prompt += s + q + t * (q + a)
        reused_doc += s  # turn 0 reuses the shared document; later turns the whole previous prompt
        reused_private += 0 if t == 0 else q + (t - 1) * (q + a)
        computed += q if t == 0 else q + a
    return {
        "prompt": prompt / n,
        "reused_doc": reused_doc / n,
        "reused_private": reused_private / n,
        "computed": computed / n,
        "decoded": float(a),
        "private_context": (q + (n - 1) * (q + a) / 2) + a,  # a conversation's own tokens, held on average
    }


def simulate(args, users: int, bpt: float, turn: dict) -> Point:
    rate = users / args.think_s
    per_replica = rate / args.replicas
    pool_tokens = args.pool_gb * 2**30 / bpt
    docs_per_replica = args.docs / args.replicas
    doc_set = docs_per_replica * args.doc_tokens
    doc_hit = min(1.0, pool_tokens / doc_set) if doc_set else 1.0
    room = max(0.0, pool_tokens - doc_set)
    private_set = users / args.replicas * turn["private_context"]
    private_hit = min(1.0, room / private_set) if private_set else 1.0
    from_pool = turn["reused_doc"] * doc_hit + turn["reused_private"] * private_hit
    from_redis = turn["reused_doc"] * (1 - doc_hit) + turn["reused_private"] * (1 - private_hit)
    read = rate * from_redis * bpt / 1e9
    write = rate * turn["computed"] * bpt / 1e9
    total = read + write
    shards = max(1, math.ceil(total / (args.redis_gbps * args.redis_utilization)))
    busy = per_replica * (turn["computed"] / args.prefill_tok_s + turn["decoded"] / args.decode_tok_s)
    return Point(
        users=users,
        turns_per_s=rate,
        pool_hit=from_pool / turn["prompt"],
        redis_hit=from_redis / turn["prompt"],
        computed=turn["computed"] / turn["prompt"],
        redis_read_GBps=read,
        redis_write_GBps=write,
        redis_GBps=total,
        shards=shards,
        replica_busy=busy,
    )


def saturation(args, bpt: float, turn: dict, key) -> int:
    """The smallest user count (to 1 user) where `key(point)` first holds, by bisection."""
    low, high = 1, 1
    while not key(simulate(args, high, bpt, turn)):
        low, high = high, high * 2
        if high > 10**9:
            return -1
    while high - low > 1:
        middle = (low + high) // 2
        if key(simulate(args, middle, bpt, turn)):
            high = middle
        else:
            low = middle
    return high


def measured_rates(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()).get("calibration")
    except (OSError, ValueError):
        return None


def measured_redis(path: Path) -> float | None:
    try:
        return float(json.loads(path.read_text())["bandwidth"]["redis"]["get_GBps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--prefill-tok-s", type=float, default=None, help="one replica (default: fleet.json)")
    parser.add_argument("--decode-tok-s", type=float, default=None, help="one replica (default: fleet.json)")
    parser.add_argument("--fleet-json", type=Path, default=FLEET_JSON)
    parser.add_argument("--redis-gbps", type=float, default=None, help="one Redis instance (default: tiers.json, 1)")
    parser.add_argument("--tiers-json", type=Path, default=TIERS_JSON)
    parser.add_argument("--redis-utilization", type=float, default=0.7, help="share of a shard's bandwidth to use")
    parser.add_argument("--model", default=None, help="model for the K/V size (default: the bundled model)")
    parser.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per K/V element (2: bfloat16 pool)")
    parser.add_argument("--pool-gb", type=float, default=1.0, help="each replica's KV pool in GiB")
    parser.add_argument("--docs", type=int, default=256, help="shared documents in the fleet")
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=30)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-s", type=float, default=20.0, help="seconds a user waits between turns")
    parser.add_argument("--json", type=Path, default=None, help="also write the table and assumptions here")
    args = parser.parse_args(argv)
    positive = ("replicas", "users", "redis_utilization", "kv_bytes", "pool_gb", "doc_tokens", "turns", "think_s")
    for name in positive:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    for name in ("docs", "question_tokens", "reply_tokens"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is negative")
    if args.redis_utilization > 1:
        parser.error(f"--redis-utilization {args.redis_utilization} is over 1")
    sources = {}
    rates = measured_rates(args.fleet_json)
    for name in ("prefill_tok_s", "decode_tok_s"):
        if getattr(args, name) is not None:
            sources[name] = "argument"
        elif rates and rates.get(name):
            setattr(args, name, float(rates[name]))
            sources[name] = f"measured, {rates.get('threads')} thread(s): {args.fleet_json}"
        else:
            parser.error(f"--{name.replace('_', '-')} is needed: {args.fleet_json} has no calibration")
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.redis_gbps is not None:
        sources["redis_gbps"] = "argument"
    elif (measured := measured_redis(args.tiers_json)) is not None:
        args.redis_gbps, sources["redis_gbps"] = measured, f"Redis get GB/s measured: {args.tiers_json}"
    else:
        args.redis_gbps, sources["redis_gbps"] = DEFAULT_REDIS_GBPS, f"assumed: no {args.tiers_json}"
    if args.redis_gbps <= 0:
        parser.error(f"--redis-gbps {args.redis_gbps} must be positive")
    args.sources = sources
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bpt, shape = kv_bytes_per_token(args.model, args.kv_bytes)
    turn = per_turn(args)
    pool_tokens = args.pool_gb * 2**30 / bpt
    print("assumptions:")
    print(
        f"  K/V: {shape['layers']} layers x {shape['kv_heads']} KV heads x {shape['head_dim']} head dim x 2 x "
        f"{args.kv_bytes:g} bytes = {bpt:,.0f} bytes/token; pool {args.pool_gb:g} GiB = {pool_tokens:,.0f} tokens"
    )
    print(
        f"  replica: prefill {args.prefill_tok_s:,.0f} tok/s ({args.sources['prefill_tok_s']}), decode "
        f"{args.decode_tok_s:,.1f} tok/s ({args.sources['decode_tok_s']})"
    )
    print(
        f"  Redis: {args.redis_gbps:g} GB/s per instance ({args.sources['redis_gbps']}), a shard full at "
        f"{args.redis_utilization:.0%}"
    )
    print(
        f"  users: {args.turns} turns over one of {args.docs} documents of {args.doc_tokens} tokens, "
        f"{args.question_tokens}-token questions, {args.reply_tokens}-token replies, {args.think_s:g} s between turns"
    )
    print(
        f"  a mean turn: {turn['prompt']:.0f} prompt tokens, reusing {turn['reused_doc']:.0f} of the document and "
        f"{turn['reused_private']:.0f} of its conversation, computing {turn['computed']:.0f}, decoding "
        f"{turn['decoded']:.0f}"
    )
    print(
        "  cache-aware routing (a document and a conversation stay on one replica); the pool keeps documents "
        "first, conversations as they fit (random-reuse LRU); Redis holds every computed chunk"
    )
    users = sorted({*SWEEP, args.users})
    points = [simulate(args, u, bpt, turn) for u in users]
    print(
        f"\n{args.replicas} replicas: {'users':>7s} {'turns/s':>8s} {'pool hit':>8s} {'Redis hit':>9s} "
        f"{'computed':>8s} {'Redis rd GB/s':>13s} {'wr GB/s':>8s} {'shards':>6s} {'replica busy':>12s}"
    )
    for p in points:
        mark = " <-" if p.users == args.users else ""
        busy = f"{p.replica_busy:.0%}" + (" (over)" if p.replica_busy > 1 else "")
        print(
            f"{'':12s} {p.users:7,d} {p.turns_per_s:8.1f} {p.pool_hit:8.1%} {p.redis_hit:9.1%} {p.computed:8.1%} "
            f"{p.redis_read_GBps:13.2f} {p.redis_write_GBps:8.2f} {p.shards:6d} {busy:>12s}{mark}"
        )
    one = args.redis_gbps * args.redis_utilization
    redis_full = saturation(args, bpt, turn, lambda p: p.redis_GBps > one)
    replicas_full = saturation(args, bpt, turn, lambda p: p.replica_busy > 1)
    target = simulate(args, args.users, bpt, turn)
    print(
        f"\none Redis instance ({args.redis_gbps:g} GB/s, {args.redis_utilization:.0%} used) saturates at "
        f"{redis_full:,} users on {args.replicas} replicas"
    )
    print(
        f"{args.replicas} replicas with {args.users:,} users move {target.redis_GBps:.2f} GB/s through Redis: "
        f"{target.shards} Redis Cluster shard(s); the replicas are {target.replica_busy:.0%} busy "
        f"(saturated from {replicas_full:,} users)"
    )
    # A replica lost: its users' next turns (within one think time) read their whole context from Redis.
    lost_users = args.users / args.replicas
    burst = lost_users * (turn["reused_doc"] + turn["reused_private"]) * bpt / 1e9 / args.think_s
    print(
        f"losing one replica moves its {lost_users:,.0f} users elsewhere: their next turns read "
        f"{burst * args.think_s:.1f} GB from Redis within ~{args.think_s:g} s, {burst:.2f} GB/s on top"
    )
    needed = math.ceil(args.replicas * target.replica_busy)
    if needed > args.replicas:
        print(f"  at these rates {args.users:,} users need {needed:,} replicas; the Redis figures above hold for them")
    report = {
        "assumptions": {k: v for k, v in vars(args).items() if k not in ("fleet_json", "tiers_json", "json")},
        "kv_bytes_per_token": bpt,
        "model_shape": shape,
        "turn": turn,
        "points": [asdict(p) for p in points],
        "redis_instance_saturates_at_users": redis_full,
        "replicas_saturate_at_users": replicas_full,
        "target": asdict(target),
        "replicas_needed": needed,
        "replica_loss_burst_GBps": burst,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
