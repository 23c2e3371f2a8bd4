"""The package version: its one definition (pyproject.toml reads it)."""
__version__ = "0.2.0"
