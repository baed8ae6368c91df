"""Shared fixtures: kvbank in subprocesses, the native CPU kernels, and the bundled model loaded once."""

import copy
import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def kvbank_env() -> dict[str, str]:
    """Environment for a `python -m kvbank` subprocess that imports this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    # On a small shared CPU, torch's thread pool spinning against the test process's own threads
    # makes every matmul dozens of times slower; one thread each is far faster.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def native():
    """kvbank's native kernel module; under CI a machine that cannot build it fails instead of skipping."""
    from kvbank import kernels

    module = kernels.native()
    if module is None and not os.environ.get("CI"):
        pytest.skip(f"native kernels unavailable here: {kernels.failure()}")
    assert module is not None, kernels.failure()
    return module


def cpu_levels(lowest: str = "scalar") -> list[str]:
    """The instruction-set levels (kvbank/kernels/isa.h) this CPU runs, from `lowest` up; none on a
    CPU below `lowest` (a test parametrized over them is then skipped), and none without the native
    kernels (the `native` fixture then fails under CI and skips elsewhere)."""
    from kvbank import kernels
    from kvbank.kernels import isa

    module = kernels.native()
    if module is None:
        return []
    levels = isa.levels_below_cpu(module)
    return levels[levels.index(lowest) :] if lowest in levels else []


@pytest.fixture(scope="module")
def isa_level(request, native):
    """Parametrize with `indirect=True` over levels: the module's kernels run capped at the level."""
    from kvbank.kernels import isa

    with isa.capped(native, request.param):
        yield request.param


# --- the bundled model, loaded once per session ---------------------------------------------------
#
# About fifty tests build an engine on the bundled model, each loading it again: parsing the GGUF
# and dequantizing every tensor took ~5 s, and packing the 4-bit projections into the native
# kernels' records another ~6 s, for the same bytes every time. The first load is the real one; later
# engines get the same read-only tensors (with their own config and tokenizer objects, which engines
# may change). Nothing may write into them: the session ends with a check that they are unchanged.
# Likewise gguf-py's GGUFReader parses the file's header once (~5 s) for transformers, which reads
# the bundled model through it (kvbank's own GGUFFile takes tens of milliseconds); its tensor data
# is memory-mapped read-only.


def _digest(tensors) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.digest()


def _tensors_of(value) -> list:
    """A tensor, the tensors of a tuple, or the tensor fields of Int4Blocks / Int8Blocks."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value if isinstance(v, torch.Tensor) for t in _tensors_of(v)]
    return [v for f in dataclasses.fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)]


class _SharedBundledModel:
    """Stand-ins for gguf.GGUFReader, load_model, Int4Blocks.cat, pack and pack_q8 that compute
    what concerns the bundled model once and hand out the same result after."""

    def __init__(self, bundled_path: str | None) -> None:
        import gguf

        from kvbank.models import build, llama
        from kvbank.models.packed import Int4Blocks

        self._originals = {
            "gguf_reader": gguf.GGUFReader,
            "load_model": build.load_model,
            "cat": Int4Blocks.cat,
            "pack": llama.pack,
            "pack_q8": llama.pack_q8,
        }
        self._path = bundled_path and os.path.realpath(bundled_path)
        self._reader = None
        self.loaded = None
        self._num_tensors = 0
        self._ids: set[int] = set()  # the shared objects packing may be asked about
        self._memo: dict[tuple, tuple] = {}  # key -> (the key's objects, kept alive so ids stay theirs; result)
        self._digests: list[tuple] = []  # (what yields shared tensors, their digest when first made)

    def gguf_reader(self, path, mode="r"):
        if mode != "r" or self._path is None or os.path.realpath(path) != self._path:
            return self._originals["gguf_reader"](path, mode)
        if self._reader is None:
            self._reader = self._originals["gguf_reader"](path, mode)
        return self._reader

    def load_model(self, path, progress=None):
        if path is not None:
            return self._originals["load_model"](path, progress)
        if self.loaded is None:
            self.loaded = self._originals["load_model"](None)
            self._num_tensors = len(self.gguf_reader(self._path).tensors)
            blocks = (*self.loaded.int4.values(), *self.loaded.int8.values())
            self._ids = {id(b) for b in blocks}
            tensors = lambda: [*self.loaded.state_dict.values(), *(t for b in blocks for t in _tensors_of(b))]  # noqa: E731
            self._digests.append((tensors, _digest(tensors())))
        if progress:
            for done in range(1, self._num_tensors + 1):
                progress(done, self._num_tensors)
        loaded = self.loaded
        return dataclasses.replace(
            loaded,
            config=copy.deepcopy(loaded.config),
            state_dict=dict(loaded.state_dict),
            tokenizer=copy.copy(loaded.tokenizer),
            int4=dict(loaded.int4),
            int8=dict(loaded.int8),
        )

    def _memoized(self, name, args):
        fn = self._originals[name]
        call = (lambda: fn(list(args))) if name == "cat" else (lambda: fn(*args))
        if not all(id(a) in self._ids for a in args):
            return call()
        key = (name, *map(id, args))
        if key not in self._memo:
            result = call()
            self._memo[key] = (args, result)
            self._ids.add(id(result))
            tensors = lambda: _tensors_of(result)  # noqa: E731
            self._digests.append((tensors, _digest(tensors())))
        return self._memo[key][1]

    def cat(self, parts):
        return self._memoized("cat", tuple(parts))

    def pack(self, blocks):
        return self._memoized("pack", (blocks,))

    def pack_q8(self, blocks):
        return self._memoized("pack_q8", (blocks,))

    def unchanged(self) -> bool:
        return all(_digest(tensors()) == digest for tensors, digest in self._digests)


@pytest.fixture(scope="session", autouse=True)
def shared_bundled_model():
    import gguf

    from kvbank.models import build, llama
    from kvbank.models.loader import bundled_model_path
    from kvbank.models.packed import Int4Blocks

    try:
        bundled = bundled_model_path()
    except ValueError:  # not installed: the tests that need it fail saying so
        bundled = None
    shared = _SharedBundledModel(bundled)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared.gguf_reader)
        # transformers builds gguf's read-only tensor-name map once per tensor it loads (~6 s a model)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        patch.setattr(build, "load_model", shared.load_model)
        patch.setattr(Int4Blocks, "cat", staticmethod(shared.cat))
        patch.setattr(llama, "pack", shared.pack)
        patch.setattr(llama, "pack_q8", shared.pack_q8)
        yield shared
    assert shared.unchanged(), "a test or the engine wrote into the shared weights of the bundled model"


@pytest.fixture(scope="session")
def bundled_transformers_model():
    """The bundled model as transformers loads it from its GGUF (float32), the tests' reference;
    loaded once (dequantizing the GGUF takes ~10 s) and shared read-only by every module."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from kvbank.models.loader import BUNDLED_FILE, BUNDLED_PACKAGE

    folder = os.path.dirname(importlib.util.find_spec(BUNDLED_PACKAGE).origin)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=BUNDLED_FILE, dtype=torch.float32)
    return model.eval()
