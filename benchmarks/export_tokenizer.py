"""Write SmolLM2's tokenizer (from its GGUF file) as a small Hugging Face tokenizer folder, to take along
to a machine that has no copy of the model: `benchmarks/serve_gpu.sh` serves dummy weights of a large
shape with this vocabulary (49,152 tokens). Usage: python benchmarks/export_tokenizer.py [DIR]"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvloom.core.config import DEFAULT_MODEL
from kvloom.frontends.text import load_tokenizer

SMOLLM2_VOCAB = 49152


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder", nargs="?", default=".smollm2-tokenizer", help="Where to write it (git-ignored default).")
    args = p.parse_args()
    tok = load_tokenizer(DEFAULT_MODEL)
    if len(tok) != SMOLLM2_VOCAB:
        raise SystemExit(f"{DEFAULT_MODEL}'s tokenizer has {len(tok)} tokens, not {SMOLLM2_VOCAB}")
    folder = Path(args.folder)
    tok.save_pretrained(str(folder))
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size / 2**20:.1f} MiB, {len(tok)} tokens)")


if __name__ == "__main__":
    main()
