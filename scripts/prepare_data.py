"""Turn a text file into the token file the trainer memory-maps: nanoGPT's .bin, plus a sidecar .json.

    python3 scripts/prepare_data.py book.txt                       # book.bin + book.json
    python3 scripts/prepare_data.py book.txt -o data/train.bin --tokenizer bytes
    python3 05_3d_gpt.py --data book.bin --vocab-size 256          # the command it prints
    python3 scripts/prepare_data.py pairs.jsonl --sft              # pairs.bin + pairs.json + pairs.mask
    python3 05_3d_gpt.py --data pairs.bin --loss-mask pairs.mask --vocab-size 256

The .bin holds the token ids and nothing else: each an unsigned 16-bit little-endian integer, one
after another, no header (nanoGPT's format). 05 memory-maps it with torch.from_file when --data
ends in .bin, so it may be larger than memory. The sidecar book.json (the same name, .json for
.bin) tells the trainer how to decode samples:
    {"format": "uint16-le token ids, no header", "tokenizer": "bytes" or "gpt2",
     "vocab_size": 256 or 50257, "tokens": N, "source": the input path as given}

--tokenizer (default auto):
    bytes   every byte of the file is one token, V = 256: any file, any encoding, no package
    gpt2    GPT-2's BPE from the optional tiktoken package (pip install tiktoken), V = 50257; the
            file must be UTF-8 text. No <|endoftext|> (50256) is appended: the file is one
            document, and nanoGPT's separator only matters between documents
    auto    gpt2 when tiktoken is importable, else bytes (and it says so)

--sft: supervised fine-tuning data. The input is JSONL, one {"prompt": ..., "response": ...} object
(both text) a line; blank lines are skipped. Each pair becomes its prompt's tokens, its response's,
then the end-of-text token (<|endoftext|>, 50256, under gpt2; the byte 0 under bytes), one pair
after another in OUT.bin, and a third file, OUT.mask (the same name, .mask for .bin), holds one
byte per token for 05's --loss-mask: 0 under the prompt's tokens, whose targets are not counted,
1 under the response's and the end-of-text token's, which are (the model learns to answer, and to
stop). The sidecar also names the mask, the pairs and the separator. A line that is not JSON, not an
object, or lacks a field or has one that is not text is refused, naming its line number.

Exit codes: 0 written; 1 refused, with one line naming the path or flag and no traceback (an input
that is missing, a directory, unreadable or empty; an output that does not end in .bin, would
overwrite the input (itself or through its sidecar, links followed), is a directory, a FIFO or a
device, lies in a missing directory or inside a checkpoint, or, it or its sidecar, already exists
and --overwrite was not given; --tokenizer gpt2 without tiktoken; BPE of a file that is not UTF-8;
with --sft, a bad line or no pair at all); 2 a usage error. Every file is written beside its name
and renamed into place, so each appears whole (a link at any name is replaced, not followed).
"""
import argparse
import array
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.paths import check_outputs, fresh  # noqa: E402  (the repository root, put on the path above)
from plumbing.tokenizer import FORMAT, SIDECAR_TOKENIZERS as VOCAB, gpt2_bpe  # noqa: E402


class Refused(Exception):
    """A bad input or flag: main prints the message and exits 1."""


# ----------------------------------------------------------------------------------------------
# Tokenizers: bytes, or GPT-2's BPE when tiktoken is installed


def resolve(tokenizer):
    """auto -> gpt2 when tiktoken is importable, else bytes; bytes and gpt2 are kept."""
    if tokenizer != "auto":
        return tokenizer
    return "gpt2" if gpt2_bpe() is not None else "bytes"


def encode(data, tokenizer):
    """The token ids of `data` (the file's bytes) under "bytes" or "gpt2"."""
    if tokenizer == "bytes":
        return list(data)
    bpe = gpt2_bpe()
    if bpe is None:
        raise Refused("--tokenizer gpt2 needs the tiktoken package: pip install tiktoken "
                      "(or use --tokenizer bytes)")
    try:
        text = data.decode("utf-8")  # strict: a lossy decode would train on replacement characters
    except UnicodeDecodeError as e:
        raise Refused(f"GPT-2 BPE reads UTF-8 text, and byte {e.start} is 0x{data[e.start]:02x}; "
                      "convert the file to UTF-8 or use --tokenizer bytes") from None
    return bpe.encode_ordinary(text)  # ordinary: text that spells "<|endoftext|>" stays text


END_OF_TEXT = {"bytes": 0, "gpt2": 50256}  # --sft's token after each response: 0 is a byte text never holds


