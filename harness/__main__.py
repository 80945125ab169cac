"""Entry point of ``python -m harness``."""

from harness.cli import entry

if __name__ == "__main__":
    entry()
