"""The CPU reference: the executable spec of every kernel (docs/format.md), on numpy arrays."""
