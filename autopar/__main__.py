"""`python -m autopar`: the `autopar` command."""
import sys

from .cli import main

sys.exit(main())
