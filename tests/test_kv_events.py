"""KV cache events in vLLM's format: a plain pyzmq + msgpack subscriber rebuilds the engine's prefix cache."""

import itertools
import os
import sys
import time

import msgpack
import pytest
import zmq
from serving import free_port, request, start_server, stop_server, wait_healthy

from kvbank import LLM, SamplingParams
from kvbank.cache.events import build_events
from kvbank.cache.manager import KVCacheManager
from kvbank.config import EngineConfig

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SHARED = (
    "You are a careful assistant for a public library. You answer questions about opening hours, "
    "borrowing rules, late fees and events, briefly and politely, and you never invent facts. "
)
QUESTIONS = ["When do you open on Saturdays?", "How many books can I borrow?", "Is there a fee for late DVDs?"]
#: unrelated prompts, enough of them to make the small pool evict
OTHERS = [f"Item {i}: " + " ".join(f"w{i * 31 + j}" for j in range(12)) for i in range(3)]


def _engine_hashes(llm: LLM) -> set[int]:
    return {int.from_bytes(h, "big") & ((1 << 64) - 1) for h in llm.engine.manager.pool.index}


def _replay(context: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every batch the engine still buffers from sequence `start` on."""
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while True:
            assert dealer.poll(10_000), "no answer from the replay socket"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))


def _apply(batches: list[tuple[int, bytes]]) -> tuple[set[int], int]:
    """The block set the events describe (checking each block is stored and removed once), and blocks removed."""
    blocks: set[int] = set()
    removed = 0
    for _, payload in batches:
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float) and events
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name = event[1:]
                assert (block_size, lora_id, medium, lora_name) == (BLOCK_SIZE, None, "CPU", None)
                assert len(tokens) == len(hashes) * BLOCK_SIZE
                assert parent is None or parent in blocks, "a stored block's parent is cached"
                for h in hashes:
                    assert isinstance(h, int) and 0 <= h < 2**64
                    assert h not in blocks, "stored twice"
                    blocks.add(h)
            elif tag == "BlockRemoved":
                hashes, medium = event[1:]
                assert medium == "CPU"
                for h in hashes:
                    assert h in blocks, "removed but never stored"
                    blocks.remove(h)
                removed += len(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                blocks.clear()
    return blocks, removed


def test_subscriber_rebuilds_the_prefix_cache():
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(num_gpu_blocks=8, kv_events_endpoint=pub, kv_events_replay_endpoint=replay)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    live: list[tuple[int, bytes]] = []

    def receive(timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        live.append((int.from_bytes(seq, "big"), payload))
        return True

    try:
        for prompt in [SHARED + question for question in QUESTIONS] + OTHERS:  # 8 blocks hold about 3 prompts
            llm.generate([prompt], GREEDY)
        assert _engine_hashes(llm)
        dropped = llm.reset_prefix_cache()
        assert dropped > 0 and not _engine_hashes(llm)
        llm.generate([SHARED + QUESTIONS[0]], GREEDY)
        expected = _engine_hashes(llm)
        assert expected
        # A subscriber misses what was sent before its subscription took effect (at least the
        # startup batch): the replay socket resends it, up to the first batch heard live and past it.
        assert receive(10_000), "the subscriber heard nothing"
        replayed = _replay(context, replay, 0)
    finally:
        llm.close()  # sends what is pending, then closes the sockets
    while receive(500):  # everything was sent before close() returned
        pass
    sub.close()
    context.term()

    seqs = [seq for seq, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "live sequence numbers count up by one"
    assert [seq for seq, _ in replayed[: seqs[0] + 1]] == list(range(seqs[0] + 1)), "replay resends from 0"
    assert replayed[seqs[0]] == live[0], "replay resends the very batch"
    assert msgpack.unpackb(replayed[0][1])[1] == [["AllBlocksCleared"]], "the engine starts with a clean slate"
    blocks, removed = _apply(replayed[: seqs[0]] + live)
    assert removed > dropped, "the small pool evicted blocks before the reset"
    assert blocks == expected


def test_a_documents_blocks_are_stored_as_a_chain_of_their_own():
    """A document computed alone (engine/blend.py) is published as a chain that starts with it
    (parent None), apart from the prompt's chain, and its blocks hash under the document's root,
    so they never match a plain prompt that starts with the same tokens."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(num_gpu_blocks=64, kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}", kv_events_replay_endpoint=replay)
    context = zmq.Context()
    try:
        tokenizer = llm.get_tokenizer()
        document = tokenizer.encode(SHARED * 2, add_special_tokens=False)
        llm.generate([{"segments": [QUESTIONS[0], {"document": document}, QUESTIONS[1]]}], GREEDY)
        llm.engine.manager.end_step()
        time.sleep(0.2)  # the publisher thread encodes the last batch
        blocks, _ = _apply(_replay(context, replay, 0))
        assert blocks == _engine_hashes(llm)
        stored = [
            event
            for _, payload in _replay(context, replay, 0)
            for event in msgpack.unpackb(payload)[1]
            if event[0] == "BlockStored" and event[2] is None
        ]
        whole = len(document) // BLOCK_SIZE * BLOCK_SIZE
        assert any(event[3] == document[:whole] for event in stored), "the document's chain, from its first block"
        plain = llm.generate([{"prompt_token_ids": document[:whole] + [1]}], GREEDY)[0]
        assert plain.num_cached_tokens == 0  # the same tokens as a prompt: another chain
    finally:
        llm.close()
        context.term()


