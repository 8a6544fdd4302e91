"""autotune: find the fastest parallel layout to train an LLM on a real, possibly mixed, cluster."""

__version__ = "0.1.0"
