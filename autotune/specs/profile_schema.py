"""The version of the profile store's tables and export documents, in a module of its own: both the
tables (``profile_tables.py``, SQLAlchemy's ORM) and their readers (``profiles.py``, imported by the
cost model on every search without SQLAlchemy) take it from here."""

SCHEMA_VERSION = 1
