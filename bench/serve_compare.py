"""kvbank against llama-server on the chat workload of bench/serve_load.py, each server cold per run.

For every workload, client count and run, each system gets a freshly started server (nothing
cached, nothing warm but serve_load's one warm-up request), then bench/serve_load.py runs that one
client level against it; the systems alternate, their order flipping every run, and the table
reports each system's median output tok/s and the ratio. Workloads:

- `chat` (the default, what a user sees): multi-turn conversations with a shared system prompt and
  varied questions, replies ending at EOS or at --max-tokens;
- `ignore-eos`: the same, every reply forced to --max-tokens tokens (the old headline number).

llama-server runs in each configuration of --peer-configs (slots = clients, a per-slot context
that holds the longest conversation, continuous batching, the same threads as kvbank), and the
table compares kvbank with the best of them.

    python bench/serve_compare.py --llama-server ~/llama.cpp/build/bin/llama-server --clients 1 8 --runs 3

Results go to bench/results/serve_compare.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

print = functools.partial(print, flush=True)  # noqa: A001 -- progress lines appear as runs finish
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbank.models.loader import bundled_model_path  # noqa: E402

WORKLOADS = {"chat": [], "ignore-eos": ["--ignore-eos"]}
#: llama-server options tried (beside slots = clients, context, threads). Weight repacking, its
#: default, puts the weights in the AMX buffer type on an AMX CPU; where the machine does not
#: enable AMX tiles the server dies on its first prompt (SIGILL), so both configurations turn it off.
PEER_CONFIGS = {
    "no-repack": ["--no-repack"],
    "no-repack+fa": ["--no-repack", "-fa", "on"],
    "repack": [],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"serve_compare: the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"serve_compare: {url} was not ready after {timeout:.0f} s")


def start(system: str, args, clients: int, peer_config: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if system == "kvbank":
        command = [sys.executable, "-m", "kvbank", "serve", "--host", "127.0.0.1", "--port", str(port)]
    else:
        per_slot = args.slot_context
        command = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(clients)]
        command += ["-c", str(per_slot * clients), "--no-webui", *peer_config]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    handle = log.open("w")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    return process, url


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def load(url: str, clients: int, workload: list[str], args, label: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    command = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--base-url", f"{url}/v1"]
    command += ["--clients", str(clients), "--turns", str(args.turns), "--conversations", str(args.conversations)]
    command += ["--max-tokens", str(args.max_tokens), "--label", label, "--json", str(path), *workload]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    level = json.loads(path.read_text())["levels"][0]
    path.unlink()
    if level.get("errors"):
        print(f"    {label}: errors {level['errors']}", flush=True)
    return float(level["output_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--model", default=None, help="GGUF for llama-server (default: the bundled model)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--peer-configs", nargs="+", default=["no-repack", "no-repack+fa"], choices=list(PEER_CONFIGS))
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slot-context", type=int, default=4096, help="llama-server context per slot")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "serve_compare.json"))
    args = parser.parse_args()
    args.model = args.model or bundled_model_path()
    logs = Path(tempfile.mkdtemp(prefix="serve_compare_"))
    systems = ["kvbank"] + [f"llama.cpp/{name}" for name in args.peer_configs]
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    for workload in args.workloads:
        for clients in args.clients:
            cell = samples.setdefault(workload, {}).setdefault(str(clients), {s: [] for s in systems})
            for run in range(args.runs):
                order = systems if run % 2 == 0 else systems[::-1]
                for system in order:
                    peer = PEER_CONFIGS[system.split("/", 1)[1]] if "/" in system else []
                    kind = "kvbank" if system == "kvbank" else "llama.cpp"
                    log = logs / f"{workload}_{clients}_{run}_{system.replace('/', '_')}.log"
                    process, url = start(kind, args, clients, peer, log)
                    try:
                        tok_s = load(url, clients, WORKLOADS[workload], args, system)
                    finally:
                        stop(process)
                    cell[system].append(tok_s)
                    print(f"  {workload:10s} {clients:3d} clients run {run}: {system:22s} {tok_s:7.1f} out tok/s")
    report = {"config": dict(vars(args)), "samples": samples, "summary": {}}
    print(f"\n{'workload':10s} {'clients':>7s} {'kvbank':>9s} {'best llama-server':>18s} {'config':>11s} {'ratio':>7s}")
    for workload, by_clients in samples.items():
        for clients, cell in by_clients.items():
            medians = {system: statistics.median(values) for system, values in cell.items()}
            best = max((s for s in medians if s != "kvbank"), key=medians.get)
            ratio = medians["kvbank"] / medians[best]
            summary = {"medians": medians, "best_peer": best, "ratio": ratio}
            report["summary"].setdefault(workload, {})[clients] = summary
            print(
                f"{workload:10s} {clients:>7s} {medians['kvbank']:9.1f} {medians[best]:18.1f} "
                f"{best.split('/', 1)[1]:>11s} {ratio:6.2f}x"
            )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json} (server logs in {logs})")


if __name__ == "__main__":
    main()
