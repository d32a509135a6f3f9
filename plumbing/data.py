"""Data: a built-in corpus or a file, cut into the same random windows on every rank.

    --data ""            the built-in corpus below: byte-level, nothing to download
    --data book.txt      any file that does not end in .bin: its bytes are the tokens (V = 256)
    --data train.bin     nanoGPT's format: token ids as uint16, little-endian, no header, read as
                         sampled; scripts/prepare_data.py writes one (byte-level, or GPT-2 BPE with
                         tiktoken) and a sidecar train.json naming its tokenizer
    --loss-mask m.mask   beside --data: one uint8 per token, 0 where the target at that position is not
                         counted (its label is -100: a prompt's tokens in SFT); prepare_data.py --sft
                         writes one from prompt/response pairs. Split with the tokens, applied in
                         global_batch, so every caller (train, eval) gets the masked targets

The last 10% of the tokens are held out for the eval loss. Batch `step` is a function of (seed,
step) alone, so a resumed run, in any layout, reads exactly the batches it would have read.

A .bin is read window by window (TokenFile: os.pread, not a memory map), so a file truncated
while a run trains on it is a sentence naming it, not a rank killed by SIGBUS. identity(path) is
what a data file (or a mask) is for the checkpoints and for the ranks' agreement
(plumbing/agreement.py): its size and a hash of its head and tail, taken when it is loaded. A mask
is read the same way (MaskFile), and travels with its tokens as one object (Masked: tokens[a:b]
gives token ids as before, .mask the mask's bytes), so the callers of split_tokens and
global_batch pass one thing whether there is a mask or not.
"""
import functools
import hashlib
import math
import os

import torch

from plumbing.paths import describe
from plumbing.tokenizer import read_sidecar, sidecar_of

IGNORE_INDEX = -100  # a target the loss does not count (01's GPT and F.cross_entropy's default)

# Sums the built-in corpus never states, in either order: the end-of-run probe asks for them too, to
# tell what the model memorised from what it worked out.
HELD_OUT_SUMS = {(1, 8), (2, 7), (3, 5), (4, 9), (6, 6)}


def held_out(x, y):
    return (min(x, y), max(x, y)) in HELD_OUT_SUMS


_WORDS_PER_DRAW = 4096  # the corpus's random words are drawn from its generator this many at a time


@functools.lru_cache(maxsize=1)  # made once in the launching process; forked ranks inherit it
def builtin_corpus(n_sentences=20000, seed=0):
    """Deterministic little stories with counting and single-digit sums, as text (about 1 MB). The
    default run (200 steps) learns its words and sentence shapes (a byte-level loss near 0.84) but,
    measured by sum_probe at the end of training, none of its sums: 0 of 100 right.

    Each sentence draws, in this order: two names, two digits x and y (again while the pair is
    in HELD_OUT_SUMS), a thing, a place and one of three shapes. The text was first made with one
    scalar torch.randint(len(xs), ()) per draw, 144,000 calls and 0.35-0.85 s in every process;
    tests/test_data_corpus.py keeps that loop and checks this one against it, byte for byte."""
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    things = ["apples", "books", "coins", "shells", "stones", "cards"]
    places = ["the market", "the garden", "the library", "the harbour", "school"]
    # On the CPU, torch.randint(n) for n < 2**32 takes one 32-bit word w of the generator's Mersenne
    # Twister and returns w % n, one word per number, in order, however many it is asked for. So
    # words drawn in bulk modulo a common multiple of every range used (8, 10, 6, 5, 3: 120), each
    # then taken modulo its own range, are the very numbers the scalar calls drew.
    n_names, n_things, n_places = len(names), len(things), len(places)
    ranges = math.lcm(n_names, 10, n_things, n_places, 3)
    held = [held_out(x, y) for x in range(10) for y in range(10)]  # by 10 x + y
    g = torch.Generator().manual_seed(seed)
    w, i = [], 0  # the words drawn so far, and the first one not yet used

    def enough(k):  # w[i:] with at least k words (a held-out sum drawn again takes two more)
        left = w[i:]
        while len(left) < k:
            left += torch.randint(ranges, (_WORDS_PER_DRAW,), generator=g).tolist()
        return left, 0

    out = []
    for _ in range(n_sentences):
        if len(w) - i < 7:
            w, i = enough(7)
        a, b, x, y = names[w[i] % n_names], names[w[i + 1] % n_names], w[i + 2] % 10, w[i + 3] % 10
        i += 4
        while held[10 * x + y]:
            if len(w) - i < 5:
                w, i = enough(5)
            x, y, i = w[i] % 10, w[i + 1] % 10, i + 2
        thing, place, shape = things[w[i] % n_things], places[w[i + 1] % n_places], w[i + 2] % 3
        i += 3
        if shape == 0:
            out.append(f"{a} has {x} {thing}. {b} gives {a} {y} more. now {a} has {x + y} {thing}.")
        elif shape == 1:
            out.append(f"{a} walks to {place} with {b}. they count {x} {thing} and {y} {thing}: {x + y}.")
        else:
            out.append(f"{x} plus {y} is {x + y}. {y} plus {x} is {x + y}.")
    return " ".join(out) + "\n"


