"""Built-in plugins (registered by :mod:`failslow.plugins` in every plugin manager)."""
