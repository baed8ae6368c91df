"""Every code block of README.md and docs/*.md runs as written: Python blocks, and the commands of
their bash blocks. Each block runs once, where it stands; "the README" below means any of these files.

Each Python block runs in a fresh interpreter in an empty folder. A block marked
`<!-- readme-test: MARK -->` needs something beyond the package: `server` talks to a real
`kvbank serve` (the README's http://127.0.0.1:8000 becomes the test server's address), `redis` to a
real redis-server (the README's redis://cache:6379 becomes it, ~/.cache/kvbank a temporary folder),
`transformers` needs the `hf` extra (and runs in the test process, in a namespace of its own, where
transformers' slow reading of the GGUF header is already done).

A bash block is read as the shell would (continued lines, quotes spanning lines, `#` comments), and
each of its commands is
- `curl`: run with the real curl against a real server (the README's http://127.0.0.1:8000 and
  localhost:8000 become its address; a placeholder id like `stream-3f…` becomes the id that an
  earlier call of the same block answered); its status must be 2xx, and where the README shows
  the answer in a following `# {...}` comment, the real JSON answer must have the keys shown (`...`
  there: more keys may follow). The curls run against a server started with the `kvbank serve`
  line of their block if it has one, else against the server the Python blocks use (with the
  `--session-dir` the sessions examples need);
- `kvbank plan` / `kvbank generate` (which end on their own): run, and must exit 0;
- `kvbank serve` / `kvbank chat` (which run until stopped): their arguments must parse (the command
  with `--help` appended exits 0, so choices and types are checked), and every `--flag` must appear
  in that help exactly (argparse would also accept a prefix of a renamed option); the hosts and
  folders they name (redis://cache:6379, /var/cache/kvbank) are only parsed;
- `make TARGET`: the Makefile must have the target;
- `python -m sglang_router.launch_router` and `python bench/NAME.py` (which run until stopped, or
  for minutes): their arguments must parse and their flags exist, as for `kvbank serve`;
- `redis-server ARGS`: started with those arguments (on a free port) it must answer PING;
- `pip install -e '.[EXTRA]'`: pyproject.toml must define the extra.
A trailing `&` (run in the background) is dropped.
A command of any other kind fails the test, until this file learns how to check it.

Their relative links point at files that exist (and at headings that exist there), the tables of
docs/measurements.md match their raw results (bench/tables.py --check), and docs/layout.md names
every module of the package.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from serving import start_server, stop_server, wait_healthy

pytest_plugins = ["redis_servers"]

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[\w-]+) -->\n)?```python\n(?P<code>.*?)```", re.S)
MARKS = {None, "server", "redis", "transformers"}
BLOCK_TIMEOUT_S = 600


def _name(doc: Path) -> str:
    """A doc's path from the repository root: how test ids and messages name it."""
    return doc.relative_to(REPO_ROOT).as_posix()


def _blocks() -> list:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            mark, code = match.group("mark"), match.group("code")
            blocks.append(pytest.param(mark, code, _name(doc), id=f"{_name(doc)}:line{line}-{mark}"))
    return blocks


BLOCKS = _blocks()


def test_the_readme_has_its_python_blocks_and_knows_their_marks():
    assert len(BLOCKS) >= 9
    assert {block.values[0] for block in BLOCKS} <= MARKS


