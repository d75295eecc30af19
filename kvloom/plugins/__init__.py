"""kvloom plugins (pluggy, project ``kvloom``). A plugin is a module or object with ``@hookimpl`` functions
named after the specifications in ``kvloom.plugins.hookspecs``; docs/plugins.md shows how to write one."""

import pluggy

_PROJECT = "kvloom"

hookimpl = pluggy.HookimplMarker(_PROJECT)

__all__ = ["hookimpl"]
