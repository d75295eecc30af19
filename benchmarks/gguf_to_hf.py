"""Export SmolLM2-135M-Instruct (kvloom's built-in model, a GGUF file) as a Hugging Face folder
(config.json + safetensors + tokenizer), for peers that do not read GGUF (vLLM's CPU build). The
weights are dequantized by transformers' GGUF loader and stored in --dtype; kvloom serves the same
folder, so both engines run the same weights.

    python benchmarks/gguf_to_hf.py [FOLDER] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_FOLDER = Path.home() / ".cache" / "kvloom" / "SmolLM2-135M-Instruct-hf"


def export(folder: Path, dtype_name: str = "bfloat16", gguf: str | None = None) -> Path:
    """Write the folder once; an existing export (config.json and safetensors present) is kept."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    from kvloom.core.model.files import default_model_path
    from kvloom.frontends.text import load_tokenizer

    path = Path(gguf) if gguf else default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype_name))
    # The loader marks the model as GGUF-quantized, which save_pretrained refuses; the tensors it holds
    # are already dequantized, so they are saved as plain ones.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    load_tokenizer(str(path)).save_pretrained(str(folder))
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=str(DEFAULT_FOLDER))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--gguf", help="The GGUF file (default: kvloom's SmolLM2-135M-Instruct).")
    args = p.parse_args()
    folder = export(Path(args.folder), args.dtype, args.gguf)
    print(f"{folder}: " + ", ".join(sorted(f.name for f in folder.iterdir())))


if __name__ == "__main__":
    main()