@pytest.fixture(scope="module")
def server(kvbank_env, tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme-server")
    log = folder / "server.log"
    process, url = start_server(["--session-dir", str(folder / "sessions")], kvbank_env, log)
    try:
        wait_healthy(process, url, log)
        yield url
    finally:
        stop_server(process)


@pytest.mark.parametrize("mark, code, doc", BLOCKS)
def test_readme_python_block_runs_as_written(mark, code, doc, kvbank_env, tmp_path, request):
    if mark == "server":
        pytest.importorskip("openai")
        url = request.getfixturevalue("server")
        assert "http://127.0.0.1:8000" in code
        code = code.replace("http://127.0.0.1:8000", url)
    elif mark == "redis":
        redis_url = request.getfixturevalue("redis_server").url
        assert "redis://cache:6379" in code
        code = code.replace("redis://cache:6379", redis_url).replace("~/.cache/kvbank", str(tmp_path / "kv"))
    elif mark == "transformers":
        pytest.importorskip("transformers")
        _run_in_this_process(code, doc, tmp_path, request)
        return
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_alone(kvbank_env),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"the {doc} block failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.stdout.strip() or "print(" not in code, "the block prints nothing"


def _alone(env: dict[str, str]) -> dict[str, str]:
    """The environment for a process this one waits on without doing anything else: every core for
    its torch threads (they contend with nothing here)."""
    return {**env, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}


def _run_in_this_process(code: str, doc: str, folder: Path, request) -> None:
    """Run a block in this process, in a namespace of its own, from an empty folder. For the
    transformers block: transformers reads a GGUF slowly (the header parsed twice, gguf's tensor-name
    map rebuilt per tensor: ~20 s a load in a fresh interpreter), and this process has the parsed
    header and the map already (conftest). The block's own imports and names are still all it has."""
    capture = request.getfixturevalue("capsys")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(code, f"{doc} block in {folder.name}", "exec"), namespace)
        finally:
            namespace.clear()
            gc.collect()
    printed = capture.readouterr().out
    assert printed.strip() or "print(" not in code, "the block prints nothing"


# --- bash blocks ---------------------------------------------------------------------------------

_BASH = re.compile(r"```bash\n(?P<code>.*?)```", re.S)
README_HOST = re.compile(r"(?:http://)?(?:127\.0\.0\.1|localhost):8000")
PLACEHOLDER_ID = re.compile(r"(?P<kind>[a-z]+)-[0-9a-f]*…")  # `stream-3f…`: an id an earlier call answered
RUN_TO_END = {"plan", "generate"}  # kvbank commands that finish on their own
RUN_UNTIL_STOPPED = {"serve", "chat"}
ROUTER_MODULE = "sglang_router.launch_router"
MAX_GENERATED_TOKENS = 64  # a `kvbank generate` the README shows stays quick
MORE_KEYS = "..."  # `{"a": 1, ...}` in an answer comment: more keys may follow
# What README.md and docs/ have today; the extractor finding fewer means it broke, or the docs lost examples.
BASH_BLOCKS_AT_LEAST = 9
CURLS_AT_LEAST = 9
RUN_AT_LEAST = 2
CHECKED_AT_LEAST = 8
ANSWERS_AT_LEAST = 4


@dataclass
class Command:
    doc: str  # README.md or docs/NAME.md
    line: int  # where the command starts
    argv: list[str]
    answer: str | None = None  # the `# {...}` comment after it: the answer's shape

    @property
    def where(self) -> str:
        return f"{self.doc} line {self.line}"

    @property
    def kind(self) -> str:
        program, sub = self.argv[0], self.argv[1] if len(self.argv) > 1 else None
        if program == "curl":
            return "curl"
        if program == "kvbank" and sub in RUN_TO_END:
            return "run"
        if program == "kvbank" and sub in RUN_UNTIL_STOPPED:
            return "flags"
        if program == "make":
            return "make"
        if program == "python" and self.argv[1:3] == ["-m", ROUTER_MODULE]:
            return "router"
        if program == "python" and sub is not None and sub.startswith("bench/") and sub.endswith(".py"):
            return "bench"
        if program == "redis-server":
            return "redis-server"
        if self.argv[:3] == ["pip", "install", "-e"] and len(self.argv) == 4:
            return "pip"
        return "unknown"

    @property
    def id(self) -> str:
        return f"{self.doc}:line{self.line}-{'-'.join(self.argv[:2])}"


@dataclass
class BashBlock:
    doc: str
    line: int  # of its ```bash
    commands: list[Command] = field(default_factory=list)


def _bash_commands(code: str, doc: str, first_line: int) -> list[Command]:
    """The commands of a bash block as the shell splits them, each with the answer comment below it."""
    commands: list[Command] = []
    pending, start = "", first_line
    for number, line in enumerate(code.splitlines(), first_line):
        if not pending:
            start = number
            if line.lstrip().startswith("#"):
                comment = line.lstrip()[1:].strip()
                if comment.startswith("{") and commands:
                    commands[-1].answer = comment
                continue
        pending += line + "\n"
        if pending.rstrip("\n").endswith("\\"):
            continue
        try:
            argv = shlex.split(pending.replace("\\\n", " "), comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if argv and argv[-1] == "&":
            argv = argv[:-1]
        if argv:
            commands.append(Command(doc, start, argv))
        pending = ""
    assert not pending, f"{doc} line {start}: a bash command that never ends"
    return commands


def _bash_blocks() -> list[BashBlock]:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _BASH.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            blocks.append(BashBlock(_name(doc), line, _bash_commands(match.group("code"), _name(doc), line + 1)))
    return blocks


BASH_BLOCKS = _bash_blocks()
COMMANDS = [command for block in BASH_BLOCKS for command in block.commands]


def _of_kind(*kinds: str) -> list:
    return [pytest.param(command, id=command.id) for command in COMMANDS if command.kind in kinds]


CURL_BLOCKS = [
    pytest.param(block, id=f"{block.doc}:line{block.line}")
    for block in BASH_BLOCKS
    if any(command.kind == "curl" for command in block.commands)
]


def test_the_readme_has_its_bash_blocks_and_knows_their_commands():
    unknown = [f"{command.where}: {shlex.join(command.argv)}" for command in COMMANDS if command.kind == "unknown"]
    assert not unknown, f"bash commands this test does not know how to check: {unknown}"
    kinds = [command.kind for command in COMMANDS]
    assert len(BASH_BLOCKS) >= BASH_BLOCKS_AT_LEAST
    assert kinds.count("curl") >= CURLS_AT_LEAST
    assert kinds.count("run") >= RUN_AT_LEAST
    assert kinds.count("flags") + kinds.count("make") >= CHECKED_AT_LEAST
    assert {"router", "bench", "redis-server", "pip"} <= set(kinds)  # the fleet section's commands
    assert sum(command.answer is not None for command in COMMANDS) >= ANSWERS_AT_LEAST
    for command in COMMANDS:
        if command.kind == "curl":
            assert any(README_HOST.search(arg) for arg in command.argv), f"{command.where}: no README host"


@pytest.fixture(scope="session")
def curl() -> str:
    """The real curl; without it the curl tests skip, except under CI, where they fail."""
    path = shutil.which("curl")
    if path is None:
        message = "curl not on PATH (Debian: apt-get install curl)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.mark.parametrize("block", CURL_BLOCKS)
def test_readme_curl_commands_answer_as_shown(block, curl, kvbank_env, tmp_path, request):
    serve = [command for command in block.commands if command.argv[:2] == ["kvbank", "serve"]]
    if not serve:
        _run_curls(block, curl, request.getfixturevalue("server"))
        return
    (serve,) = serve  # the block's curls are meant for the server its own line starts
    log = tmp_path / "server.log"
    process, url = start_server(_without_address(serve.argv[2:]), kvbank_env, log)
    try:
        wait_healthy(process, url, log)
        _run_curls(block, curl, url)
    finally:
        stop_server(process)


def _without_address(args: list[str]) -> list[str]:
    """A `kvbank serve` line's arguments less --host and --port, which the test chooses."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        elif not arg.startswith(("--host=", "--port=")):
            kept.append(arg)
    return kept


def _run_curls(block: BashBlock, curl: str, url: str) -> None:
    ids: dict[str, str] = {}  # "stream" -> the id the block's latest `stream-…` answer gave
    for command in block.commands:
        if command.kind != "curl":
            continue
        args = [_resolve(arg, url, ids, command.where) for arg in command.argv[1:]]
        done = subprocess.run(
            [curl, *args, "-sS", "-w", "\n%{http_code}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        where = f"{command.where}: {shlex.join(['curl', *args])}"
        assert done.returncode == 0, f"{where}\ncurl exited with {done.returncode}: {done.stderr}"
        body, _, status = done.stdout.rpartition("\n")
        assert status.startswith("2"), f"{where}\nHTTP {status}: {body[-3000:]}"
        if any(re.search(r'"stream":\s*true', arg) for arg in args):
            assert body.rstrip().endswith("data: [DONE]"), f"{where}\nnot a finished event stream: {body[-3000:]}"
            continue
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and isinstance(answer.get("id"), str):
            ids[answer["id"].split("-")[0]] = answer["id"]
        if command.answer is not None:
            assert answer is not None, f"{where}\nthe README shows JSON, the server answered: {body[-3000:]}"
            _assert_same_keys(_shown(command.answer, where), answer, where, "answer")


def _resolve(arg: str, url: str, ids: dict[str, str], where: str) -> str:
    """The README's host becomes the test server's; a placeholder id, the one an earlier call answered."""

    def earlier_id(match: re.Match) -> str:
        assert match["kind"] in ids, f"{where}: no earlier call of the block gave a {match[0]} id"
        return ids[match["kind"]]

    return PLACEHOLDER_ID.sub(earlier_id, README_HOST.sub(url, arg))


def _shown(comment: str, where: str):
    """The JSON an answer comment shows, a `, ...}` kept as the key MORE_KEYS."""
    try:
        return json.loads(re.sub(r",\s*\.\.\.\s*(?=\})", f', "{MORE_KEYS}": null', comment))
    except ValueError as error:
        raise AssertionError(f"{where}\nthe answer comment is not JSON ({error}): {comment}") from None


def _assert_same_keys(shown, got, where: str, path: str) -> None:
    """Objects have the keys shown (values may differ), all of them unless the README says `...`."""
    if isinstance(shown, dict):
        assert isinstance(got, dict), f"{where}\n{path} is {got!r}, the README shows an object"
        keys = shown.keys() - {MORE_KEYS}
        missing = sorted(keys - got.keys())
        assert not missing, f"{where}\n{path} lacks the keys {missing} the README shows: {got}"
        extra = sorted(got.keys() - keys)
        assert MORE_KEYS in shown or not extra, (
            f"{where}\n{path} has keys the README does not show: {extra} (show them, or end with `, ...`)"
        )
        for key in keys:
            _assert_same_keys(shown[key], got[key], where, f"{path}.{key}")
    elif isinstance(shown, list):
        assert isinstance(got, list), f"{where}\n{path} is {got!r}, the README shows a list"
        for index, (shown_item, got_item) in enumerate(zip(shown, got)):
            _assert_same_keys(shown_item, got_item, where, f"{path}[{index}]")


def _option(argv: list[str], flag: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


@pytest.mark.parametrize("command", _of_kind("run"))
def test_readme_cli_command_runs_as_written(command, kvbank_env, tmp_path):
    if command.argv[1] == "generate":
        tokens = _option(command.argv, "--max-tokens")
        assert tokens is not None and int(tokens) <= MAX_GENERATED_TOKENS, "a README generate stays quick"
    done = subprocess.run(
        [sys.executable, "-m", "kvbank", *command.argv[1:]],
        cwd=tmp_path,
        env=_alone(kvbank_env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    where = f"{command.where}: {shlex.join(command.argv)}"
    assert done.returncode == 0, f"{where}\nexited with {done.returncode}:\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{where}\nprinted nothing"


#: Runs `kvbank.cli.main` (what `python -m kvbank` runs) on each argv of a JSON list, in one
#: interpreter (each `python -m kvbank ... --help` would import torch again: ~2 s apiece), and
#: prints each one's exit status and output.
HELP_DRIVER = """
import contextlib, io, json, sys
from kvbank.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = f"returned {main(argv)} instead of exiting after --help"
        except SystemExit as exit:
            status = exit.code or 0
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def kvbank_helps(kvbank_env, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every long-running kvbank command of the README with --help appended, by command id."""
    commands = [param.values[0] for param in _of_kind("flags")]
    argvs = [[*command.argv[1:], "--help"] for command in commands]
    done = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, json.dumps(argvs)],
        cwd=tmp_path_factory.mktemp("helps"),
        env={**kvbank_env, "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {
        command.id: subprocess.CompletedProcess(argv, status, out, err)
        for command, argv, (status, out, err) in zip(commands, argvs, results)
    }


@pytest.mark.parametrize("command", _of_kind("flags"))
def test_readme_long_running_command_parses_and_its_flags_exist(command, kvbank_helps):
    _check_help(command, kvbank_helps[command.id])


def _parses_with_its_flags(command: Command, argv: list[str], env: dict, folder: Path) -> None:
    """`argv` (the command as run here) with --help appended exits 0, and every --flag the README
    shows is in that help. argparse handles --help where it meets it: every value before it is
    converted and checked first, and unknown options are only reported at the end, so the help's
    own list catches those."""
    done = subprocess.run(
        [*argv, "--help"],
        cwd=folder,
        env={**env, "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    _check_help(command, done)


def _check_help(command: Command, done: subprocess.CompletedProcess) -> None:
    where = f"{command.where}: {shlex.join(command.argv)}"
    assert done.returncode == 0, f"{where}\nits arguments do not parse:\n{done.stderr[-4000:]}"
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", done.stdout))
    shown = {arg.split("=", 1)[0] for arg in command.argv[1:] if arg.startswith("--")}
    assert shown <= known, f"{where}\nnot options of the command: {sorted(shown - known)}"


@pytest.mark.parametrize("command", _of_kind("make"))
def test_readme_make_target_exists(command):
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in command.argv[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{command.where}: no `{target}`"


@pytest.mark.parametrize("command", _of_kind("router", "bench"))
def test_readme_router_and_bench_commands_parse_and_their_flags_exist(command, kvbank_env, tmp_path):
    if command.kind == "router":
        if importlib.util.find_spec("sglang_router") is None:
            message = "the README's router needs the fleet extra: pip install -e '.[fleet]'"
            pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
        argv = [sys.executable, *command.argv[1:]]
    else:
        argv = [sys.executable, str(REPO_ROOT / command.argv[1]), *command.argv[2:]]
    _parses_with_its_flags(command, argv, kvbank_env, tmp_path)


@pytest.mark.parametrize("command", _of_kind("redis-server"))
def test_readme_redis_server_command_starts_and_answers(command, tmp_path):
    from redis_servers import require_redis_binaries
    from serving import free_port

    require_redis_binaries()
    args = list(command.argv[1:])
    port = str(free_port())
    if "--port" in args:
        args[args.index("--port") + 1] = port
    else:
        args += ["--port", port]
    process = subprocess.Popen(
        ["redis-server", *args, "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = redis.Redis(port=int(port), socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None, f"{command.where}: redis-server exited"
                assert time.monotonic() < deadline, f"{command.where}: redis-server never answered"
                time.sleep(0.05)
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("command", _of_kind("pip"))
def test_readme_pip_extra_exists(command):
    import tomllib

    match = re.fullmatch(r"\.\[(?P<extras>[\w,-]+)\]", command.argv[3])
    assert match, f"{command.where}: install this checkout with an extra, `.[name]`"
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = set(match["extras"].split(",")) - set(extras)
    assert not missing, f"{command.where}: pyproject.toml has no extra {sorted(missing)}"


# --- links, measurement tables, layout -----------------------------------------------------------

_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)
EXTERNAL = ("http://", "https://", "mailto:")
LAYOUT = REPO_ROOT / "docs" / "layout.md"
#: Folders docs/layout.md describes as a whole: their files are named by the folder, so that moving
#: files within them keeps the page true.
DESCRIBED_AS_FOLDERS = ("kvbank/kernels/", "kvbank/cache/policies/", "kvbank/models/")


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (a repeated heading's get -1, -2, ...)."""
    anchors, seen = set(), {}
    for line in _FENCED.sub("", doc.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    broken = []
    for match in _LINK.finditer(_FENCED.sub("", doc.read_text())):
        target = match["target"]
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading in {_name(linked)}")
    assert not broken, f"{_name(doc)} links to what is not there: {broken}"


def test_measurement_tables_match_their_raw_results_and_name_their_commands():
    spec = importlib.util.spec_from_file_location("bench_tables", REPO_ROOT / "bench" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.problems(tables.MEASUREMENTS.read_text()) == []


def test_layout_names_every_module_of_the_package():
    text = LAYOUT.read_text()
    unnamed = set()
    for path in (REPO_ROOT / "kvbank").rglob("*.py"):
        module = _name(path)
        folder = next((folder for folder in DESCRIBED_AS_FOLDERS if module.startswith(folder)), None)
        if folder is None and path.name == "__init__.py" and module != "kvbank/__init__.py":
            folder = module.removesuffix("__init__.py")
        if f"`{folder or module}`" not in text:
            unnamed.add(folder or module)
    assert not unnamed, f"docs/layout.md does not name {sorted(unnamed)}: give each a line"
    gone = sorted(name for name in re.findall(r"`(kvbank/[\w/.]*)`", text) if not (REPO_ROOT / name).exists())
    assert not gone, f"docs/layout.md names what is not in the package: {gone}"
