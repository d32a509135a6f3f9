"""How token ids decode, with nothing heavier than the standard library (scripts/prepare_data.py
imports it without torch): GPT-2's BPE when the optional tiktoken package is installed, and which
tokenizer a data file's sidecar names.
"""
import json


def gpt2_bpe():
    """GPT-2's BPE from the optional tiktoken package, or None when it is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken.get_encoding("gpt2")


def tokenizer_of(path):
    """How the tokens of --data PATH decode: "bytes" (the built-in corpus, any non-.bin file), or
    what a .bin's sidecar JSON says ("bytes" or "gpt2"), or "ids" when a .bin has none."""
    if not path or not path.endswith(".bin"):
        return "bytes"
    sidecar = path[: -len(".bin")] + ".json"
    try:
        with open(sidecar) as f:
            kind = json.load(f).get("tokenizer", "ids")
    except (OSError, ValueError, AttributeError):
        return "ids"
    return kind if kind in ("bytes", "gpt2") else "ids"
