"""The built-in plugins, ordinary plugins registered by module name (kvloom.plugins.manager.BUILTIN_PLUGINS)."""
