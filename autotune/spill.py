"""Moved to autotune/search/spill.py (the search's persistence); this name is kept for old imports."""

from autotune.search.spill import Spill, recover, spill_dir, trial_from_json, trial_to_json

__all__ = ["Spill", "recover", "spill_dir", "trial_from_json", "trial_to_json"]