def encode_pairs(data, tokenizer, source):
    """--sft: the JSONL `data` (the file's bytes) as (ids, mask, pairs): every pair's prompt, response
    and END_OF_TEXT token, and a mask byte per id (0 under the prompt, 1 under the rest)."""
    ids, mask, pairs = [], [], 0
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"the input {source!r}, line {n}"
        try:
            pair = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise Refused(f"{where}: byte {e.start} of the line is 0x{line[e.start]:02x}, not UTF-8; --sft reads "
                          f"JSONL, which is UTF-8") from None
        except ValueError as e:
            raise Refused(f"{where} is not JSON ({e}); --sft reads one {{\"prompt\": ..., \"response\": ...}} "
                          f"object a line") from None
        if not isinstance(pair, dict):
            raise Refused(f"{where} is a JSON {type(pair).__name__}, not an object; --sft reads one "
                          f"{{\"prompt\": ..., \"response\": ...}} object a line")
        for field in ("prompt", "response"):
            if field not in pair:
                raise Refused(f"{where} has no {field!r} field (it has {', '.join(map(repr, pair)) or 'none'}); "
                              f"each line is {{\"prompt\": ..., \"response\": ...}}")
            if not isinstance(pair[field], str):
                raise Refused(f"{where}: {field!r} is a JSON {type(pair[field]).__name__}, not text")
        prompt, response = (encode(pair[k].encode("utf-8"), tokenizer) for k in ("prompt", "response"))
        ids += prompt + response + [END_OF_TEXT[tokenizer]]
        mask += [0] * len(prompt) + [1] * (len(response) + 1)  # the answer and its end are learnt, the prompt not
        pairs += 1
    if not pairs:
        raise Refused(f"the input {source!r} holds no prompt/response pair: --sft reads one "
                      f"{{\"prompt\": ..., \"response\": ...}} object a line")
    return ids, mask, pairs


