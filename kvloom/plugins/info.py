"""What a plugin says about itself (``kvloom_plugin_info``): its kind, description, options and conflicts.
``engine plugins`` lists exactly this; the plugin manager validates enabled plugins and options against it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# The kinds of plugin; at most one plugin of each kind is active.
KINDS = ("scheduler", "kv_allocator", "prefix_cache", "quantization", "spec_decode")


@dataclass(frozen=True)
class PluginOption:
    """One option of a plugin, set in the config file as ``[plugins.NAME] KEY = VALUE``. The value must
    have the type of ``default`` (an int is accepted for a float); ``choices``, when given, are the only
    values allowed."""

    name: str
    default: Any
    help: str
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PluginInfo:
    """A plugin's description of itself.

    ``conflicts`` maps the name of another plugin, or a kind (meaning any plugin of that kind, which
    includes the built-in ``prefix_cache``), to the reason the two cannot run together; enabling both
    fails at start-up with that reason.
    """

    kind: str
    description: str
    options: tuple[PluginOption, ...] = ()
    conflicts: Mapping[str, str] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}
