"""kvcanary's benchmark suite (pytest-benchmark); see perf/README.md."""