def train_vocab_size(vocab_size):
    """--vocab-size for 05: V rounded up to a multiple of 64, as nanoGPT pads GPT-2's 50257 to
    50304. The padded logits are never targets; the output GEMM tiles evenly on GPUs, and V splits
    evenly over any power-of-two tp up to 64 (01's vocab-parallel embedding needs V % tp == 0)."""
    return -(-vocab_size // 64) * 64


# ----------------------------------------------------------------------------------------------
# The .bin: uint16, little-endian, no header


def write_bin(ids, path):
    """ids as unsigned 16-bit little-endian integers, nothing else."""
    out = array.array("H", ids)  # OverflowError for an id outside 0..65535; prepare checks first
    if sys.byteorder == "big":  # the format is little-endian whatever host writes it
        out.byteswap()
    with open(fresh(path), "wb") as f:
        out.tofile(f)


def read_bin(path):
    """The ids a .bin holds, as a list of ints (the inverse of write_bin)."""
    ids = array.array("H")
    with open(path, "rb") as f:
        ids.frombytes(f.read())  # ValueError for an odd number of bytes: not a .bin
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


# ----------------------------------------------------------------------------------------------
# Checks, then the two files


def _write_mask(mask, path):
    """--sft's mask: one byte, 0 or 1, per token of the .bin (05's --loss-mask)."""
    with open(fresh(path), "wb") as f:
        f.write(bytes(mask))


def _write_json(meta, path):
    with open(fresh(path), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def sidecar_path(out):
    return os.path.splitext(out)[0] + ".json"  # 05 looks for exactly this: the .bin's stem + .json


def mask_path(out):
    return os.path.splitext(out)[0] + ".mask"  # --sft's: 05 reads it as --loss-mask


def same_file(a, b):
    """a and b are one file: the same path after symlinks, or (both existing) the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def check_paths(source, out, overwrite=False, sft=False):
    """Refuse, by name, every path that cannot give a .bin the trainer reads, before writing."""
    if os.path.isdir(source):
        raise Refused(f"the input {source!r} is a directory; give a text file")
    if not os.path.exists(source):
        raise Refused(f"the input {source!r} does not exist")
    if not os.path.isfile(source):
        raise Refused(f"the input {source!r} is not a regular file")
    if not out.endswith(".bin"):  # 05 reads any other name as text, so these ids would be bytes
        raise Refused(f"the output {out!r} must end in .bin: 05_3d_gpt.py --data reads only .bin "
                      "files as token ids")
    if same_file(out, source):
        raise Refused(f"the output {out!r} would overwrite the input; give another -o")
    if same_file(sidecar_path(out), source):
        raise Refused(f"the sidecar {sidecar_path(out)!r} of the output {out!r} would overwrite the "
                      "input; give another -o")
    if os.path.isdir(out):
        raise Refused(f"the output {out!r} is a directory")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise Refused(f"the output's directory {os.path.dirname(out)!r} does not exist "
                      f"(for the output {out!r}); create it first")
    writes = [("-o", out), ("-o's sidecar", sidecar_path(out))] + ([("-o's mask", mask_path(out))] if sft else [])
    try:  # no file may replace one this command did not write, unless --overwrite
        check_outputs(writes, [("the input", source)], overwrite=overwrite)
    except ValueError as e:
        raise Refused(str(e)) from None


def prepare(source, out, tokenizer="auto", say=print, overwrite=False, sft=False):
    """Check the paths, tokenize, write OUT (.bin) and its sidecar (sft: the input is prompt/response
    pairs, and OUT.mask is written too); returns the sidecar's dict."""
    check_paths(source, out, overwrite, sft)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Refused(f"cannot read the input {source!r}: {e.strerror or e}") from None
    if not data:
        raise Refused(f"the input {source!r} is empty: there is nothing to train on")
    asked, tokenizer = tokenizer, resolve(tokenizer)
    ids, mask, pairs = encode_pairs(data, tokenizer, source) if sft else (encode(data, tokenizer), None, 0)
    V = VOCAB[tokenizer]
    assert V <= 1 << 16, "ids must fit in uint16"
    top = max(ids, default=0)
    if top >= V:  # a tokenizer that disagrees with its vocabulary: the trainer would refuse later
        raise Refused(f"the {tokenizer} tokenizer gave id {top}, outside its vocabulary of {V}")
    meta = {"format": FORMAT, "tokenizer": tokenizer, "vocab_size": V, "tokens": len(ids), "source": source}
    files = [(out, lambda tmp: write_bin(ids, tmp)), (sidecar_path(out), lambda tmp: _write_json(meta, tmp))]
    if sft:
        meta.update(loss_mask=mask_path(out), pairs=pairs, separator=END_OF_TEXT[tokenizer])
        files.append((mask_path(out), lambda tmp: _write_mask(mask, tmp)))
    written = []
    try:
        for path, write in files:
            tmp = f"{path}.tmp-{os.getpid()}"  # beside it, then renamed over it: whole or not at all
            written.append(tmp)
            write(tmp)
            os.replace(tmp, path)
    except OSError as e:
        raise Refused(f"cannot write {e.filename or out!r}: {e.strerror or e}") from None
    finally:
        for tmp in written:
            if os.path.exists(tmp):
                os.remove(tmp)
    if asked == "auto" and tokenizer == "bytes":  # said after writing, so "were written" is true
        say("tiktoken is not installed, so byte-level tokens were written (vocabulary 256); "
            "pip install tiktoken gives GPT-2 BPE")
    masked = (f", and its loss mask {mask_path(out)} ({pairs:,} pairs; {sum(mask):,} of the {len(ids):,} targets "
              f"counted: the responses and their end-of-text tokens)" if sft else "")
    with_mask = f" --loss-mask {shlex.quote(mask_path(out))}" if sft else ""
    say(f"wrote {out}: {len(ids):,} tokens ({tokenizer}, V = {V}), {2 * len(ids):,} bytes, and "
        f"{sidecar_path(out)}{masked}; train on it: python3 05_3d_gpt.py --data {shlex.quote(out)}{with_mask} "
        f"--vocab-size {train_vocab_size(V)}")
    return meta


# ----------------------------------------------------------------------------------------------
# The command line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="the text file to tokenize (with --sft: a JSONL file of prompt/response pairs)")
    parser.add_argument("-o", "--output", metavar="OUT.bin",
                        help="the token file to write, ending in .bin; its sidecar is OUT.json "
                             "(default: the input with its suffix replaced by .bin)")
    parser.add_argument("--tokenizer", choices=["auto", "bytes", "gpt2"], default="auto",
                        help="bytes: one token per byte (V = 256); gpt2: GPT-2 BPE via tiktoken "
                             "(V = 50257); auto: gpt2 if tiktoken is installed, else bytes (default: auto)")
    parser.add_argument("--sft", action="store_true",
                        help="the input is JSONL, one {\"prompt\": ..., \"response\": ...} object a line: write "
                             "OUT.bin of prompt, response and end-of-text per pair, and OUT.mask, 0 under the "
                             "prompts' tokens, for 05's --loss-mask (default: off, the input is one text)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let the output and its sidecar replace existing files")
    args = parser.parse_args(argv)
    out = args.output or os.path.splitext(args.input)[0] + ".bin"
    try:
        prepare(args.input, out, args.tokenizer, overwrite=args.overwrite, sft=args.sft)
    except Refused as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
