"""Helpers shared by the test files (one copy each). Importable as ``helpers.<module>`` because
pytest puts tests/ on sys.path for tests/conftest.py."""
