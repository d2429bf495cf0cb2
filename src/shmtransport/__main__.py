import sys

from .cli import main

if __name__ == "__main__":  # vLLM's engine processes re-import the main module when they spawn
    sys.exit(main())
