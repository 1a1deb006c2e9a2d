"""Models for the `autopar` command line (docs/cli.md): `autopar plan my_models:small ...`."""
import torch

from models import GPT


def small():
    """A 2-layer GPT (hidden 256, 8 heads, vocab 512) and a batch of 16 sequences of 64 tokens."""
    torch.manual_seed(0)
    model = GPT(vocab=512, seq=64, hidden=256, heads=8, layers=2)
    return model, (torch.randint(0, 512, (16, 64)), torch.randint(0, 512, (16, 64)))
