"""Defaults every layer may read (the commands show them in their help; the stores fall back to them)."""

DEFAULT_STORAGE = "sqlite:///results/autotune.db"
"""Where studies and profiles live unless ``--storage`` says otherwise (one SQLite file)."""
