"""The registries of pluggable parts (tiers, model architectures, KV policies) agree with what they
register: every tier's options are engine options, every architecture's model class runs the stack
form it claims, every policy module's policy is spelled and parsed back."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

from kvbank.cache import policies
from kvbank.cache.policies import POLICIES, FrameWindow, KVPolicy, parse_policy
from kvbank.cache.tiers import TIERS, build_tiers
from kvbank.config import EngineConfig
from kvbank.models.archs import ARCHS, folder_arch, gguf_arch

ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
NAMESPACE = b"\x01" * 16 + b"auto"


@pytest.mark.parametrize("name", TIERS)
def test_every_tier_option_is_an_engine_option_with_its_type_and_default(name):
    entry = TIERS[name]
    tier = entry.load()
    assert tier.name == name
    assert entry.switch in {option.name for option in tier.options}
    for option in tier.options:
        field = ENGINE_FIELDS[option.name]
        assert (field.type, field.default) == (option.type, option.default), option.name
        assert field.metadata["plan"] is False, f"{option.name} changes no number `kvbank plan` prints"


def test_tiers_are_built_fastest_first_from_their_options(tmp_path):
    config = EngineConfig(
        kv_host_gb=0.5, kv_disk_dir=str(tmp_path), kv_disk_gb=0.25, kv_redis_url="redis://127.0.0.1:1"
    )
    tiers = build_tiers(config, NAMESPACE)  # a Redis tier connects on first use: none is needed here
    try:
        assert [tier.name for tier in tiers] == ["host", "disk", "redis"]
        assert [tier.capacity_bytes for tier in tiers] == [2**29, 2**28, None]
    finally:
        for tier in tiers:
            tier.close()
    assert build_tiers(EngineConfig(), NAMESPACE) == []


def test_tiers_not_asked_for_are_never_imported(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvbank.cache.tiers.redis", None)  # an import of it now raises
    tiers = build_tiers(EngineConfig(kv_host_gb=0.1, kv_disk_dir=str(tmp_path)), NAMESPACE)
    assert [tier.name for tier in tiers] == ["host", "disk"]


@pytest.mark.parametrize("arch", ARCHS.values(), ids=list(ARCHS))
def test_every_architecture_runs_the_stack_form_it_names(arch):
    assert arch.stack_form == ("gemma" if arch.name == "gemma3" else "llama")
    assert gguf_arch(arch.name) is arch
    assert folder_arch(arch.model_type, Path("config.json")) is arch


def test_unknown_architectures_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, mistral"):
        gguf_arch("gpt2")
    with pytest.raises(ValueError, match=r"model_type 'gpt2' in config.json is not supported; supported: .*gemma3_t"):
        folder_arch("gpt2", Path("config.json"))
    with pytest.raises(ValueError, match="image-text model; only its text models"):
        folder_arch("gemma3", Path("config.json"))


def _policy_classes() -> set[type[KVPolicy]]:
    found = set()
    for module in pkgutil.iter_modules(policies.__path__, f"{policies.__name__}."):
        for _, cls in inspect.getmembers(importlib.import_module(module.name), inspect.isclass):
            if issubclass(cls, KVPolicy) and not inspect.isabstract(cls):
                found.add(cls)
    return found


def test_every_policy_module_is_registered_and_parses_back():
    assert _policy_classes() == set(POLICIES.values())
    for name, cls in POLICIES.items():
        assert cls.name == name
        policy = cls()
        assert parse_policy(str(policy), stream=cls is FrameWindow) == policy
