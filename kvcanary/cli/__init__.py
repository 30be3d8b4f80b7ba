"""``python -m kvcanary``'s commands: ``doctor`` and ``demo``."""
