"""How token ids decode, with nothing heavier than the standard library (scripts/prepare_data.py
imports it without torch): GPT-2's BPE when the optional tiktoken package is installed, and which
tokenizer a data file's sidecar names.

    gpt2_bpe()              tiktoken's GPT-2 encoding, or None
    tokenizer_of(path)      "bytes", "gpt2" or "ids" for --data PATH
    read_sidecar(path)      a .bin's sidecar JSON, checked field by field, or None if it has none
"""
import json
import os

TOKENIZERS = ("bytes", "gpt2", "ids")  # how a model's token ids decode (plumbing/sample.py)
SIDECAR_TOKENIZERS = {"bytes": 256, "gpt2": 50257}  # what prepare_data.py writes, and its vocabulary
FORMAT = "uint16-le token ids, no header"  # the sidecar's "format": nanoGPT's .bin


def gpt2_bpe():
    """GPT-2's BPE from the optional tiktoken package, or None when it is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken.get_encoding("gpt2")


def sidecar_of(path):
    """The sidecar of a .bin: the same name, .json for .bin."""
    return path[: -len(".bin")] + ".json"


def read_sidecar(path):
    """The sidecar of --data PATH (a .bin) as a dict, or None when there is none. One that lies is
    refused, naming the file and the field: not a regular file, not a JSON object, a tokenizer
    prepare_data.py does not write, a vocabulary that is not that tokenizer's, a format or a token
    count that is not the .bin's."""
    sidecar = sidecar_of(path)
    if not os.path.lexists(sidecar):
        return None
    where = f"--data {path}: its sidecar {sidecar}"
    try:
        if not os.path.isfile(sidecar):
            raise ValueError("it is not a regular file")
        with open(sidecar, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{where} cannot be read as JSON ({getattr(e, 'strerror', None) or e}); "
                         f"scripts/prepare_data.py writes it, or remove it to read the ids as plain token ids") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where} is not a JSON object")
    kind = meta.get("tokenizer")
    if kind is None:
        raise ValueError(f"{where} names no tokenizer (prepare_data.py writes "
                         f"{' or '.join(map(repr, SIDECAR_TOKENIZERS))})")
    if kind not in SIDECAR_TOKENIZERS:
        raise ValueError(f"{where}: tokenizer {kind!r} is not one prepare_data.py writes "
                         f"({' or '.join(map(repr, SIDECAR_TOKENIZERS))})")
    vocab = meta.get("vocab_size", SIDECAR_TOKENIZERS[kind])
    if vocab != SIDECAR_TOKENIZERS[kind] or isinstance(vocab, bool):
        raise ValueError(f"{where}: vocab_size {vocab!r} is not the {kind} tokenizer's {SIDECAR_TOKENIZERS[kind]}")
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{where}: format {meta['format']!r} is not {FORMAT!r}")
    tokens, size = meta.get("tokens"), os.path.getsize(path) if os.path.isfile(path) else None
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or size is not None
                               and tokens != size // 2):
        raise ValueError(f"{where}: tokens {tokens!r} is not the {size // 2 if size is not None else '?'} tokens the "
                         f".bin holds: the two files do not belong together (run scripts/prepare_data.py again)")
    return meta


def tokenizer_of(path):
    """How the tokens of --data PATH decode: "bytes" (the built-in corpus, any non-.bin file), or
    what a .bin's sidecar JSON says ("bytes" or "gpt2"), or "ids" when a .bin has none (or, here,
    one that cannot be read: read_sidecar refuses it, at start-up)."""
    if not path or not path.endswith(".bin"):
        return "bytes"
    try:
        meta = read_sidecar(path)
    except ValueError:
        return "ids"
    return meta["tokenizer"] if meta else "ids"
