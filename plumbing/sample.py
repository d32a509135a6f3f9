"""Sampling: a continuation of a prompt from a trained model, whatever layout trained it.

    python3 05_3d_gpt.py --resume ckpt --sample "alice has 3 apples." --max-new-tokens 80 \
        --temperature 0.8 --top-k 40
    python3 05_3d_gpt.py --init-from model.pt --sample "3 plus 4 is"    # an exported state dict
    python3 05_3d_gpt.py --init-from gpt2-out --sample "15496 11"       # GPT-2 ids, no tiktoken

The checkpoint's shards are joined into the serial GPT-2 (tp=1 of 01), which samples on one
process, on a GPU if there is one. The generator is seeded with --seed, so a command repeats its
output. Each token is printed as it is drawn, and Ctrl-C stops with the text so far. How the
prompt is read and the output written follows the data the model was trained on:
    bytes   the built-in corpus, a text file, a byte-level .bin: text in (the bytes of the command
            line as given, UTF-8 or not) and UTF-8 text out
    gpt2    a GPT-2 BPE .bin, or GPT-2's own weights: UTF-8 text through tiktoken if it is
            installed, else token ids written as numbers
    ids     a .bin without a sidecar: token ids written as numbers (0-9), in and out
"""
import codecs
import importlib
import re
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plumbing.checkpoint import hold, latest_checkpoint, only_gpt2, read_checkpoint
from plumbing.checks import check_model_flags
from plumbing.gpt2 import import_gpt2
from plumbing.launch import Interrupted
from plumbing.tokenizer import gpt2_bpe

tensor_parallel = importlib.import_module("01_tensor_parallel")

TOKEN_ID = re.compile(r"[0-9]+")  # ASCII digits only: int() would also read "٣", "+3" and "1_0"


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


