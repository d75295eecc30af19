"""The built-in plugins, ordinary plugins registered by name (kvloom.plugins.manager.BUILTIN_PLUGINS): a module each,
and the quantization formats' plugin objects in ``quantization``."""
