"""How far each engine's next-token distribution is from the float model's: llama.cpp's and ours.

Perplexity alone hides a quantized engine's errors (they may raise it or lower it); the KL
divergence of its distribution from the float model's, averaged over a text's positions, does
not. The float model is the file's own weights dequantized, so the measure is of the engine's
arithmetic on those weights (how it rounds activations, which kernels, which dtype), not of the
quantization both engines share:

- llama.cpp's, as its users measure it: `llama-perplexity` on the file's F32 float reference
  (bench.llama_cpp.float_reference) writes the reference's log-probabilities
  (--kl-divergence-base), then runs the quantized file against them (--kl-divergence); its
  "Mean KLD" and both perplexities are parsed from what it prints;
- Storyteller's: our continuous engine, in process, on the same tokens (read back from
  llama-perplexity's base file, so both see the same text, chunked the same way: chunks of 512,
  the first token BOS where llama.cpp adds one, the second half of each chunk scored),
  once with the worker's default settings on the quantized file (bf16 here, whatever kernels it
  picks) and once as its float reference: the same file in float32 with the dense product
  (--small-kernel dense), which dequantizes every matrix. KL(reference || default) over the full
  vocabulary at every scored position, and each one's perplexity.

The text is the repository's README.md (English prose, ~3,000 tokens; its sha256 goes into the
JSON, as the README changes over time).

    python -m bench.kl_divergence                                   # SmolLM2-135M Q4_K_M and Q4_1
    python -m bench.kl_divergence --files smollm2-1.7b qwen2.5-1.5b
    python -m bench.kl_divergence --files my.Q4_K_M.gguf --text docs/serving.md
    python -m bench.kl_divergence --files smollm2-135m-q4_1 --variants float32:auto bfloat16:dense

Prints a table and merges its rows into docs/results/kl-divergence.json (a row per file).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench import llama_cpp
from bench.report import cell, write_json
from bench.row_kernels import cpu_name

CONTEXT = 512  # tokens per chunk, llama-perplexity's -c
THREADS = 2
TEXT = Path(__file__).resolve().parent.parent / "README.md"
OUT = Path("docs/results/kl-divergence.json")
PACKAGED = "smollm2-135m-q4_1"  # the packaged file itself, as it ships
NAMES = (PACKAGED, *llama_cpp.SHAPE_NAMES)


def resolve(name: str) -> Path:
    """A --files entry: a path, the packaged Q4_1 file, or a shape of bench.llama_cpp (its Q4_K_M)."""
    if name == PACKAGED:
        from worker.model_loader import PACKAGED_FILE, packaged_model_dir
        return Path(packaged_model_dir()) / PACKAGED_FILE
    if name in llama_cpp.SHAPE_NAMES:
        return llama_cpp.model_file(name)
    return Path(name)


# --- llama.cpp ----------------------------------------------------------------------------------

def _perplexity(args: list[str]) -> str:
    """llama-perplexity's printout (it logs to stderr); RuntimeError with its tail if it fails."""
    command = [str(llama_cpp.llama_perplexity()), "-c", str(CONTEXT), "-t", str(THREADS), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no {pattern!r}:\n{text[-2000:]}")
    return float(found.group(1))


def llama_cpp_kld(quantized: Path, reference: Path, text: Path, base: Path, chunks: int) -> dict:
    """llama.cpp's mean KLD of `quantized` from `reference` on `text`, and both perplexities; the
    reference's log-probabilities (and the tokens) are left in `base`."""
    limit = ["--chunks", str(chunks)] if chunks else []
    printed = _perplexity(["-m", str(reference), "-f", str(text), "--kl-divergence-base", str(base), *limit])
    ppl_ref = _number(r"Final estimate: PPL = ([\d.]+)", printed)
    printed = _perplexity(["-m", str(quantized), "--kl-divergence-base", str(base), "--kl-divergence"])
    return {"kld": _number(r"Mean\s+KLD:\s+([-\d.]+)", printed), "ppl_ref": ppl_ref,
            "ppl_quant": _number(r"Mean PPL\(Q\)\s+:\s+([\d.]+)", printed),
            # The reference's again, as the --kl-divergence run reports it: from the base file's
            # log-probabilities, stored in 16 bits each, so a little off the first run's.
            "ppl_ref_stored": _number(r"Mean PPL\(base\)\s+:\s+([\d.]+)", printed)}


def base_tokens(base: Path) -> tuple[int, list[list[int]]]:
    """(n_ctx, the chunks' tokens) from a --kl-divergence-base file: "_logits_", n_ctx (u32),
    n_vocab and n_chunk (i32), then n_ctx * n_chunk token ids (i32), then the log-probabilities."""
    with open(base, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{base}: not a llama-perplexity --kl-divergence-base file")
        n_ctx, _, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        tokens = np.frombuffer(f.read(4 * int(n_ctx) * int(n_chunk)), dtype=np.int32)
    return int(n_ctx), tokens.reshape(int(n_chunk), int(n_ctx)).tolist()


def with_bos(path: Path, chunks: list[list[int]]) -> tuple[list[list[int]], bool]:
    """The chunks as llama-perplexity runs them: where its tokenizer put BOS before the text (the
    file's own rule, which llama.cpp decides from its metadata and pre-tokenizer), every chunk's
    first token is replaced by BOS; and whether it did."""
    from worker.continuous.gguf_reader import _read_header
    bos = _read_header(str(path))[1].get("tokenizer.ggml.bos_token_id")
    if bos is None or chunks[0][0] != bos:
        return chunks, False
    return [[bos, *chunk[1:]] for chunk in chunks], True


# --- Storyteller ----------------------------------------------------------------------------------

class Recording:
    """The engine's model, recording the hidden state of every position it computes: the engine
    computes logits only for the last position of a prompt, and this wants them all. Everything
    else is the model's own, so the positions go through the very path a prompt does when served."""

    def __init__(self, model):
        self.model, self.hidden = model, {}

    def forward(self, ids, positions, cache, step):
        hidden = self.model.forward(ids, positions, cache, step)
        for position, row in zip(positions.tolist(), hidden):
            self.hidden[position] = row.clone()
        return hidden

    def __getattr__(self, name):
        return getattr(self.model, name)


def engine(path: Path, dtype: str, small_kernel: str):
    """The continuous engine on `path` as the worker builds it (worker.__main__.make_engine), with
    these settings and the defaults for the rest; prefix caching off, as positions found in the
    cache would not be computed (and so not scored) again."""
    from shared.settings import Settings
    from worker import model_loader
    from worker.__main__ import make_engine
    settings = Settings(model=str(path), dtype=dtype, small_kernel=small_kernel, prefix_caching=False)
    loaded = model_loader.load(settings.model, "", settings.dtype, settings.device, transformers_model=False,
                               cache_dir=settings.cache_dir)
    built, _ = make_engine(settings, loaded)
    if built.name != "continuous":
        raise RuntimeError(f"{path}: the continuous engine cannot run it")
    return built


@torch.inference_mode()
def chunk_log_probs(built, tokens: list[int]) -> torch.Tensor:
    """The log-softmax over the vocabulary (float32) at positions len/2 .. len-2 of `tokens`, run
    as one prompt through the engine: the positions llama-perplexity scores."""
    from shared.protocol import Job, SamplingParams
    runner = built.runner
    recording = runner.model = Recording(runner.model)
    try:
        built.add(Job(id="kl", model="kl", prompt_ids=tokens, params=SamplingParams(max_tokens=1, temperature=0),
                      timeout_s=3600))
        while built.busy:
            built.step()
    finally:
        runner.model = recording.model
    first = len(tokens) // 2
    hidden = torch.stack([recording.hidden[p] for p in range(first, len(tokens) - 1)])
    return torch.log_softmax(recording.model.logits(hidden).float(), dim=-1)


def storyteller_log_probs(path: Path, chunks: list[list[int]], dtype: str, small_kernel: str):
    """Each chunk's scored log-probabilities (a tensor per chunk) and the engine's numerics."""
    built = engine(path, dtype, small_kernel)
    out = [chunk_log_probs(built, chunk) for chunk in chunks]
    numerics = built.numerics
    del built
    gc.collect()
    return out, numerics


def perplexity(log_probs: list[torch.Tensor], chunks: list[list[int]]) -> float:
    """exp of the mean negative log-probability of the token that follows each scored position."""
    total, count = 0.0, 0
    for lp, chunk in zip(log_probs, chunks):
        first = len(chunk) // 2
        following = torch.tensor(chunk[first + 1:])
        total -= lp.double().gather(1, following[:, None]).sum().item()
        count += len(following)
    return math.exp(total / count)


def mean_kld(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """KL(reference || other) at each scored position, averaged (nats), in float64."""
    total, count = 0.0, 0
    for ref, lp in zip(reference, other):
        ref, lp = ref.double(), lp.double()
        total += (ref.exp() * (ref - lp)).sum().item()
        count += ref.shape[0]
    return total / count


def storyteller_kld(path: Path, chunks: list[list[int]], variants: list[str] = ()) -> dict:
    """Our KL from our float reference with the worker's defaults, and with each of `variants`
    ("DTYPE:KERNEL", e.g. float32:auto, bfloat16:dense): which of the dtype and the kernel makes
    the difference."""
    reference, ref_numerics = storyteller_log_probs(path, chunks, "float32", "dense")
    default, numerics = storyteller_log_probs(path, chunks, "auto", "auto")
    result = {"kld": mean_kld(reference, default), "ppl_ref": perplexity(reference, chunks),
              "ppl_quant": perplexity(default, chunks), "numerics": numerics, "ref_numerics": ref_numerics}
    del default
    for variant in variants:
        dtype, _, kernel = variant.partition(":")
        log_probs, numerics = storyteller_log_probs(path, chunks, dtype, kernel or "auto")
        result.setdefault("variants", {})[variant] = {
            "kld": mean_kld(reference, log_probs), "ppl": perplexity(log_probs, chunks), "numerics": numerics}
        print(f"storyteller {variant}: KLD {result['variants'][variant]['kld']:.6f}, "
              f"PPL {result['variants'][variant]['ppl']:.4f} ({numerics})", flush=True)
    return result


# --- the table -----------------------------------------------------------------------------------

def measure(name: str, text: Path, chunks: int, variants: list[str] = ()) -> dict:
    path = resolve(name)
    reference = llama_cpp.float_reference(path)
    print(f"== {path.name} (float reference: {reference.name})", flush=True)
    with tempfile.TemporaryDirectory(dir=llama_cpp.BENCH_FILES) as tmp:
        base = Path(tmp) / "base.bin"
        ours_llama = llama_cpp_kld(path, reference, text, base, chunks)
        print(f"llama.cpp: KLD {ours_llama['kld']:.6f}, PPL {ours_llama['ppl_ref']:.4f} ref / "
              f"{ours_llama['ppl_quant']:.4f} quantized", flush=True)
        n_ctx, tokens = base_tokens(base)
    tokens, bos = with_bos(path, tokens)
    ours = storyteller_kld(path, tokens, variants)
    print(f"storyteller: KLD {ours['kld']:.6f}, PPL {ours['ppl_ref']:.4f} ref / {ours['ppl_quant']:.4f} "
          f"default ({ours['numerics']})", flush=True)
    return {"file": path.name, "reference": reference.name, "chunks": len(tokens), "n_ctx": n_ctx,
            "scored_positions": len(tokens) * (n_ctx - 1 - n_ctx // 2), "add_bos": bos,
            "llama_cpp": ours_llama, "storyteller": ours}


def print_table(rows: list[dict]) -> None:
    header = ("file", "llama.cpp KL", "storyteller KL", "llama ppl ref/quant", "storyteller ppl ref/default")
    lines = [header] + [(r["file"], cell(r["llama_cpp"]["kld"], ".6f"), cell(r["storyteller"]["kld"], ".6f"),
                         f"{r['llama_cpp']['ppl_ref']:.3f} / {r['llama_cpp']['ppl_quant']:.3f}",
                         f"{r['storyteller']['ppl_ref']:.3f} / {r['storyteller']['ppl_quant']:.3f}")
                        for r in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    print()
    for line in lines:
        print("  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(line, widths))))


def merged(path: Path, rows: list[dict], text: dict) -> dict:
    """The JSON with these rows in place of earlier ones of the same file and text."""
    import json
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    keep = [r for r in earlier if (r["file"], r.get("text", {}).get("sha256")) not in
            {(row["file"], text["sha256"]) for row in rows}]
    return {"machine": {"cpu": cpu_name(), "threads": THREADS}, "rows": keep + [dict(r, text=text) for r in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="+", default=["smollm2-135m", PACKAGED],
                    help=f"GGUF files, or names: {', '.join(NAMES)} (a shape: its Q4_K_M file)")
    ap.add_argument("--text", type=Path, default=TEXT, help="the text (default: the repository's README.md)")
    ap.add_argument("--chunks", type=int, default=0, help=f"at most this many chunks of {CONTEXT} (0: all)")
    ap.add_argument("--variants", nargs="*", default=[], metavar="DTYPE:KERNEL",
                    help="more Storyteller settings to measure against its float reference "
                         "(e.g. float32:auto bfloat16:dense; KERNEL is --small-kernel's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    raw = args.text.read_bytes()
    text = {"path": str(args.text.resolve().relative_to(Path.cwd().resolve()))
            if args.text.resolve().is_relative_to(Path.cwd().resolve()) else str(args.text),
            "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    llama_cpp.BENCH_FILES.mkdir(parents=True, exist_ok=True)
    rows = [measure(name, args.text, args.chunks, args.variants) for name in args.files]
    print_table(rows)
    write_json(args.out, merged(args.out, rows, text))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
