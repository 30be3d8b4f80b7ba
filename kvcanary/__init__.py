"""kvcanary: a KV-cache canary for LLM serving engines (placeholder during bring-up)."""
__version__ = "0.1.0"
