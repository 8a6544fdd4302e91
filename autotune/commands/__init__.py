"""One module per CLI command; ``autotune.cli`` registers them. Rich output lives only here and in
``autotune.dashboard``; the library modules return plain data."""
