"""Entry point of ``python -m pyddp.bench``."""

from pyddp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
