"""Sampling: a continuation of a prompt from a trained model, whatever layout trained it.

    python3 05_3d_gpt.py --resume ckpt --sample "alice has 3 apples." --max-new-tokens 80 \
        --temperature 0.8 --top-k 40
    python3 05_3d_gpt.py --init-from model.pt --sample "3 plus 4 is"    # an exported state dict
    python3 05_3d_gpt.py --init-from gpt2-out --sample "15496 11"       # GPT-2 ids, no tiktoken

The checkpoint's shards are joined into the serial GPT-2 (tp=1 of 01), which samples on one
process, on a GPU if there is one. The generator is seeded with --seed, so a command repeats its
output. How the prompt is read and the output written follows the data the model was trained on:
    bytes   the built-in corpus, a text file, a byte-level .bin: UTF-8 text in and out
    gpt2    a GPT-2 BPE .bin, or GPT-2's own weights: text through tiktoken if it is installed,
            else token ids written as numbers
    ids     a .bin without a sidecar: token ids written as numbers, in and out
"""
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plumbing.checkpoint import latest_checkpoint, read_checkpoint
from plumbing.tokenizer import gpt2_bpe
from plumbing.gpt2 import import_gpt2

tensor_parallel = importlib.import_module("01_tensor_parallel")


@dataclass
class SampleConfig:
    sample: str | None = None  # print a continuation of this prompt and exit (needs --resume or --init-from)
    max_new_tokens: int = 100  # tokens to generate after the prompt
    temperature: float = 1.0  # logits are divided by it before sampling; > 0 (greedy: --top-k 1)
    top_k: int = 0  # sample among the k likeliest next tokens only (0: all of them, 1: greedy)


def tokenizer_kind(vocab_size):
    """The tokenizer of weights that record none (a GPT-2 directory): bytes for V <= 256, GPT-2
    BPE for GPT-2's vocabulary (50257, or 50304 padded), else plain ids."""
    if vocab_size <= 256:
        return "bytes"
    return "gpt2" if vocab_size in (50257, 50304) else "ids"


def encode(prompt, kind, vocab_size):
    """The prompt as token ids, refusing what the model cannot read; names --sample."""
    if not prompt:
        raise ValueError("--sample: the prompt is empty; give the text to continue, e.g. --sample \"alice has\"")
    bpe = gpt2_bpe() if kind == "gpt2" else None
    if kind == "bytes":
        ids = list(prompt.encode("utf-8"))
    elif bpe is not None:
        ids = bpe.encode_ordinary(prompt)
    else:
        try:
            ids = [int(tok) for tok in prompt.split()]
        except ValueError:
            hint = " (pip install tiktoken to write GPT-2 text instead)" if kind == "gpt2" else ""
            raise ValueError(f"--sample: this model reads token ids, written as numbers separated by "
                             f"spaces{hint}; got {prompt!r}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        what = f"byte {bad[0]} ({bytes([bad[0]])!r})" if kind == "bytes" else f"token id {bad[0]}"
        raise ValueError(f"--sample: the prompt holds {what}, outside the model's vocabulary of "
                         f"{vocab_size} tokens")
    return ids


def decode(ids, kind):
    """Text for bytes (invalid UTF-8 shown as U+FFFD) and for GPT-2 ids with tiktoken; else ids."""
    bpe = gpt2_bpe() if kind == "gpt2" else None
    if kind == "bytes":
        return bytes(ids).decode("utf-8", errors="replace")
    if bpe is not None:
        return bpe.decode(ids)
    return " ".join(str(t) for t in ids)


def check(sc, n_prompt, block_size, vocab_size):
    """Refuse settings that cannot sample, naming the flag, the value and the limit."""
    if n_prompt > block_size:
        raise ValueError(f"--sample: the prompt is {n_prompt} tokens, longer than the model's "
                         f"block_size={block_size}")
    if sc.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {sc.max_new_tokens}")
    if not sc.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {sc.temperature} (for greedy decoding use "
                         f"--top-k 1)")
    if not 0 <= sc.top_k <= vocab_size:
        raise ValueError(f"--top-k must be between 0 (all tokens) and the vocabulary size "
                         f"{vocab_size}, got {sc.top_k}")


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """idx (B, T0) followed by max_new_tokens tokens, each drawn from the model's distribution for
    the next token given at most the last block_size tokens; top_k=1 is greedy decoding."""
    model.eval()
    V = model.cfg.vocab_size
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.cfg.block_size:])  # (B, T, V): the serial model, tp=1
        logits = logits[:, -1, :V].float() / temperature  # (B, V), the next token only
        if top_k:
            kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1): the k-th largest
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def run(model, sc, kind, seed, say=print):
    """Encode --sample, generate, and print the prompt with its continuation."""
    device = next(model.parameters()).device
    ids = encode(sc.sample, kind, model.cfg.vocab_size)
    check(sc, len(ids), model.cfg.block_size, model.cfg.vocab_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = generate(model, torch.tensor([ids], device=device), sc.max_new_tokens, sc.temperature,
                   sc.top_k, gen)[0].tolist()
    say(f"sampling {sc.max_new_tokens} tokens (temperature {sc.temperature:g}, "
        f"top-k {sc.top_k or 'all'}, seed {seed}, {kind} tokens):")
    say(decode(out, kind))
    return out


def from_weights(cfg, tc, sc):
    """05's --sample: load the weights of --resume (any layout) or --init-from into the serial
    GPT-2 and print a continuation of the prompt. Nothing is launched: one process samples."""
    if tc.resume:
        path = latest_checkpoint(tc.resume)
        if not path:
            raise ValueError(f"--resume {tc.resume!r} holds no complete checkpoint to sample from")
        manifest, full, _ = read_checkpoint(path)
        cfg = tensor_parallel.GPTConfig(**manifest["model"])
        kind = manifest.get("tokenizer") or tokenizer_kind(cfg.vocab_size)
        print(f"sampling from step {manifest['step']} of {path}")
    elif tc.init_from:
        imported, full, kind = import_gpt2(tc.init_from)
        cfg = imported or cfg  # a .pt without a recorded config: the model flags describe it
        kind = kind or tokenizer_kind(cfg.vocab_size)
        print(f"sampling from {tc.init_from}")
    else:
        raise ValueError("--sample needs weights: --resume DIR (a checkpoint) or --init-from PATH "
                         "(an exported .pt or a GPT-2 directory)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tensor_parallel.GPT(cfg, None, init=False, device=device)
    model.load_full_state_dict({k: v.float() for k, v in full.items()})
    run(model, sc, kind, tc.seed)
    return True