def _utf8(prompt):
    """The prompt as UTF-8 text, or a ValueError naming the first byte that is not. Python reads a
    command line's undecodable bytes as lone surrogates (surrogateescape); they are those bytes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = prompt.encode("utf-8", "surrogateescape")
        at = len(prompt[:e.start].encode("utf-8", "surrogateescape"))
        raise ValueError(f"--sample: the prompt is not UTF-8 text (byte {at} is 0x{raw[at]:02x}); this model reads "
                         f"text or numbers, so give the prompt in UTF-8") from None
    return prompt


def encode(prompt, kind, vocab_size):
    """The prompt as token ids, refusing what the model cannot read; names --sample."""
    if not prompt:
        raise ValueError("--sample: the prompt is empty; give the text to continue, e.g. --sample \"alice has\"")
    bpe = gpt2_bpe() if kind == "gpt2" else None
    if kind == "bytes":  # the bytes as given: a byte-level model reads any, UTF-8 or not
        ids = list(prompt.encode("utf-8", "surrogateescape"))
    elif bpe is not None:
        ids = bpe.encode_ordinary(_utf8(prompt))
    else:
        words = _utf8(prompt).split()
        hint = " (pip install tiktoken to write GPT-2 text instead)" if kind == "gpt2" else ""
        if not words:
            raise ValueError(f"--sample: the prompt holds no token ids, only whitespace; this model reads token "
                             f"ids, written as numbers separated by spaces{hint}")
        bad = next((w for w in words if not TOKEN_ID.fullmatch(w)), None)
        if bad is not None:
            raise ValueError(f"--sample: this model reads token ids, written as numbers separated by spaces (the "
                             f"digits 0-9){hint}; got {bad!r} in {prompt!r}")
        ids = [int(w) for w in words]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        what = f"byte {bad[0]} ({bytes([bad[0]])!r})" if kind == "bytes" else f"token id {bad[0]}"
        raise ValueError(f"--sample: the prompt holds {what}, outside the model's vocabulary of "
                         f"{vocab_size} tokens")
    return ids


class Decoder:
    """Token ids to text a piece at a time, as they are drawn; joined, the pieces are decode(ids)."""

    def __init__(self, kind):
        self.kind, self.bpe, self.first = kind, gpt2_bpe() if kind == "gpt2" else None, True
        self.single = getattr(self.bpe, "decode_single_token_bytes", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def streams(self):
        return self.kind == "bytes" or self.kind == "ids" or self.bpe is None or self.single is not None

    def piece(self, ids, final=False):
        if self.kind == "bytes":
            return self.utf8.decode(bytes(ids), final)
        if self.bpe is not None:
            return self.utf8.decode(b"".join(self.single(t) for t in ids), final)
        text = ("" if self.first else " ") + " ".join(str(t) for t in ids) if ids else ""
        self.first = self.first and not ids
        return text


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
def tokens(model, idx, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """Each of max_new_tokens next tokens, (B, 1), drawn from the model's distribution given at
    most the last block_size tokens of idx (B, T0) and those drawn before; top_k=1 is greedy.
    In float64, the largest logit subtracted before dividing by the temperature: any positive
    temperature is then finite, a tiny one is greedy decoding and a huge one uniform."""
    model.eval()
    V = model.cfg.vocab_size
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.cfg.block_size:])  # (B, T, V): the serial model, tp=1
        logits = logits[:, -1, :V].double()  # (B, V), the next token only
        logits = (logits - logits.max(-1, keepdim=True).values) / temperature  # <= 0, the best 0
        if top_k:
            kth = torch.topk(logits, top_k).values[:, -1:]  # (B, 1): the k-th largest
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
        yield nxt


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """idx (B, T0) followed by max_new_tokens tokens drawn as tokens() draws them."""
    return torch.cat([idx, *tokens(model, idx, max_new_tokens, temperature, top_k, generator)], dim=1)


def run(model, sc, kind, seed, say=print, out=None):
    """Encode --sample, generate, and print the prompt with its continuation as it is drawn."""
    out = out or sys.stdout
    device = next(model.parameters()).device
    ids = encode(sc.sample, kind, model.cfg.vocab_size)
    check(sc, len(ids), model.cfg.block_size, model.cfg.vocab_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    say(f"sampling {sc.max_new_tokens} tokens (temperature {sc.temperature:g}, "
        f"top-k {sc.top_k or 'all'}, seed {seed}, {kind} tokens):")
    text, drawn = Decoder(kind), list(ids)
    stream = text.streams()
    if stream:
        out.write(text.piece(ids))
        out.flush()
    try:
        for nxt in tokens(model, torch.tensor([ids], device=device), sc.max_new_tokens, sc.temperature, sc.top_k, gen):
            drawn.append(int(nxt))
            if stream:
                out.write(text.piece(drawn[-1:]))
                out.flush()
    except KeyboardInterrupt:
        out.write((text.piece([], final=True) if stream else decode(drawn, kind)) + "\n")
        raise Interrupted(f"interrupted after {len(drawn) - len(ids)} of {sc.max_new_tokens} new tokens") from None
    out.write((text.piece([], final=True) if stream else decode(drawn, kind)) + "\n")
    out.flush()
    return drawn


def from_weights(cfg, tc, sc, given=()):
    """05's --sample: load the weights of --resume (any layout) or --init-from into the serial
    GPT-2 and print a continuation of the prompt. Nothing is launched: one process samples. given:
    the flags on the command line; model flags among them must agree with the weights' own model."""
    if tc.resume:
        path = latest_checkpoint(tc.resume, flag="--resume")
        path = hold(path) if path else path  # read under a shared lock: another run's --keep leaves it
        if not path:
            raise ValueError(f"--resume {tc.resume!r} holds no complete checkpoint to sample from")
        only_gpt2(path, "--sample")  # 01's serial GPT-2 samples: it has no experts
        manifest, full, _ = read_checkpoint(path)
        weights_cfg = tensor_parallel.GPTConfig(**manifest["model"])
        check_model_flags(given, cfg, weights_cfg, f"the checkpoint {path}")
        cfg = weights_cfg
        kind = manifest.get("tokenizer") or tokenizer_kind(cfg.vocab_size)
        print(f"sampling from step {manifest['step']} of {path}")
    elif tc.init_from:
        imported, full, kind = import_gpt2(tc.init_from, cfg)
        if imported:  # a .pt without a recorded config: the model flags describe it (import_gpt2 checked)
            check_model_flags(given, cfg, imported, tc.init_from)
            cfg = imported
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
