"""Write a text file as a token file the trainer memory-maps: nanoGPT's .bin, plus a sidecar .json.

    python3 scripts/prepare_data.py book.txt                     # book.bin + book.json
    python3 scripts/prepare_data.py book.txt -o data/train.bin --tokenizer bytes
    python3 05_3d_gpt.py --data book.bin --vocab-size 256        # the command it prints

The .bin holds the token ids, each an unsigned 16-bit little-endian integer, one after another,
with no header (nanoGPT's format; 05 reads it with torch.from_file, so it may exceed memory).
The sidecar book.json says how to decode them: {"format", "tokenizer", "vocab_size", "tokens",
"source"}, tokenizer "bytes" (every byte a token, V = 256) or "gpt2" (GPT-2's BPE, V = 50257).

--tokenizer auto (the default) uses GPT-2's BPE when the optional tiktoken package is importable
(pip install tiktoken) and bytes otherwise, saying so. A bad path is refused with a message naming
it, exit code 1.
"""
import argparse
import array
import json
import os
import sys

VOCAB = {"bytes": 256, "gpt2": 50257}
# GPT-2's 50257 padded to a multiple of 64, as nanoGPT does: the logit GEMM runs faster on GPUs.
TRAIN_VOCAB = {"bytes": 256, "gpt2": 50304}


def gpt2_encoder():
    """tiktoken's GPT-2 encoding, or None when the optional package is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken.get_encoding("gpt2")


def encode(data, tokenizer):
    """The token ids of `data` (bytes): its bytes, or GPT-2 BPE ids of its UTF-8 text."""
    if tokenizer == "bytes":
        return list(data)
    bpe = gpt2_encoder()
    if bpe is None:
        raise ValueError("--tokenizer gpt2 needs the tiktoken package: pip install tiktoken")
    return bpe.encode_ordinary(data.decode("utf-8", errors="replace"))


def write_bin(ids, path):
    """ids as uint16, little-endian, no header."""
    out = array.array("H", ids)  # raises OverflowError for an id >= 65536
    if sys.byteorder == "big":
        out.byteswap()
    with open(path, "wb") as f:
        out.tofile(f)


def read_bin(path):
    """The ids a .bin holds (the inverse of write_bin)."""
    ids = array.array("H")
    with open(path, "rb") as f:
        ids.frombytes(f.read())
    if sys.byteorder == "big":
        ids.byteswap()
    return list(ids)


def prepare(source, out, tokenizer, say=print):
    """Check the paths, encode, write OUT.bin and OUT.json; returns the number of tokens."""
    if not os.path.isfile(source):
        raise ValueError(f"the input {source!r} is not a readable file" +
                         (" (it is a directory)" if os.path.isdir(source) else ""))
    if os.path.abspath(out) == os.path.abspath(source):
        raise ValueError(f"the output {out!r} would overwrite the input; give another -o")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise ValueError(f"the output's directory {os.path.dirname(out)!r} does not exist")
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the input {source!r}: {e.strerror or e}") from None
    if not data:
        raise ValueError(f"the input {source!r} is empty")
    if tokenizer == "auto":
        tokenizer = "gpt2" if gpt2_encoder() is not None else "bytes"
        if tokenizer == "bytes":
            say("tiktoken is not installed, so every byte is a token (vocabulary 256); "
                "pip install tiktoken gives GPT-2's BPE")
    ids = encode(data, tokenizer)
    write_bin(ids, out)
    meta = dict(format="uint16-le token ids, no header", tokenizer=tokenizer, vocab_size=VOCAB[tokenizer],
                tokens=len(ids), source=source)
    sidecar = os.path.splitext(out)[0] + ".json"
    with open(sidecar, "w") as f:
        json.dump(meta, f, indent=1)
    say(f"wrote {out} ({len(ids):,} tokens, {tokenizer}; {2 * len(ids):,} bytes) and {sidecar}; train on it with:\n"
        f"    python3 05_3d_gpt.py --data {out} --vocab-size {TRAIN_VOCAB[tokenizer]}")
    return len(ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("input", help="the text file to tokenize")
    parser.add_argument("-o", "--output", help="the .bin to write (default: the input with .bin)")
    parser.add_argument("--tokenizer", choices=["auto", "bytes", "gpt2"], default="auto",
                        help="auto: gpt2 when tiktoken is installed, else bytes")
    args = parser.parse_args()
    out = args.output or os.path.splitext(args.input)[0] + ".bin"
    try:
        prepare(args.input, out, args.tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