def check_tokens(idx, cfg, sp_tp=1):
    """Refuse a batch the model cannot read, on every rank before the first collective: longer than
    cfg.block_size, not divisible by tp under sequence parallelism (sp_tp), ids outside [0, V)."""
    T, V = idx.shape[-1], cfg.vocab_size
    if T > cfg.block_size:
        raise ValueError(f"sequence length T={T} exceeds block_size={cfg.block_size}")
    if T % sp_tp:
        raise ValueError(f"sequence parallelism needs T={T} divisible by tp={sp_tp}")
    lo, hi = (int(t) for t in torch.aminmax(idx))  # (on a GPU, reading them back waits for it)
    if lo < 0 or hi >= V:
        raise ValueError(f"token ids must lie in [0, vocab_size={V}); got min={lo}, max={hi}")


def check_targets(logits, target, group, n_vocab, ignore_index):
    """What F.cross_entropy refuses, without reading back: more vocabulary than the logits' (..., V/tp)
    columns, a target outside [0, n_vocab) that is not ignore_index (not checked inside a CUDA graph's
    capture). 01's GPT.head calls it; call it before 01's vocab_parallel_cross_entropy, which trusts them."""
    tp = 1 if group is None else torch.distributed.get_world_size(group)
    if n_vocab > logits.shape[-1] * tp:
        raise ValueError(f"n_vocab={n_vocab} is more than the logits' {logits.shape[-1]} columns x tp={tp}")
    if not (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(((target == ignore_index) | (target >= 0) & (target < n_vocab)).all(),
                            f"a target is outside [0, n_vocab={n_vocab}) and is not ignore_index={ignore_index}")


def load_tokens(path, vocab_size, seq_len, mask=""):
    """All tokens of the data: a nanoGPT .bin as a TokenFile (uint16 ids, read as they are needed)
    or any other file as bytes (a 1-D tensor); with mask (--loss-mask), both as one Masked
    (load_mask checks the mask). Refuses, naming the file, what cannot train: missing,
    not a regular file (a FIFO or a device: never a whole file), empty, a file whose size reads as 0
    but that holds data (made up as it is read, as under /proc), a .BIN in another case than .bin,
    too short, too large for memory (text), ids >= vocab_size, a .bin whose sidecar lies
    (plumbing/tokenizer.read_sidecar) or names a vocabulary larger than --vocab-size. Its identity
    is recorded as it is loaded (identity())."""
    if mask and not path:
        raise ValueError(f"--loss-mask {mask} needs --data FILE: the mask has one byte per token of a data file, and "
                         f"the built-in corpus has no mask; add --data FILE, or drop --loss-mask")
    if not path:
        tokens = torch.frombuffer(bytearray(builtin_corpus().encode()), dtype=torch.uint8)
    else:
        if os.path.isdir(path):
            raise ValueError(f"--data {path}: it is a directory, not a data file")
        what = describe(path)
        if what:
            raise ValueError(f"--data {path}: it is {what}, not a regular file: the trainer reads a .bin window by "
                             f"window and any other file whole, which a pipe or a device cannot give; write it to "
                             f"a file first")
        suffix = os.path.splitext(path)[1]
        if suffix.lower() == ".bin" and suffix != ".bin":
            raise ValueError(f"--data {path}: its suffix is {suffix}, not .bin: only a .bin (in lower case) is read "
                             f"as uint16 token ids, and any other file as text, bytes as tokens; rename it to end in "
                             f".bin if it holds token ids (scripts/prepare_data.py writes them so), or give a text "
                             f"file another suffix")
        try:
            size = os.path.getsize(path)
            if size == 0:
                with open(path, "rb") as f:
                    made_up = f.read(1)
                if made_up:
                    raise ValueError(f"--data {path}: its size reads as 0 bytes, yet reading it gives data: a file "
                                     f"the kernel makes up as it is read (as under /proc or /sys), which can differ "
                                     f"between reads and between ranks; copy it to a regular file and train on that")
                raise ValueError(f"the data file {path!r} is empty")
            if is_bin(path) and size % 2:
                raise ValueError(f"--data {path}: {size} bytes is not a whole number of 2-byte (uint16) "
                                 f"token ids; is it a .bin that scripts/prepare_data.py wrote?")
            _identities[path] = _identity_of_file(path, size)
            if is_bin(path):
                meta = read_sidecar(path)
                if meta and meta.get("vocab_size", 0) > vocab_size:
                    raise ValueError(f"--data {path}: its sidecar {sidecar_of(path)} names the {meta['tokenizer']} "
                                     f"tokenizer, of {meta['vocab_size']} tokens, more than --vocab-size {vocab_size}; "
                                     f"train with --vocab-size {-(-meta['vocab_size'] // 64) * 64}")
                tokens = TokenFile(path, size // 2)  # read as sampled, not loaded: a .bin can be gigabytes
            else:
                tokens = _read_text(path, size)
        except OSError as e:
            raise ValueError(f"cannot read the data file {path!r}: {e.strerror or e}") from None
    if len(tokens) < seq_len + 1:
        raise ValueError(f"--data {path or '(the built-in corpus)'}: the data holds {len(tokens)} tokens, fewer than "
                         f"one sequence of seq_len + 1 = {seq_len + 1}")
    # In pieces: uint16 tensors have few operations, and a whole-file copy could be gigabytes.
    for i, piece in enumerate(_pieces(tokens, 1 << 24)):
        wide = piece.to(torch.int32)
        top = int(wide.max())
        if top >= vocab_size:
            at = i * (1 << 24) + int(wide.argmax())
            raise ValueError(f"--data {path or '(the built-in corpus)'}: the data holds token id {top} >= "
                             f"vocab_size={vocab_size} (token {at:,} of the file); give --vocab-size {top + 1} or "
                             f"more, or check that the file is the right one")
    return Masked(tokens, load_mask(mask, len(tokens), path)) if mask else tokens


def is_bin(path):
    """A nanoGPT .bin of uint16 token ids (by its name, as scripts/prepare_data.py writes it)."""
    return path.endswith(".bin")


def _read_text(path, size):
    """A text file's bytes as a uint8 tensor, read into one buffer of its size (not read, then
    copied); a file larger than the memory left is a sentence, not a MemoryError."""
    try:
        buf = bytearray(size)
        with open(path, "rb") as f:
            n = f.readinto(buf)
    except MemoryError:
        raise ValueError(f"--data {path}: {size / 2**20:,.1f} MiB of text does not fit in this process's memory (a "
                         f"text file is read whole, and every local rank holds a copy); convert it to a .bin with "
                         f"scripts/prepare_data.py, which is read window by window") from None
    return torch.frombuffer(buf, dtype=torch.uint8)[:n] if n else torch.zeros(0, dtype=torch.uint8)


class TokenFile:
    """The uint16 token ids of a .bin, tokens [start, start + count), read with os.pread when a
    window is asked for (tokens[a:b] gives a uint16 tensor; part(a, b) another TokenFile). Reads
    need no shared state, so forked ranks share the open file; a read that comes back short (the
    file truncated since it was opened) is a ValueError naming the file, where a memory map would
    kill the rank with SIGBUS."""
    ITEM, DTYPE, FLAG = 2, torch.uint16, "--data"  # bytes per entry, its dtype, the flag that names the file

    def __init__(self, path, count, start=0, file=None):
        self.path, self.count, self.start = path, count, start
        self.file = file or _Descriptor(path)  # shared by its parts, closed with the last of them

    def __len__(self):
        return self.count

    def part(self, lo, hi):
        return type(self)(self.path, hi - lo, self.start + lo, self.file)

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a {type(self).__name__} gives windows: tokens[a:b]")
        lo, hi, _ = key.indices(self.count)
        n, item = max(hi - lo, 0), self.ITEM
        if not n:
            return torch.zeros(0, dtype=self.DTYPE)
        data = os.pread(self.file.fd, item * n, item * (self.start + lo))
        if len(data) < item * n:
            size = os.fstat(self.file.fd).st_size
            raise ValueError(f"{self.FLAG} {self.path}: the file is {size:,} bytes now, shorter than the "
                             f"{item * (self.start + hi):,} bytes this run reads from: it was truncated while the "
                             f"run trained on it; the run stops here (its checkpoints so far are intact); restore the "
                             f"file, or give {self.FLAG} a copy that nothing writes to")
        return torch.frombuffer(bytearray(data), dtype=self.DTYPE)


class MaskFile(TokenFile):
    """A --loss-mask file: one uint8 per token of --data (1: the target at that position is
    counted, 0: it is not), read window by window as a TokenFile is."""
    ITEM, DTYPE, FLAG = 1, torch.uint8, "--loss-mask"


class Masked:
    """Tokens and their loss mask, one object that split_tokens and global_batch understand:
    tokens[a:b] and len() are the tokens', as for tokens alone (so a caller that only reads ids
    needs nothing new); .mask[a:b] the mask's bytes at the same positions; part(a, b) both cut."""

    def __init__(self, tokens, mask):
        self.tokens, self.mask = tokens, mask

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, key):
        return self.tokens[key]

    def part(self, lo, hi):
        return Masked(_part(self.tokens, lo, hi), _part(self.mask, lo, hi))


def _part(tokens, lo, hi):
    """tokens [lo, hi): a TokenFile's (or a Masked's) part, a tensor's slice."""
    return tokens.part(lo, hi) if hasattr(tokens, "part") else tokens[lo:hi]


def load_mask(path, n_tokens, data_path):
    """--loss-mask PATH as a MaskFile, checked against the n_tokens of --data data_path: a regular
    file of exactly n_tokens bytes, each 0 or 1 (the first other value is named with its position),
    not all 0. Read in pieces, never whole; its identity is recorded as it is loaded (identity())."""
    if os.path.isdir(path):
        raise ValueError(f"--loss-mask {path}: it is a directory, not a mask file (one byte, 0 or 1, per token of "
                         f"--data {data_path})")
    what = describe(path)
    if what:
        raise ValueError(f"--loss-mask {path}: it is {what}, not a regular file: the mask is read window by window "
                         f"beside --data; write it to a file first")
    try:
        size = os.path.getsize(path)
        if size != n_tokens:
            raise ValueError(f"--loss-mask {path}: it is {size:,} bytes, but --data {data_path} holds {n_tokens:,} "
                             f"tokens: the mask must have exactly one byte (0 or 1) per token; is it the mask "
                             f"scripts/prepare_data.py --sft wrote with this data?")
        _identities[path] = _identity_of_file(path, size)
        mask = MaskFile(path, size)
    except OSError as e:
        raise ValueError(f"--loss-mask {path}: cannot read the mask file: {e.strerror or e}") from None
    counted = 0
    for i, piece in enumerate(_pieces(mask, 1 << 24)):
        bad = piece > 1
        if bool(bad.any()):
            at = int(bad.to(torch.uint8).argmax())
            raise ValueError(f"--loss-mask {path}: byte {i * (1 << 24) + at:,} is {int(piece[at])}, but every byte "
                             f"must be 0 (the target at that position is not counted) or 1 (it is)")
        counted += int(piece.sum(dtype=torch.int64))
    if not counted:
        raise ValueError(f"--loss-mask {path}: every one of its {size:,} bytes is 0: no target of --data "
                         f"{data_path} would be counted, and there would be nothing to train on")
    return mask


def _counts_a_target(mask, lo, hi):
    """Whether mask[lo:hi] holds a 1 (read in pieces, stopping at the first)."""
    return any(bool(piece.any()) for piece in _pieces(_part(mask, lo, hi), 1 << 24))


class _Descriptor:
    """An open file descriptor, closed when the last object holding it goes."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def _pieces(tokens, n):
    """The tokens in consecutive pieces of at most n, as tensors."""
    for lo in range(0, len(tokens), n):
        yield tokens[lo: lo + n]


# ----------------------------------------------------------------------------------------------
# What a data file is: its identity, for the checkpoints (a resume on other data) and the ranks'
# agreement (another file on another node).

HEAD_TAIL = 1 << 20  # bytes hashed at each end: a file's size and ends, in a few milliseconds


def _identity_of_file(path, size):
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(HEAD_TAIL))
        if size > HEAD_TAIL:
            f.seek(max(HEAD_TAIL, size - HEAD_TAIL))
            h.update(f.read(HEAD_TAIL))
    return dict(bytes=size, head_tail_sha256=h.hexdigest())


_identities = {}  # --data path -> its identity when this process loaded it


@functools.lru_cache(maxsize=1)
def _builtin_identity():
    text = builtin_corpus().encode()
    return dict(bytes=len(text), head_tail_sha256=hashlib.sha256(str(len(text)).encode() + text).hexdigest())


def identity(path):
    """What --data PATH is: {"bytes": its size, "head_tail_sha256": a hash of its size, first MiB
    and last MiB} (the built-in corpus: its own), as it was when this process loaded it (else now).
    Two files of the same identity are the same data, wherever they lie; an edit in the middle of
    a file larger than 2 MiB that keeps its size is not seen."""
    if not path:
        return _builtin_identity()
    if path not in _identities:
        _identities[path] = _identity_of_file(path, os.path.getsize(path))
    return _identities[path]


def split_tokens(tokens, seq_len, path=""):
    """90% to train on, the last 10% held out for the eval loss (each at least one sequence). A
    Masked splits its mask at the same place, and each split must count at least one target (the
    first token of a split is never a target: no window predicts it)."""
    n_eval = max(len(tokens) // 10, seq_len + 1)
    if len(tokens) - n_eval < seq_len + 1:
        raise ValueError(f"--data {path or '(the built-in corpus)'}: {len(tokens)} tokens cannot hold a sequence of "
                         f"seq_len + 1 = {seq_len + 1} to train on and another held out for the eval loss; need at "
                         f"least {2 * (seq_len + 1)}")
    cut = len(tokens) - n_eval
    if isinstance(tokens, Masked):
        for what, lo, hi in (("train split", 1, cut), ("held-out eval split", cut + 1, len(tokens))):
            if not _counts_a_target(tokens.mask, lo, hi):  # the targets a window of the split can have
                raise ValueError(f"--loss-mask {tokens.mask.path}: the {what}'s targets (tokens {lo:,} to {hi - 1:,} "
                                 f"of --data {path}) are all masked: its bytes there are all 0, and each split needs "
                                 f"at least one 1 (the last 10% of the tokens are held out for the eval loss)")
    return _part(tokens, 0, cut), _part(tokens, cut, len(tokens))


def global_batch(tokens, step, tc, salt=0):
    """Batch `step`: B random windows (B, T) and their next-token targets, the same on every rank.
    Tokens with a mask (Masked): a target whose position's mask byte is 0 is -100 (not counted)."""
    g = torch.Generator().manual_seed(tc.seed * 1_000_003 + step * 2 + salt)
    starts = torch.randint(len(tokens) - tc.seq_len, (tc.batch_size,), generator=g).tolist()
    window = torch.stack([tokens[s: s + tc.seq_len + 1].to(torch.int64) for s in starts])
    idx, targets = window[:, :-1], window[:, 1:]
    if isinstance(tokens, Masked):  # targets[b, j] is token s + 1 + j: its mask byte is mask[s + 1 + j]
        counted = torch.stack([tokens.mask[s + 1: s + tc.seq_len + 1] for s in starts]).bool()  # (B, T)
        targets = targets.masked_fill(~counted, IGNORE_INDEX)
    return idx, targets


def replica_batch(tokens, step, tc, dp_rank, salt=0):
    """This replica's disjoint rows of the global batch (the rows are split as 04 does)."""
    idx, targets = global_batch(tokens, step, tc, salt)
    if tc.batch_size % tc.dp:
        raise ValueError(f"the global batch of {tc.batch_size} sequences is not divisible by dp={tc.dp}")
    return idx.chunk(tc.dp)[dp_rank], targets.chunk(tc.dp)[dp_rank]


# ----------------------------------------------------------------------------------------------
# The sum probe: what the default run learns, measured rather than claimed.


def sum_probe(seq_len, batch_size, ignore_index=-100):
    """Every single-digit sum "x plus y is z." as a batch of windows, scored only on z and the
    full stop: a row counts as right when the model's greedy prediction of each of those tokens,
    given everything before it, is the true one. That is exactly what greedy decoding from the
    prompt "... x plus y is " would write. Each window starts with a filler sentence of another
    kind (cut from the left to fit seq_len), so the prompt sits where the corpus puts it.

    Returns a list of global batches (idx, targets, pairs): idx and targets (B, T); pairs[i] is
    row i's (x, y), or None for a row that only pads the last batch."""
    sentence = "alice walks to the garden with bob. they count 3 coins and 4 coins: 7. "
    filler = sentence * (seq_len // len(sentence) + 2)  # longer than any window: every row seq_len long
    rows = []
    for x in range(10):
        for y in range(10):
            prompt, answer = f"{x} plus {y} is ", f"{x + y}."
            text = (filler + prompt + answer).encode()[-(seq_len + 1):]
            ids = torch.tensor(list(text))
            targets = torch.full((seq_len,), ignore_index)
            targets[-len(answer):] = ids[-len(answer):]
            rows.append((ids[:-1], targets, (x, y)))
    while len(rows) % batch_size:  # padding: a copy of the first row, not counted
        rows.append((*rows[0][:2], None))
    return [(torch.stack([r[0] for r in rows[i:i + batch_size]]),
             torch.stack([r[1] for r in rows[i:i + batch_size]]),
             [r[2] for r in rows[i:i + batch_size]]) for i in range(0, len(rows), batch_size)]
