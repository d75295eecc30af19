"""The plugin manager: built-ins and defaults, options, unknown names and conflicts, broken plugins, the
config file's [plugins] section and the ``engine plugins`` listing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvloom.builder import build_engine
from kvloom.cli.main import main
from kvloom.core.config import EngineConfig
from kvloom.plugins import hookimpl
from kvloom.plugins.builtin.free_list import FreeListAllocator
from kvloom.plugins.builtin.prefix_cache import HashPrefixCache
from kvloom.plugins.builtin.priority import PriorityPolicy
from kvloom.plugins.info import PluginInfo, PluginOption
from kvloom.plugins.manager import PluginConflictError, PluginError, PluginManager, UnknownPluginError

BUILTINS = {"fcfs": "scheduler", "priority": "scheduler", "sjf": "scheduler", "free_list": "kv_allocator",
            "fp8": "quantization", "awq": "quantization", "gptq": "quantization", "mxfp4": "quantization",
            "prefix_cache": "prefix_cache", "spec_decode": "spec_decode"}


class NgramProposer:
    """A third-party spec_decode plugin written against the hook."""

    @hookimpl
    def kvloom_plugin_info(self):
        return PluginInfo(kind="spec_decode", description="test proposer",
                          options=(PluginOption("k", 3, "draft tokens"),),
                          conflicts={"sjf": "drafts assume arrival order"})

    @hookimpl
    def kvloom_spec_proposer(self, options):
        return SimpleNamespace(name="ngram", num_speculative_tokens=options["k"], propose=lambda requests: {})


class Int8:
    @hookimpl
    def kvloom_plugin_info(self):
        return PluginInfo(kind="quantization", description="test quantization")

    @hookimpl
    def kvloom_quantization(self, hf_config):
        return SimpleNamespace(name="int8")


def test_builtins_are_listed_with_kind_origin_and_options():
    rows = {r["name"]: r for r in PluginManager().listing()}
    assert {n: r["kind"] for n, r in rows.items() if r["origin"] == "built-in"} == BUILTINS
    assert [o["name"] for o in rows["sjf"]["options"]] == ["aging_tokens_per_s"]
    assert rows["prefix_cache"]["options"][0]["choices"] == ["sha256", "builtin"]
    assert [n for n, r in rows.items() if r["default"]] == ["fcfs", "free_list"]


def test_defaults_and_chosen_plugins_are_built_through_the_facade():
    config = EngineConfig()
    default = PluginManager()
    assert default.enabled == {"scheduler": "fcfs", "kv_allocator": "free_list"}
    assert default.make_prefix_cache(16, config) is None
    chosen = PluginManager(["prefix_cache", "priority"])
    assert chosen.enabled == {"scheduler": "priority", "kv_allocator": "free_list", "prefix_cache": "prefix_cache"}
    assert isinstance(chosen.make_scheduler_policy(config), PriorityPolicy)
    assert isinstance(chosen.make_kv_allocator(10, config), FreeListAllocator)
    cache = chosen.make_prefix_cache(8, config)
    assert isinstance(cache, HashPrefixCache) and cache.block_size == 8


def test_the_free_list_reuses_freed_blocks_first_unless_a_prefix_cache_keeps_them():
    plain = FreeListAllocator(8)
    first = plain.allocate(3)
    plain.free(first)
    assert sorted(plain.allocate(3)) == first  # the warm blocks again; the never-written ones wait
    cached = FreeListAllocator(8)
    evicted = []
    cached.on_evict = evicted.append
    first = cached.allocate(3)
    cached.free(first)
    assert cached.allocate(3) == [3, 4, 5] and evicted == [0, 1, 2, 3, 4, 5]  # cached blocks reused last (LRU)


def test_unknown_plugin_fails_listing_the_known_ones():
    with pytest.raises(UnknownPluginError, match="unknown plugin 'prefix_cach'; available plugins: ") as e:
        PluginManager(["prefix_cach"])
    assert all(name in str(e.value) for name in BUILTINS)
    with pytest.raises(UnknownPluginError, match="options are given for unknown plugin 'nope'"):
        PluginManager([], {"nope": {}})


def test_two_schedulers_conflict_naming_both():
    with pytest.raises(PluginConflictError, match="'priority' and 'sjf' are both scheduler plugins"):
        PluginManager(["priority", "sjf"])


def test_the_engine_fails_on_a_conflict_before_looking_for_the_model(tmp_path):
    with pytest.raises(PluginConflictError, match="'fcfs' and 'sjf'"):
        build_engine(EngineConfig(model=str(tmp_path / "no-such-model"), plugins=["fcfs", "sjf"]))


def test_declared_conflicts_and_kinds_the_engine_does_not_run_yet():
    extra = {"ngram": NgramProposer(), "int8": Int8()}
    with pytest.raises(PluginConflictError, match="plugin 'ngram' cannot run with 'sjf': drafts assume arrival order"):
        PluginManager(["sjf", "ngram"], extra_plugins=extra)
    manager = PluginManager(["ngram"], {"ngram": {"k": 5}}, extra_plugins=extra)
    proposer = manager.make_spec_proposer(hf_config=None, config=EngineConfig())
    assert proposer.num_speculative_tokens == 5  # the hook is callable through the facade
    manager.validate(EngineConfig(model="/models/llama"))  # the engine runs spec_decode plugins
    with pytest.raises(PluginConflictError, match="quantization plugin 'int8' cannot run with a GGUF model"):
        PluginManager(["int8"], extra_plugins=extra).validate(EngineConfig(model="m.gguf"))


def test_options_are_typed_and_checked():
    manager = PluginManager(["sjf", "prefix_cache"], {"sjf": {"aging_tokens_per_s": 25}})
    assert manager.options == {"sjf": {"aging_tokens_per_s": 25.0}, "free_list": {},
                               "prefix_cache": {"hash_algorithm": "sha256"}}
    assert manager.make_scheduler_policy(EngineConfig()).aging_tokens_per_s == 25.0
    with pytest.raises(PluginError, match="plugin 'sjf' has no option 'aging'; its options: aging_tokens_per_s"):
        PluginManager(["sjf"], {"sjf": {"aging": 1}})
    with pytest.raises(PluginError, match="option aging_tokens_per_s='fast' of plugin 'sjf' must be a float"):
        PluginManager(["sjf"], {"sjf": {"aging_tokens_per_s": "fast"}})
    with pytest.raises(PluginError, match="option preempt_for_waiting=1 of plugin 'priority' must be a bool"):
        PluginManager(["priority"], {"priority": {"preempt_for_waiting": 1}})
    with pytest.raises(PluginError, match=r"hash_algorithm='md5' of plugin 'prefix_cache' is not one of"):
        PluginManager(["prefix_cache"], {"prefix_cache": {"hash_algorithm": "md5"}})


def test_config_file_plugins_section(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text('block_size = 8\n[plugins]\nenable = ["sjf", "prefix_cache"]\n'
                    '[plugins.sjf]\naging_tokens_per_s = 25\n[plugins.prefix_cache]\nhash_algorithm = "builtin"\n')
    config = EngineConfig.from_toml(str(path))
    manager = PluginManager.from_config(config)
    assert manager.make_scheduler_policy(config).aging_tokens_per_s == 25.0
    assert manager.make_prefix_cache(config.block_size, config).hash_algorithm == "builtin"


def test_broken_plugins_are_listed_and_cannot_be_enabled():
    class NoInfo:
        @hookimpl
        def kvloom_scheduler_policy(self):
            return None

    class WrongHook:
        @hookimpl
        def kvloom_plugin_info(self):
            return PluginInfo(kind="scheduler", description="declares a scheduler, builds an allocator")

        @hookimpl
        def kvloom_kv_allocator(self, num_blocks):
            return FreeListAllocator(num_blocks)

    class Misspelt:
        @hookimpl
        def kvloom_plugin_infos(self):
            return None

    manager = PluginManager(extra_plugins={"noinfo": NoInfo(), "wrong": WrongHook(), "typo": Misspelt(),
                                           "fcfs": Misspelt()})
    assert manager.available["fcfs"].origin == "built-in"  # a clashing name never replaces a plugin
    errors = {r["name"]: r["error"] for r in manager.listing() if r["error"]}
    assert "does not implement kvloom_plugin_info" in errors["noinfo"]
    assert "a scheduler plugin implements kvloom_scheduler_policy and no other" in errors["wrong"]
    assert "kvloom_plugin_infos" in errors["typo"]
    with pytest.raises(PluginError, match="plugin 'wrong' .* cannot be used"):
        PluginManager(["wrong"], extra_plugins={"wrong": WrongHook()})


def test_engine_plugins_command(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    for name, kind in BUILTINS.items():
        assert any(line.split()[:3] == [name, kind, "built-in"] for line in text.splitlines())
    assert "option aging_tokens_per_s = 100.0" in text
    assert main(["plugins", "--json", "--plugins", "sjf,prefix_cache",
                 "--plugin-options", '{"sjf": {"aging_tokens_per_s": 5}}']) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sjf"]["enabled"] and rows["sjf"]["options"][0]["value"] == 5.0 and not rows["fcfs"]["enabled"]
    assert main(["plugins", "--plugins", "priority,sjf"]) == 2
    assert "'priority' and 'sjf' are both scheduler plugins" in capsys.readouterr().err
    assert main(["plugins", "--plugins", "nope"]) == 2
    assert "unknown plugin 'nope'; available plugins:" in capsys.readouterr().err