def test_one_step_encodes_chained_blocks_as_one_event():
    publisher = build_events(f"tcp://127.0.0.1:{free_port()}", None, "", 2, "cuda")
    try:
        a, b, c, x = (bytes([i]) * 16 for i in range(1, 5))
        big = lambda h: int.from_bytes(h[-8:], "big")  # noqa: E731
        events = [("stored", a, None, (1, 2)), ("stored", b, a, (3, 4)), ("removed", x), ("stored", c, b, (5, 6))]
        ts, encoded = publisher.encode(events)
        assert encoded == [
            ["BlockStored", [big(a), big(b)], None, [1, 2, 3, 4], 2, None, "GPU", None],
            ["BlockRemoved", [big(x)], "GPU"],
            ["BlockStored", [big(c)], big(b), [5, 6], 2, None, "GPU", None],
        ]
    finally:
        publisher.close()


def test_a_manager_without_events_installs_no_hooks():
    manager = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True, max_pinned_fraction=0.5)
    assert manager.events is None and manager.pool.on_index is None and manager.pool.on_forget is None


@pytest.mark.parametrize("missing", ["zmq", "msgpack"])
def test_a_missing_package_names_the_option(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if it were not installed
    with pytest.raises(RuntimeError, match=f"kv_events_endpoint needs the '{missing}' package"):
        build_events(f"tcp://127.0.0.1:{free_port()}", None, "", BLOCK_SIZE, "cpu")


def test_a_taken_port_names_the_option():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with zmq.Context() as context, context.socket(zmq.PUB) as taken:
        taken.setsockopt(zmq.LINGER, 0)
        taken.bind(endpoint)
        with pytest.raises(ValueError, match=f"kv_events_endpoint='{endpoint}' cannot be bound"):
            build_events(endpoint, None, "", BLOCK_SIZE, "cpu")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_events_endpoint": "127.0.0.1:5557"}, "kv_events_endpoint='127.0.0.1:5557' is not a ZMQ endpoint"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:99999"}, "port from 1 to 65535"),
        ({"kv_events_endpoint": "tcp://127.0.0.1"}, "needs a host and a port"),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "kv_events_replay_endpoint needs kv_events_endpoint"),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
            "is kv_events_endpoint too",
        ),
    ],
)
def test_bad_endpoints_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**options)


def test_serve_publishes_events(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    process, url = start_server(["--kv-events-endpoint", endpoint], dict(os.environ), log)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        wait_healthy(process, url, log)
        # A subscriber joins a PUB socket asynchronously, and what is published before it has joined
        # is not sent to it: send small requests until one's batch arrives, then the one to check.
        deadline = time.monotonic() + 60
        for probe in itertools.count():
            body = {"prompt": f"Probe {probe}: " + SHARED, "max_tokens": 1}
            assert request(f"{url}/v1/completions", body)[0] == 200
            if sub.poll(1_000):
                break
            assert time.monotonic() < deadline, f"no event batch arrived in 60 s:\n{log.read_text()[-2000:]}"
        while sub.poll(500):  # the probes' batches
            sub.recv_multipart()
        prompt = "A note on events: " + SHARED + QUESTIONS[1]
        status, body, _ = request(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        full_blocks = body["usage"]["prompt_tokens"] // BLOCK_SIZE
        stored: list[int] = []
        while len(stored) < full_blocks:
            assert sub.poll(10_000), f"{len(stored)} blocks stored, {full_blocks} expected:\n{log.read_text()[-2000:]}"
            topic, _, payload = sub.recv_multipart()
            _, events = msgpack.unpackb(payload)
            stored += [h for event in events if event[0] == "BlockStored" for h in event[1]]
    finally:
        sub.close()
        context.term()
        stop_server(process)
