"""The plugin manager: finds plugins (the built-ins, then the ``kvloom.plugins`` entry points), enables the
chosen ones, checks their options and combinations, and wraps each factory hook in a typed method so
the rest of kvloom never calls a hook by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import pluggy

from kvloom.core.config import DEFAULT_MODEL, ConfigError, EngineConfig
from kvloom.plugins import _PROJECT, hookspecs
from kvloom.plugins.hookspecs import FACTORY_HOOKS
from kvloom.plugins.info import KINDS, PluginInfo, PluginOption

if TYPE_CHECKING:
    from kvloom.core.engine.kv_cache import BlockAllocator, PrefixCache
    from kvloom.core.engine.scheduler import SchedulingPolicy
    from kvloom.plugins.interfaces import DraftProposer, QuantizationMethod

logger = logging.getLogger("kvloom")

# Each a module, named by its last part, or ``module:object``, named by the object (as entry points are written).
BUILTIN_PLUGINS = (
    "kvloom.plugins.builtin.fcfs",
    "kvloom.plugins.builtin.priority",
    "kvloom.plugins.builtin.sjf",
    "kvloom.plugins.builtin.free_list",
    "kvloom.plugins.builtin.prefix_cache",
    "kvloom.plugins.builtin.spec_decode",
    "kvloom.plugins.builtin.quantization:fp8",
    "kvloom.plugins.builtin.quantization:awq",
    "kvloom.plugins.builtin.quantization:gptq",
    "kvloom.plugins.builtin.quantization:mxfp4",
)
# The built-in quantization plugins: one per format, picked by a checkpoint's quantization_config.
BUILTIN_QUANTIZATIONS = ("fp8", "awq", "gptq", "mxfp4")
ENTRY_POINT_GROUP = "kvloom.plugins"
# The plugin of each kind that is active when none of that kind is chosen.
DEFAULTS = {"scheduler": "fcfs", "kv_allocator": "free_list"}


class PluginError(ConfigError):
    """A plugin cannot be loaded or used; the message names the plugin and what is wrong."""


class UnknownPluginError(PluginError):
    """A plugin name that no built-in or installed plugin has; the message lists the known ones."""


class PluginConflictError(PluginError):
    """Enabled plugins that cannot run together; the message names both and why."""


@dataclass(frozen=True)
class AvailablePlugin:
    name: str
    origin: str  # "built-in", "entry point of DIST VERSION" or "registered in code"
    info: PluginInfo | None  # None when the plugin is broken
    error: str | None = None  # why it is broken


class PluginManager:
    """The available plugins, and the enabled ones: exactly one scheduler and one KV allocator, at most
    one plugin of every other kind.

    ``extra_plugins`` registers plugin objects from code (tests, embedding applications) beside the
    built-ins and entry points.
    """

    def __init__(
        self,
        enabled: Sequence[str] = (),
        options: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        extra_plugins: Mapping[str, object] | None = None,
    ) -> None:
        self._pm = pluggy.PluginManager(_PROJECT)
        self._pm.add_hookspecs(hookspecs)
        if logger.isEnabledFor(logging.DEBUG):  # a trace of every hook call, for debugging plugins
            self._pm.trace.root.setwriter(logger.debug)
            self._pm.enable_tracing()
        self.available: dict[str, AvailablePlugin] = {}
        self._objects: dict[str, object] = {}  # to register a plugin enabled later (a checkpoint's format)
        for entry in BUILTIN_PLUGINS:
            self._add(*_builtin(entry), "built-in")
        self._add_entry_points()
        for name, plugin in (extra_plugins or {}).items():
            self._add(name, plugin, "registered in code")
        self.enabled: dict[str, str] = self._select(list(enabled))  # kind -> plugin name
        self.options: dict[str, dict[str, Any]] = self._resolve_options(options or {})
        for name in list(self.available):
            if name not in self.enabled.values() and self._pm.has_plugin(name):
                self._pm.unregister(name=name)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "PluginManager":
        """The plugins ``config`` enables, checked against each other and the config; raises PluginError.
        ``config.quantization`` enables the quantization plugin of that name."""
        enabled = list(config.plugins) + ([config.quantization] if config.quantization else [])
        manager = cls(enabled, config.plugin_options)
        manager.validate(config)
        return manager

    # --- loading -----------------------------------------------------------------------------------
    def _add_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            origin = f"entry point of {ep.dist.name} {ep.dist.version}" if ep.dist else "entry point"
            if self._name_taken(ep.name, origin):
                continue
            try:
                plugin = ep.load()
            except Exception as e:  # a broken third-party plugin must not stop engines that do not use it
                self._add_broken(ep.name, origin, f"cannot be imported ({type(e).__name__}: {e})")
                continue
            self._add(ep.name, plugin, origin)

    def _name_taken(self, name: str, origin: str) -> bool:
        if name in self.available:
            logger.warning("plugin name %r (%s) is taken by the plugin from %s; ignoring it",
                           name, origin, self.available[name].origin)
        return name in self.available

    def _add(self, name: str, plugin: object, origin: str) -> None:
        if self._name_taken(name, origin):
            return
        try:
            self._pm.register(plugin, name=name)
            self._objects[name] = plugin
            self._pm.check_pending()  # a misspelt hook name is an error, not a silent no-op
            info = self._read_info(name)
        except Exception as e:
            if self._pm.has_plugin(name):
                self._pm.unregister(name=name)
            self._add_broken(name, origin, str(e))
            return
        self.available[name] = AvailablePlugin(name, origin, info)

    def _add_broken(self, name: str, origin: str, error: str) -> None:
        logger.warning("plugin %r (%s) is unusable: %s", name, origin, error)
        self.available[name] = AvailablePlugin(name, origin, None, error)

    def _impls(self, hook_name: str, plugin_name: str) -> list:
        return [i for i in getattr(self._pm.hook, hook_name).get_hookimpls() if i.plugin_name == plugin_name]

    def _read_info(self, name: str) -> PluginInfo:
        impls = self._impls("kvloom_plugin_info", name)
        if not impls:
            raise PluginError("it does not implement kvloom_plugin_info")
        info = impls[0].function()
        if not isinstance(info, PluginInfo):
            raise PluginError(f"kvloom_plugin_info returned {type(info).__name__}, not a PluginInfo")
        if info.kind not in KINDS:
            raise PluginError(f"its kind {info.kind!r} is not one of {list(KINDS)}")
        implemented = sorted(hook for hook in FACTORY_HOOKS.values() if self._impls(hook, name))
        if implemented != [FACTORY_HOOKS[info.kind]]:
            raise PluginError(f"a {info.kind} plugin implements {FACTORY_HOOKS[info.kind]} and no other "
                              f"factory hook; it implements {implemented or 'none'}")
        return info

    # --- choosing ----------------------------------------------------------------------------------
    def _select(self, names: list[str]) -> dict[str, str]:
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in self.available]
        if unknown:
            raise UnknownPluginError(f"unknown plugin{'s' if len(unknown) > 1 else ''} "
                                     f"{', '.join(map(repr, unknown))}; available plugins: {self._known()}")
        for name in names:
            plugin = self.available[name]
            if plugin.error:
                raise PluginError(f"plugin {name!r} ({plugin.origin}) cannot be used: {plugin.error}")
        chosen: dict[str, str] = {}
        for name in names:
            kind = self.available[name].info.kind
            if kind in chosen:
                raise PluginConflictError(f"plugins {chosen[kind]!r} and {name!r} are both {kind} plugins; "
                                          f"enable at most one {kind} plugin")
            chosen[kind] = name
        for kind, default in DEFAULTS.items():
            chosen.setdefault(kind, default)
        for name in chosen.values():
            for other, reason in self.available[name].info.conflicts.items():
                clash = chosen.get(other) if other in KINDS else other if other in chosen.values() else None
                if clash is not None and clash != name:
                    raise PluginConflictError(f"plugin {name!r} cannot run with {clash!r}: {reason}")
        return dict(sorted(chosen.items(), key=lambda kv: KINDS.index(kv[0])))

    def _known(self) -> str:
        return ", ".join(sorted(n for n, p in self.available.items() if p.error is None))

    def _resolve_options(self, given: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        resolved = {name: self.available[name].info.defaults() for name in self.enabled.values()}
        for name, values in given.items():
            if name not in self.available:
                raise UnknownPluginError(f"options are given for unknown plugin {name!r}; "
                                         f"available plugins: {self._known()}")
            if name not in resolved:
                logger.warning("options for plugin %r are ignored: it is not enabled", name)
                continue
            declared = {o.name: o for o in self.available[name].info.options}
            for key, value in values.items():
                if key not in declared:
                    raise PluginError(f"plugin {name!r} has no option {key!r}; its options: "
                                      f"{', '.join(sorted(declared)) or 'none'}")
                resolved[name][key] = _check_option(name, declared[key], value)
        return resolved

    def validate(self, config: EngineConfig) -> None:
        """Rules that need the config, or the engine: raise PluginConflictError / PluginError."""
        quantization = self.enabled.get("quantization")
        # fp8 quantizes dense weights at load, and GGUF weights are dense once dequantized
        if quantization and quantization != "fp8" and (config.load_format == "gguf" or config.model == DEFAULT_MODEL
                                                       or config.model.endswith(".gguf")):
            raise PluginConflictError(f"quantization plugin {quantization!r} cannot run with a GGUF model: "
                                      "GGUF weights are dequantized when they are loaded")
        spec = self.enabled.get("spec_decode")
        if spec is not None and config.tensor_parallel_size > 1:
            # The tensor-parallel workers replay rank 0's steps as plain decodes and prefills; a verify step's
            # rows and a draft model's forwards are not broadcast to them yet.
            raise PluginConflictError(f"plugin {spec!r} (spec_decode) cannot run with tensor_parallel_size="
                                      f"{config.tensor_parallel_size} yet: use one of them")

    # --- the typed facade over the factory hooks --------------------------------------------------
    def make_scheduler_policy(self, config: EngineConfig) -> SchedulingPolicy:
        return self._make("scheduler", config=config)

    def make_kv_allocator(self, num_blocks: int, config: EngineConfig) -> BlockAllocator:
        return self._make("kv_allocator", num_blocks=num_blocks, config=config)

    def make_prefix_cache(self, block_size: int, config: EngineConfig) -> PrefixCache | None:
        return self._make("prefix_cache", block_size=block_size, config=config)

    def make_quantization(self, hf_config: Any, config: EngineConfig) -> QuantizationMethod | None:
        """The method that loads the model's linear layers: the enabled quantization plugin's, or the
        built-in one the checkpoint's quantization_config names (None for a dense checkpoint). A built-in
        plugin that does not match the checkpoint is a ConfigError naming both."""
        from kvloom.core.model.quantization import resolve_quantization

        enabled = self.enabled.get("quantization")
        if enabled is None or enabled in BUILTIN_QUANTIZATIONS:
            name = resolve_quantization(enabled, hf_config, dummy=config.load_format == "dummy")
            if name is None:
                return None
            if enabled is None:
                self._enable(name)
        return self._make("quantization", hf_config=hf_config, config=config)

    def _enable(self, name: str) -> None:
        kind = self.available[name].info.kind
        if not self._pm.has_plugin(name):
            self._pm.register(self._objects[name], name=name)
        self.enabled[kind] = name
        self.options.setdefault(name, self.available[name].info.defaults())

    def make_spec_proposer(self, hf_config: Any, config: EngineConfig) -> DraftProposer | None:
        return self._make("spec_decode", hf_config=hf_config, config=config)

    def _make(self, kind: str, **kwargs: Any) -> Any:
        name = self.enabled.get(kind)
        if name is None:
            return None
        hook_name = FACTORY_HOOKS[kind]
        result = getattr(self._pm.hook, hook_name)(options=dict(self.options[name]), **kwargs)
        if result is None:
            raise PluginError(f"plugin {name!r} returned nothing from {hook_name}")
        return result

    # --- listing -----------------------------------------------------------------------------------
    def listing(self) -> list[dict[str, Any]]:
        """Every available plugin as a JSON-able row (what ``engine plugins`` prints)."""
        rows = []
        for name, plugin in sorted(self.available.items(), key=lambda kv: _listing_key(kv[1])):
            info = plugin.info
            values = self.options.get(name, {})
            rows.append({
                "name": name, "kind": info.kind if info else None, "origin": plugin.origin,
                "enabled": name in self.enabled.values(), "default": name in DEFAULTS.values(),
                "description": info.description if info else None, "error": plugin.error,
                "options": [{"name": o.name, "default": o.default, "help": o.help, "choices": list(o.choices),
                             **({"value": values[o.name]} if o.name in values else {})}
                            for o in (info.options if info else ())],
                "conflicts": dict(info.conflicts) if info else {},
            })
        return rows


def _builtin(entry: str) -> tuple[str, object]:
    """``(name, plugin)`` of a ``BUILTIN_PLUGINS`` entry."""
    module, _, attribute = entry.partition(":")
    plugin = importlib.import_module(module)
    if attribute:
        return attribute, getattr(plugin, attribute)
    return module.rsplit(".", 1)[1], plugin


def _listing_key(plugin: AvailablePlugin) -> tuple:
    kind = plugin.info.kind if plugin.info else None
    return (KINDS.index(kind) if kind else len(KINDS), plugin.name)


def _check_option(plugin: str, option: PluginOption, value: Any) -> Any:
    default = option.default
    where = f"option {option.name}={value!r} of plugin {plugin!r}"
    if option.choices and value not in option.choices:
        raise PluginError(f"{where} is not one of {list(option.choices)}")
    if default is None:
        return value
    if isinstance(value, bool) or isinstance(default, bool):  # bool is an int to Python, not to users
        ok = type(value) is type(default)
    elif isinstance(default, float) and isinstance(value, int):
        value, ok = float(value), True
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise PluginError(f"{where} must be a {type(default).__name__}")
    return value


def format_listing(rows: list[dict[str, Any]]) -> str:
    """``engine plugins`` as text: one line per plugin, then its options and conflicts, indented."""
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'NAME':<{width}}  {'KIND':<13} ORIGIN"]
    for r in rows:
        marks = ", ".join(m for m, on in (("enabled", r["enabled"]), ("default", r["default"])) if on)
        head = f"{r['name']:<{width}}  {(r['kind'] or 'broken'):<13} {r['origin']}"
        lines.append(head + (f"  [{marks}]" if marks else ""))
        lines.append(f"{'':<{width}}  {r['error'] and 'error: ' + r['error'] or r['description']}")
        for o in r["options"]:
            choices = f" (one of {o['choices']})" if o["choices"] else ""
            value = f" [set: {o['value']!r}]" if "value" in o and o["value"] != o["default"] else ""
            lines.append(f"{'':<{width}}    option {o['name']} = {o['default']!r}{value}: {o['help']}{choices}")
        for other, reason in r["conflicts"].items():
            lines.append(f"{'':<{width}}    conflicts with {other}: {reason}")
    return "\n".join(lines)
