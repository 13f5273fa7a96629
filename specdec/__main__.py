"""`python -m specdec ...` is the `specdec` command."""
from .cli import main

main()
