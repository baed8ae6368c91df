"""The tables of docs/measurements.md whose raw results are committed, rebuilt from bench/results/*.json.

    python bench/tables.py           # print every table
    python bench/tables.py --check   # exit 1 when docs/measurements.md holds other numbers
    python bench/tables.py --write   # put the tables into docs/measurements.md

In docs/measurements.md each such table sits between `<!-- bench/tables.py NAME -->` and
`<!-- end bench/tables.py NAME -->`. Every other table there is followed by a line that names the
command that produced it and says "raw data not committed"; --check fails on one that is not.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MEASUREMENTS = ROOT / "docs" / "measurements.md"


def load(name: str) -> dict:
    """One raw result file of bench/results/ by its stem."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, the rule, the rows."""
    rule = "|" + "---|" * len(header)
    return "\n".join(["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)])


def ms(seconds: float, digits: int = 0) -> str:
    return f"{seconds * 1000:.{digits}f} ms"


def s(seconds: float, digits: int = 2) -> str:
    return f"{seconds:.{digits}f} s"


def pct(share: float) -> str:
    return f"{share * 100:.1f}%"


def step_target() -> str:
    """Long prompts among chats, 5 minutes, by --max-step-ms (mixed_compare.py)."""
    summary = load("mixed_compare_chat-5min")["summary"]
    rows = []
    for system, target in (("kvbank/step0", "0 (no target)"), ("kvbank", "200 (default)"), ("kvbank/step25", "25")):
        run = summary[system]
        rows.append(
            [
                target,
                f"{run['chat_output_tokens_per_s']:.0f}",
                ms(run["chat_itl_p50_s"], 1),
                ms(run["chat_itl_p99_s"]),
                s(run["chat_itl_max_s"]),
                s(run["long_ttft_p50_s"]),
            ]
        )
    header = ["`--max-step-ms`", "chat tok/s", "gap p50", "gap p99", "longest gap", "long-prompt TTFT p50"]
    return markdown(header, rows)


def step_target_minute() -> str:
    """The same workload in one-minute runs (mixed_load.py), one server per target."""
    rows = []
    for label, target in (
        ("chat-only", "– (no long prompts)"),
        ("no-target", "0 (no target)"),
        ("target200", "200 (default)"),
        ("target50", "50"),
        ("target25", "25"),
    ):
        run = load(f"mixed_load_{label}")
        long_ttft = "–" if run["long_ttft_p50_s"] is None else s(run["long_ttft_p50_s"])
        rows.append(
            [
                target,
                f"{run['chat_output_tokens_per_s']:.0f}",
                ms(run["chat_itl_p50_s"], 1),
                ms(run["chat_itl_p99_s"]),
                s(run["chat_itl_max_s"]),
                f"{run['long_prompts']}",
                long_ttft,
            ]
        )
    header = ["`--max-step-ms`", "chat tok/s", "gap p50", "gap p99", "longest gap", "long prompts", "their TTFT p50"]
    return markdown(header, rows)


def step_target_burst() -> str:
    """32 new chats at once (serve_load.py), by --max-step-ms."""
    rows = []
    for target in ("0", "25", "50", "200"):
        (level,) = load(f"serve_load_step{target}")["levels"]
        rows.append(
            [
                f"{target} (default)" if target == "200" else target,
                s(level["ttft_p50_s"], 1),
                s(level["ttft_p99_s"], 1),
                ms(level["itl_p50_s"]),
                f"{level['output_tokens_per_s']:.0f}",
                f"{level['ok']} / {level['requests']}",
            ]
        )
    header = ["`--max-step-ms`", "TTFT p50", "TTFT p99", "inter-token p50", "output tok/s", "answered"]
    return markdown(header, rows)


def priority_fairness() -> str:
    """Who is served first when prefill is the bottleneck (mixed_compare.py --scenario)."""
    rows = []
    for scenario, prober in (("priority", "priority -1"), ("fairness", "its own tenant")):
        run = load(f"mixed_compare_{scenario}")["summary"]["kvbank"]
        rows.append(
            [
                f"`{scenario}`: the prober at {prober}",
                f"{s(run['probe.ttft_p50_s'])} / {s(run['probe.ttft_p99_s'])}",
                f"{s(run['queue.ttft_p50_s'])} / {s(run['queue.ttft_p99_s'])}",
                f"{run['queue.requests']}",
            ]
        )
    return markdown(["scenario", "prober TTFT p50 / p99", "queue TTFT p50 / p99", "queue requests"], rows)


def batch_32() -> str:
    """32 sequences and a 512-token prefill against llama.cpp, natively and at avx2 (throughput.py)."""
    rows = []
    for name, level in (("native", "native"), ("avx2", "`avx2` (`KVBANK_ISA=avx2`, llama.cpp's AVX2 build)")):
        run = load(f"throughput_b32_{name}")
        kvbank, llama = run["results"]["bfloat16"]["kvbank"], run["results"]["bfloat16"]["llama.cpp"]
        generation = run["kvbank_generation_only"]["bfloat16"]["decode_b32"]
        rows.append(
            [
                level,
                f"{kvbank['decode_b32']:,.1f} tok/s ({generation:,.1f} generation only)",
                f"{llama['decode_b32']:,.1f} tok/s",
                f"{kvbank['decode_b32'] / llama['decode_b32']:.2f}x",
                f"{kvbank['prefill_512']:,.1f} tok/s",
                f"{llama['prefill_512']:,.1f} tok/s",
                f"{kvbank['prefill_512'] / llama['prefill_512']:.2f}x",
            ]
        )
    header = ["level", "kvbank, 32 sequences", "llama.cpp", "ratio", "kvbank, prefill 512", "llama.cpp", "ratio"]
    return markdown(header, rows)


def soak() -> str:
    """Four-minute soaks of 8 clients, without and with hostile requests (serve_load.py --soak)."""
    rows = []
    for label, name in (("kvbank-soak-baseline", "no hostile requests"), ("kvbank-hostile-soak", "10% hostile")):
        (level,) = load(f"serve_load_{label}")["levels"]
        hostile = level.get("hostile", {"sent": 0, "server_errors_or_drops": 0})
        rows.append(
            [
                name,
                f"{level['requests']}",
                f"{level['errors']}",
                f"{level['output_tokens_per_s']:.1f}",
                s(level["ttft_p50_s"]),
                s(level["ttft_p99_s"]),
                f"{hostile['sent']} ({hostile['server_errors_or_drops']} answered 5xx or dropped)",
            ]
        )
    header = ["soak", "requests", "errors", "output tok/s", "TTFT p50", "TTFT p99", "hostile requests"]
    return markdown(header, rows)


def fleet_kill() -> str:
    """A quick fleet run with one replica killed at half (fleet.py --quick --kill-at-half)."""
    summary = load("fleet_quick_kill")["summary"]
    rows = []
    for config, run in summary.items():
        rows.append(
            [
                f"`{config}`",
                pct(run["hit_rate"]),
                pct(run["tier_hit_share"]),
                s(run["ttft_p50_s"]),
                s(run["ttft_p99_s"]),
                s(run["ttft_p99_later_turns_s"]),
                f"{run['output_tokens_per_s']:.1f}",
                f"{run['failed']}",
            ]
        )
    header = [
        "configuration",
        "hit rate",
        "from Redis",
        "TTFT p50",
        "TTFT p99",
        "p99, later turns",
        "out tok/s",
        "failed",
    ]
    return markdown(header, rows)


def kernel_layer() -> str:
    """bench/throughput.py at the commit before the kernels were split and written once per width, and
    after, alternating (medians over the rounds)."""
    run = load("throughput_kernel_layer")["runs"]
    rows = []
    for level in ("native", "avx2"):
        old, new = run[level]["old"], run[level]["new"]
        for metric in ("decode_b1", "decode_b8", "decode_b32", "prefill_512"):
            before = statistics.median(r[metric] for r in old)
            after = statistics.median(r[metric] for r in new)
            low, high = min(r[metric] for r in new), max(r[metric] for r in new)
            rows.append(
                [level, metric, f"{before:,.1f}", f"{after:,.1f}", f"{after / before:.2f}", f"{low:,.0f}-{high:,.0f}"]
            )
    return markdown(["level", "metric", "before, tok/s", "after, tok/s", "after / before", "after's range"], rows)


def isa_parity() -> str:
    """Greedy tokens and logprob bits at every level against the commit before (isa_parity.py)."""
    rows = []
    for level, row in load("isa_parity")["levels"].items():
        against = row["against"]
        rows.append(
            [
                f"`{level}`",
                str(row["tokens"]),
                "same" if against["same_tokens"] else "differ",
                "same" if against["same_logprob_bits"] else f"differ (up to {against['max_logprob_gap']:.3g})",
            ]
        )
    return markdown(["level", "tokens generated", "tokens", "logprob bits"], rows)


TABLES: dict[str, Callable[[], str]] = {
    "batch-32": batch_32,
    "soak": soak,
    "priority-fairness": priority_fairness,
    "step-target": step_target,
    "step-target-minute": step_target_minute,
    "step-target-burst": step_target_burst,
    "fleet-kill": fleet_kill,
    "kernel-layer": kernel_layer,
    "isa-parity": isa_parity,
}


def block(name: str) -> re.Pattern:
    """The marked place of one table in docs/measurements.md (the table is group 1)."""
    return re.compile(rf"<!-- bench/tables.py {re.escape(name)} -->\n(.*?)\n?<!-- end bench/tables.py {name} -->", re.S)


def differences(text: str) -> list[str]:
    """The marked tables docs/measurements.md lacks or holds otherwise, one line each."""
    found = []
    for name, render in TABLES.items():
        match = block(name).search(text)
        if match is None:
            found.append(f"{name}: no `<!-- bench/tables.py {name} -->` block in {MEASUREMENTS.name}")
        elif match[1].strip() != render():
            found.append(f"{name}: the table differs from bench/results (run python bench/tables.py --write)")
    return found


def unsourced(text: str) -> list[str]:
    """Header rows of the unmarked tables that are not followed by their command and "raw data not committed"."""
    lines = re.sub(r"<!-- bench/tables.py (\S+) -->\n.*?<!-- end bench/tables.py \1 -->", "", text, flags=re.S)
    lines = re.sub(r"^```.*?^```", "", lines, flags=re.S | re.M).split("\n")
    found = []
    for index, line in enumerate(lines):
        starts_table = line.startswith("|") and (index == 0 or not lines[index - 1].startswith("|"))
        if not starts_table:
            continue
        after = next((later for later in lines[index:] if not later.startswith("|") and later.strip()), "")
        if not (after.startswith("Command: `") and "raw data not committed" in after):
            found.append(line)
    return found


def problems(text: str) -> list[str]:
    """Everything --check reports on docs/measurements.md."""
    return differences(text) + [f"a table without its command and source: {row}" for row in unsourced(text)]


def written(text: str) -> str:
    """docs/measurements.md with every marked table rebuilt."""
    for name, render in TABLES.items():
        marked = f"<!-- bench/tables.py {name} -->\n{render()}\n<!-- end bench/tables.py {name} -->"
        text = block(name).sub(lambda _, marked=marked: marked, text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="exit 1 when docs/measurements.md differs")
    action.add_argument("--write", action="store_true", help="rebuild the tables in docs/measurements.md")
    args = parser.parse_args()
    text = MEASUREMENTS.read_text()
    if args.check:
        found = problems(text)
        print("\n".join(found) or f"{len(TABLES)} tables match bench/results")
        return 1 if found else 0
    if args.write:
        MEASUREMENTS.write_text(written(text))
        found = problems(MEASUREMENTS.read_text())
        print("\n".join(found) or f"{len(TABLES)} tables written")
        return 1 if found else 0
    for name, render in TABLES.items():
        print(f"{name}: {render.__doc__}\n\n{render()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
