"""Real `redis-server` processes for tests: standalone on a loopback port or a unix socket, and a Redis Cluster.

A test module gets the fixtures with `pytest_plugins = ["redis_servers"]`. Every
server runs in its own temporary directory without persistence, and a test can kill one and start it
again at the same address to play an outage. Without the binaries the fixtures skip, except under CI,
where a missing binary fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from serving import free_port

STARTUP_TIMEOUT_S = 10
CLUSTER_NODES = 3
# Another listener (a parallel test run) may take a probed port before redis-server binds it.
PORT_ATTEMPTS = 20
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (so refuses ports above 55535)


def require_redis_binaries() -> None:
    """Skip (or under CI, fail) the calling test when redis-server or redis-cli is not on PATH."""
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not on PATH (Debian: apt-get install redis-server redis-tools)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class RedisServer:
    """One redis-server in `directory`, on loopback `port` (0: none) and/or unix `socket`; restartable in place."""

    directory: Path
    port: int = 0
    socket: Path | None = None
    cluster: bool = False
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}" if self.port else f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        """Start the server (again) at its address and wait until it answers PING."""
        assert self.process is None, "already running"
        args = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory)]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.socket:
            args += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def kill(self) -> None:
        """SIGKILL: the abrupt outage (no shutdown, connections reset)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> redis.Redis:
        """A plain client of this one server (for looking at what a test stored)."""
        return redis.Redis.from_url(self.url, socket_timeout=STARTUP_TIMEOUT_S)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self.client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self.process = None
                    raise RuntimeError(f"redis-server exited:\n{self.log_path.read_text()[-2000:]}")
                try:
                    if self._answering(client):
                        return
                except redis.RedisError:  # not up yet, or a stranger's server that refuses us
                    pass
                time.sleep(0.02)
        raise RuntimeError(
            f"redis-server did not answer in {STARTUP_TIMEOUT_S} s:\n{self.log_path.read_text()[-2000:]}"
        )

    def _answering(self, client: redis.Redis) -> bool:
        # A server that took our port first answers too, until ours fails to bind and exits.
        return client.info("server")["process_id"] == self.process.pid


def start_redis_server(directory: Path, unix_socket: bool = False, cluster: bool = False) -> RedisServer:
    """A running server in `directory`: on a unix socket only, or on a free loopback port."""
    require_redis_binaries()
    directory.mkdir(parents=True, exist_ok=True)
    if unix_socket:
        server = RedisServer(directory, socket=directory / "redis.sock", cluster=cluster)
        server.start()
        return server
    for attempt in range(PORT_ATTEMPTS):
        server = RedisServer(directory, port=free_port(also_free=CLUSTER_BUS_OFFSET), cluster=cluster)
        try:
            server.start()
            return server
        except RuntimeError:
            _discard(server)
            if attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _discard(server: RedisServer) -> None:
    """Stop a server that failed to start, so the next attempt starts afresh in its directory."""
    server.kill()
    # a cluster node records its address in nodes.conf, which would outlive the port it failed on
    (server.directory / "nodes.conf").unlink(missing_ok=True)


@dataclass
class RedisClusterServers:
    """A Redis Cluster of `nodes` masters without replicas, each a RedisServer; `url` names the first."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def wait_ok(self) -> None:
        """Return once every node reports cluster_state:ok (slots assigned and the nodes agreeing)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(_cluster_state(node) == "ok" for node in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok in {STARTUP_TIMEOUT_S} s: {[_cluster_state(n) for n in self.nodes]}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def start_redis_cluster(directory: Path, nodes: int = CLUSTER_NODES) -> RedisClusterServers:
    """Start `nodes` cluster-enabled servers and join them with `redis-cli --cluster create`."""
    servers = RedisClusterServers([])
    try:
        for i in range(nodes):
            servers.nodes.append(start_redis_server(directory / f"node{i}", cluster=True))
        addresses = [f"127.0.0.1:{node.port}" for node in servers.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=STARTUP_TIMEOUT_S,
        )
        servers.wait_ok()
    except BaseException:
        servers.stop()
        raise
    return servers


def _cluster_state(node: RedisServer) -> str:
    try:
        with node.client() as client:
            return str(client.cluster("INFO")["cluster_state"])
    except redis.RedisError as e:
        return f"unreachable ({e})"


@pytest.fixture
def start_redis(tmp_path_factory):
    """A function starting standalone redis-servers (`unix_socket=True`: on a socket only), all killed at teardown."""
    servers: list[RedisServer] = []

    def start(unix_socket: bool = False) -> RedisServer:
        servers.append(start_redis_server(tmp_path_factory.mktemp("redis"), unix_socket=unix_socket))
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def redis_server(start_redis) -> RedisServer:
    """A standalone redis-server on a free loopback port, killed at teardown."""
    return start_redis()


@pytest.fixture
def unix_redis_server(start_redis) -> RedisServer:
    """A standalone redis-server listening on a unix socket only, killed at teardown."""
    return start_redis(unix_socket=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-master Redis Cluster on free loopback ports, shared by the session; a test that kills a node restarts it."""
    require_redis_binaries()
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()
