"""Micro-profilers behind `autotune profile`: compute (GEMM, attention, memory), links (p2p matrix,
collectives), their timing discipline, emulated slowdown, and the profile store.

Import order matters for start-up time: ``store`` and ``emulation`` import no torch, so the planning
half (``device_spec_from_profile``) stays light.
"""
