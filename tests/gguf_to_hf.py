"""Convert a GGUF checkpoint into a plain Hugging Face directory (config, safetensors, tokenizer).

Run by the vLLM venv's python (tests/vllm_server.py): transformers reads the GGUF (with ``gguf`` and
``accelerate``, which the Makefile installs there) and dequantizes it to float32; the result is what
``vllm serve`` and transformers' own forward pass (the hidden-states reference) both load.

    python tests/gguf_to_hf.py GGUF_FILE OUT_DIR

Written into ``OUT_DIR.tmp`` and renamed, so an interrupted conversion never leaves a half directory.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized already: save them as plain float32, not as a GGUF-quantized model
    # (transformers refuses to serialise one).
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
