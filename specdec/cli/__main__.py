"""`python -m specdec.cli ...` is the `specdec` command."""
from . import main

main()
