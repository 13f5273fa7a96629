"""`python -m specdec.zoo` trains the zoo (same as `specdec zoo train`)."""
import argparse
from pathlib import Path

from .train import ARCHS, train_all

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m specdec.zoo")
    ap.add_argument("--work", type=Path, default=Path("zoo_work"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=list(ARCHS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every model's token budget")
    a = ap.parse_args()
    train_all(a.work, a.out, a.seed, a.threads, a.only, a.scale)
