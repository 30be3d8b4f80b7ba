"""The package version (one place: pyproject.toml reads it, the compile cache keys on it)."""

__version__ = "0.1.0"
