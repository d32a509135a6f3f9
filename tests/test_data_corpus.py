"""The built-in corpus (plumbing.data.builtin_corpus) is the text it always was, byte for byte.

The docs and benchmarks quote losses trained on it, so a faster way of making it must make exactly
the same text. The reference below is the first implementation, kept as it was: one scalar
torch.randint per random choice, 144,000 of them for the default corpus (0.35-0.85 s a process).
builtin_corpus draws the generator's words in bulk instead (one batch modulo 120, each word then
taken modulo its own range); these tests hold it to the reference for the arguments the repository
uses (the defaults) and others, to the premise it rests on, and to drawing in bulk."""
import math

import pytest
import torch

from plumbing import data
from plumbing.data import held_out


def reference_corpus(n_sentences=20000, seed=0, calls=None):
    """The first builtin_corpus, unchanged but for counting its randint calls into calls[0]."""
    g = torch.Generator().manual_seed(seed)

    def randint(n):
        if calls is not None:
            calls[0] += 1
        return int(torch.randint(n, (), generator=g))

    pick = lambda xs: xs[randint(len(xs))]  # noqa: E731
    digit = lambda: randint(10)  # noqa: E731
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    things = ["apples", "books", "coins", "shells", "stones", "cards"]
    places = ["the market", "the garden", "the library", "the harbour", "school"]
    out = []
    for _ in range(n_sentences):
        a, b = pick(names), pick(names)
        x, y = digit(), digit()
        while held_out(x, y):
            x, y = digit(), digit()
        thing = pick(things)
        out.append(pick([
            f"{a} has {x} {thing}. {b} gives {a} {y} more. now {a} has {x + y} {thing}.",
            f"{a} walks to {pick(places)} with {b}. they count {x} {thing} and {y} {thing}: {x + y}.",
            f"{x} plus {y} is {x + y}. {y} plus {x} is {x + y}.",
        ]))
    return " ".join(out) + "\n"


def _fresh(*args):
    """builtin_corpus made now, not read from its cache (which holds the default corpus for the
    other tests of this process, and would hold only the last arguments asked for)."""
    return data.builtin_corpus.__wrapped__(*args)


# (): the only arguments the repository calls it with (load_tokens, identity, conftest's warm-up).
@pytest.mark.parametrize("args", [(), (20000, 1), (3000, 12345), (1, 0), (0, 0)],
                         ids=["default", "seed 1", "3000 sentences seed 12345", "one sentence", "none"])
def test_the_corpus_is_the_reference_byte_for_byte(args):
    new, old = _fresh(*args).encode(), reference_corpus(*args).encode()
    assert len(new) == len(old), f"{len(new)} bytes, the reference {len(old)}"
    first = next((k for k, (p, q) in enumerate(zip(new, old)) if p != q), None)
    assert first is None, f"first difference at byte {first}: {new[first:first + 60]!r} vs {old[first:first + 60]!r}"


def test_the_cached_default_corpus_is_the_reference():
    """What every caller reads (the cache, possibly warmed by conftest) is the reference text."""
    assert data.builtin_corpus() == reference_corpus()


@pytest.mark.parametrize("per_draw", [1, 2, 5, 6, 7, 64])
def test_the_text_does_not_depend_on_how_many_words_are_drawn_at_a_time(monkeypatch, per_draw):
    """Batches that end anywhere in a sentence, or in a held-out sum's redraw, change nothing."""
    monkeypatch.setattr(data, "_WORDS_PER_DRAW", per_draw)
    assert _fresh(400, 3) == reference_corpus(400, 3)


@pytest.mark.parametrize("ranges", [(8,), (10,), (6,), (5,), (3,), (8, 8, 10, 10, 6, 5, 3)])
def test_a_batch_of_words_modulo_120_reads_as_scalar_draws_of_each_range(ranges):
    """The premise, alone, so that a torch whose CPU randint changed says so here: scalar
    randint(n) calls, whatever mix of ranges n, equal one randint(120, (k,)) taken modulo each n."""
    assert math.lcm(8, 10, 6, 5, 3) == 120
    k = 7000
    g = torch.Generator().manual_seed(5)
    scalar = [int(torch.randint(ranges[j % len(ranges)], (), generator=g)) for j in range(k)]
    bulk = torch.randint(120, (k,), generator=torch.Generator().manual_seed(5)).tolist()
    assert scalar == [w % ranges[j % len(ranges)] for j, w in enumerate(bulk)]


def test_the_default_corpus_is_drawn_in_a_few_dozen_calls_not_one_per_choice(monkeypatch):
    calls = [0]
    reference_corpus(calls=calls)
    words = calls[0]
    assert words > 140_000  # the reference's one call per choice: at least 7 choices a sentence
    bulk = torch.randint
    counted = [0]

    def counting(*args, **kwargs):
        counted[0] += 1
        return bulk(*args, **kwargs)

    monkeypatch.setattr(torch, "randint", counting)
    _fresh()
    # Each call draws _WORDS_PER_DRAW words; one more may come while a few words are still unread.
    assert counted[0] <= -(-words // data._WORDS_PER_DRAW) + 1, f"{counted[0]} randint calls for {words} words"
