"""Developer tools (not shipped in the product packages): run with ``python -m tools.<name>``."""
