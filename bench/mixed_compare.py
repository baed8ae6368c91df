"""bench/mixed_load.py against several cold servers in turn: kvbank with and without its step-time
target, and llama-server.

Each run starts every system afresh (nothing cached), runs one mixed_load scenario against it for
--seconds and stops it; systems alternate, their order flipping every run, and the summary gives
each system's medians over the runs. Systems:

- `kvbank` (the default configuration), `kvbank/step0` (`--max-step-ms 0`: no target, prompts take
  the whole token budget), `kvbank/stepN` (`--max-step-ms N`);
- `llama.cpp/<config>` (llama-server with one of the configurations in PEERS, a slot per
  chatting client and two more for the long prompts, continuous batching, the same threads).

    python bench/mixed_compare.py --systems kvbank kvbank/step0 llama.cpp/no-repack \\
        --llama-server ~/llama.cpp/build/bin/llama-server --seconds 300 --runs 1

Results go to bench/results/mixed_compare_<label>.json (the label defaults to the scenario).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from serve_compare import PEER_CONFIGS, ROOT, free_port, stop, wait_ready

from kvbank.models.loader import bundled_model_path

print = functools.partial(print, flush=True)  # noqa: A001 -- progress lines appear as runs finish

#: llama-server configurations: serve_compare.py's, and its nearest to chunked prefill: a smaller
#: logical and physical batch (-b/-ub) bounds the prompt tokens one step carries beside the decodes
PEERS = {
    **PEER_CONFIGS,
    "repack+b256": ["-b", "256", "-ub", "256"],
    "repack+b128": ["-b", "128", "-ub", "128"],
}
#: per scenario, the fields of mixed_load's report summarised across runs
FIELDS = {
    "chat": (
        "chat_output_tokens_per_s",
        "chat_itl_p50_s",
        "chat_itl_p99_s",
        "chat_itl_max_s",
        "long_prompts_sent",
        "long_prompts",
        "long_ttft_p50_s",
        "long_ttft_max_s",
    ),
    "priority": ("probe.ttft_p50_s", "probe.ttft_p99_s", "queue.ttft_p50_s", "queue.ttft_p99_s", "queue.requests"),
}
FIELDS["fairness"] = FIELDS["priority"]


def command_for(system: str, args, port: int) -> list[str]:
    if system == "kvbank" or system.startswith("kvbank/"):
        command = [sys.executable, "-m", "kvbank", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if system.startswith("kvbank/step"):
            command += ["--max-step-ms", system.removeprefix("kvbank/step")]
        return command
    config = system.removeprefix("llama.cpp/")
    if not system.startswith("llama.cpp/") or config not in PEERS:
        sys.exit(f"mixed_compare: unknown system {system!r}")
    if args.llama_server is None:
        sys.exit(f"mixed_compare: {system} needs --llama-server")
    slots = args.clients + 2
    command = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots)]
    # Long prompts arrive on a clock and may pile up: HTTP threads for every connection they open.
    command += ["--threads-http", str(4 * slots)]
    return command + ["-c", str(args.slot_context * slots), "--no-webui", *PEERS[config]]


def run_one(system: str, args, log: Path) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("w") as handle:
        process = subprocess.Popen(command_for(system, args, port), stdout=handle, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(f"http://127.0.0.1:{port}", process)
            with tempfile.TemporaryDirectory() as out:
                label = f"compare-{system.replace('/', '-')}"
                command = [sys.executable, str(ROOT / "bench" / "mixed_load.py"), "--base-url"]
                command += [f"http://127.0.0.1:{port}/v1", "--label", label, "--seconds", str(args.seconds)]
                command += ["--scenario", args.scenario, "--clients", str(args.clients), *args.load_args]
                command += ["--json", str(Path(out) / "report.json")]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
                return json.loads((Path(out) / "report.json").read_text())
        finally:
            stop(process)


def field(report: dict, name: str) -> float | None:
    for part in name.split("."):
        report = report.get(part) if isinstance(report, dict) else None
    return report


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=["kvbank", "kvbank/step0"])
    parser.add_argument("--scenario", choices=tuple(FIELDS), default="chat")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8, help="chatting clients (scenario chat)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--model", default=None, help="GGUF for llama-server (default: the bundled model)")
    parser.add_argument("--slot-context", type=int, default=4608, help="llama-server context per slot")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--label", default=None)
    parser.add_argument("load_args", nargs=argparse.REMAINDER, help="after --: more bench/mixed_load.py options")
    args = parser.parse_args()
    args.load_args = [a for a in args.load_args if a != "--"]
    args.model = args.model or bundled_model_path()
    logs = Path(tempfile.mkdtemp(prefix="mixed_compare_"))
    samples: dict[str, list[dict]] = {system: [] for system in args.systems}
    failures: list[str] = []
    path = ROOT / "bench" / "results" / f"mixed_compare_{args.label or args.scenario}.json"
    path.parent.mkdir(exist_ok=True)
    for run in range(args.runs):
        for system in args.systems if run % 2 == 0 else args.systems[::-1]:
            log = logs / f"{run}_{system.replace('/', '_')}.log"
            try:
                report = run_one(system, args, log)
            except subprocess.CalledProcessError as error:  # one system's failure does not lose the others
                failures.append(f"run {run} {system}: {error} (server log {log})")
                print(failures[-1])
                continue
            samples[system].append(report)
            shown = ", ".join(f"{name} {field(report, name)}" for name in FIELDS[args.scenario])
            print(f"run {run} {system}: {shown}")
            write(path, args, samples, failures)  # after every run: a later failure keeps what was measured
    print(json.dumps(write(path, args, samples, failures), indent=2))
    print(f"wrote {path} (server logs in {logs})")


def write(path: Path, args, samples: dict[str, list[dict]], failures: list[str]) -> dict:
    """Write the samples so far with their medians per system; return the medians."""
    summary = {
        system: {name: median([field(r, name) for r in reports]) for name in FIELDS[args.scenario]}
        for system, reports in samples.items()
    }
    config = {k: v for k, v in vars(args).items() if k != "model"}
    report = {"config": config, "summary": summary, "failures": failures, "samples": samples}
    path.write_text(json.dumps(report, indent=2))
    return summary


if __name__ == "__main__":
    main()
