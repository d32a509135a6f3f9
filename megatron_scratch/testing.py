"""The engineer's kit: these files as the correct answer in your own test suite (issue 42).

    run_ranks(fn, n, *args)            fn(env, *args) on n fresh gloo CPU ranks forked for this call;
                                       every rank's return value, in rank order
    assert_close(got, want, rtol=, atol=, name=)   every element within atol + rtol * |want|, or an
                                       AssertionError naming the worst element; differing shapes or
                                       dtypes are refused, in a sentence, before any arithmetic
    compare_state(got, want, rtol=, atol=)   two state dicts, key by key: a StateReport naming the worst
                                       entries and every missing and extra key (an AssertionError
                                       carrying it when anything differs, unless check=False)
    RankFailure                        what run_ranks raises (plumbing.launch's)
    tolerances(dtype)                  the defaults above: (rtol, atol) for a dtype
    megatron_grad_tolerance(dtype, n_layers, layer)   Megatron's bound for a low-precision gradient,
                                       k * C**(L + 1 - l) * eps, k = 4, C = 1.03 (the option below)

The pytest plugin (megatron_scratch.pytest_plugin, registered as the `pytest11` entry point
"megatron_scratch" in pyproject.toml) gives every test suite of an environment where the package is
installed a `run_ranks` fixture with no conftest:

    def test_my_all_reduce(run_ranks):
        def body(env, x):                 # env.rank, env.world_size, env.device (cpu)
            y = x.clone(); torch.distributed.all_reduce(y); return y
        got = run_ranks(body, 2, torch.ones(3))
        assert_close(got[0], torch.full((3,), 2.0))

Which check to use. Against our float64 reference, run yours in float64 too, whenever it can: the
math is the same and only the order of the sums differs, so the defaults (float64: rtol 1e-10, atol
1e-12) hold with four orders of magnitude to spare, and a real mistake (a missing all-reduce, a
wrong shard, an off-by-one mask) is off by 1e-3 or more. When yours can only run in bf16 or fp32
(fused kernels, NCCL's low-precision reductions, FlashAttention), an exact check cannot pass and a
loose one of your own choosing proves little: megatron_grad_tolerance gives the bound Megatron's
own test of gradients uses, growing with the depth the gradient went back through. Compare your
low-precision gradient, cast to float64, with ours relative to the tensor's scale:

    bound = megatron_grad_tolerance(torch.bfloat16, n_layers=L, layer=l)
    assert_close(got.double(), want, rtol=bound, atol=bound * want.abs().max().item())
"""
import math
from dataclasses import dataclass, field

import torch

from plumbing.launch import RankFailure  # noqa: F401 (what run_ranks raises, re-exported)

# Collectives time out after 20 s and a whole run_ranks after 80 s: the project's own test harness's
# figures (tests/conftest.py), where a test's body takes a second or two on a shared 2-core machine.
COLLECTIVE_TIMEOUT_S = 20.0
DEADLINE_S = 80.0

# (rtol, atol) by dtype: |got - want| <= atol + rtol * |want|, element by element.
# - float64: rtol 1e-10, the project's parity tolerance (tests/conftest.py's TOL); the sums of a
#   parallel layout and of the serial model differ in order only, ~1e-14 relative. atol 1e-12 (~4500
#   eps) is the floor for what is exactly 0 in math: k.bias's gradient (softmax is shift-invariant)
#   comes out as 1e-17 noise on both sides, a 100% relative "error" that is none, and stays far above
#   it: a real error of an O(1) gradient is caught by rtol, and one of a gradient that should be 0
#   is 1e-12 only if it is a millionth of the others' scale.
# - float32, bfloat16, float16: the same shape, scaled by the dtype (rtol ~100 eps, atol rtol / 100),
#   for two runs of the same dtype (yours against yours); against our float64, cast to float64 and
#   use megatron_grad_tolerance.
# - integers and bool: exact.
TOLERANCES = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-5, 1e-7), torch.bfloat16: (1.6e-2, 1.6e-4),
              torch.float16: (1e-3, 1e-5)}


def tolerances(dtype):
    """The default (rtol, atol) for dtype: TOLERANCES above, exact (0, 0) for integers and bool."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        eps = torch.finfo(dtype).eps
        return 100 * eps, eps
    return 0.0, 0.0


def megatron_grad_tolerance(dtype, n_layers, layer, k=4.0, c=1.03):
    """Megatron's bound on the relative error of a gradient computed in dtype: k * C**(L + 1 - l) * eps,
    with eps the dtype's machine epsilon (torch.finfo: 2**-7 for bf16, 2**-23 for fp32), L = n_layers
    transformer layers and l = layer the parameter's place counted from the input: 0 the embeddings,
    1..L the layers, L + 1 the final LayerNorm and the head. A gradient goes back through L + 1 - l
    layers, each of which may grow its error by C. k = 4 and C = 1.03 are Megatron Core's
    (tests/unit_tests/.../test_optimizer_grads_match.py, citing arXiv 2506.09280, Thm 5.3); at L = 32
    the embeddings' bound is about 0.083 in bf16 and 1.3e-6 in fp32. A bound for a low-precision run
    against a float64 reference, applied relative to the tensor's scale (this module's docstring); two
    float64 runs are compared with the exact defaults instead."""
    if not (isinstance(n_layers, int) and n_layers >= 0 and isinstance(layer, int) and 0 <= layer <= n_layers + 1):
        raise ValueError(f"megatron_grad_tolerance: layer={layer!r} must be a whole number from 0 (the embeddings) "
                         f"to n_layers + 1 = {n_layers + 1 if isinstance(n_layers, int) else '?'} (the head), "
                         f"and n_layers={n_layers!r} at least 0")
    return k * c ** (n_layers + 1 - layer) * torch.finfo(dtype).eps


def run_ranks(fn, n, *args, timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=DEADLINE_S):
    """fn(env, *args) on n gloo CPU ranks forked for this call (plumbing.launch's launch, mode "local":
    whatever RANK or WORLD_SIZE the CI job exports); every rank's result in rank order (each must
    pickle). A rank that raises or dies is a RankFailure carrying that rank's traceback (its sentence,
    for a ValueError); a collective that waits longer than timeout_s, or a run longer than deadline_s,
    fails the same way and names the rank the others waited for: nothing hangs. fn may be a closure."""
    from plumbing.launch import launch
    return launch(fn, n, *args, timeout_s=timeout_s, deadline_s=deadline_s, mode="local")


# ----------------------------------------------------------------------------------------------
# Comparing tensors and state dicts.

@dataclass
class Entry:
    """One tensor's comparison. problem: why it could not be compared (shapes, dtypes), else None.
    ratio: the worst element's |got - want| / (atol + rtol |want|), the entry fails above 1 (inf for a
    NaN, or for any difference under a zero tolerance); worst: that element's index, got and want;
    rel: max |got - want| / max |want|, the project's max_rel_diff, for reading."""
    name: str
    rtol: float
    atol: float
    numel: int = 0
    failed: int = 0
    ratio: float = 0.0
    worst: tuple = ()
    got: float = 0.0
    want: float = 0.0
    rel: float = 0.0
    problem: str = None

    @property
    def ok(self):
        return self.problem is None and self.failed == 0

    def sentence(self):
        if self.problem:
            return f"{self.name}: {self.problem}"
        if self.ok:
            return (f"{self.name}: within atol={self.atol:g} + rtol={self.rtol:g} * |want| ({self.numel} elements, the "
                    f"worst at {self.ratio:.2g} x its tolerance)")
        return (f"{self.name}: {self.failed} of {self.numel} elements differ beyond atol={self.atol:g} + rtol="
                f"{self.rtol:g} * |want|; the worst, at {list(self.worst)}: got {self.got!r}, want {self.want!r} "
                f"(|diff| {abs(self.got - self.want):.3g}"
                f", {self.ratio:.3g} x its tolerance; max |diff| / max |want| = {self.rel:.3g})")


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def compare(got, want, rtol=None, atol=None, name="tensor"):
    """The Entry of got against want: assert_close's work, without raising."""
    got, want = _as_tensor(got), _as_tensor(want)
    default = tolerances(want.dtype)
    rtol, atol = (default[0] if rtol is None else rtol), (default[1] if atol is None else atol)
    entry = Entry(name, rtol, atol, numel=want.numel())
    if got.dtype != want.dtype:
        entry.problem = (f"got is {got.dtype} and want is {want.dtype}: compare in one dtype (cast one on purpose, "
                         f"e.g. got.double(), and choose the tolerance for it)")
    elif got.shape != want.shape:
        entry.problem = (f"got has shape {tuple(got.shape)} and want {tuple(want.shape)}: shapes must be equal "
                         f"(broadcasting would compare a (4, 1) tensor with a (4,) one)")
    if entry.problem or want.numel() == 0:
        return entry
    wide = torch.complex128 if want.dtype.is_complex else torch.float64  # exact for every dtype's values
    g0, w0 = got.detach().cpu(), want.detach().cpu()
    g, w = g0.to(wide), w0.to(wide)
    diff = torch.where(g == w, 0.0, (g - w).abs())  # equal entries, infinities included: 0
    diff = torch.where(g.isnan() | w.isnan(), math.inf, diff)  # a NaN is never equal, not even to a NaN
    allowed = atol + rtol * w.abs()
    ratio = torch.where(diff == 0, 0.0, torch.where(allowed > 0, diff / allowed, math.inf))
    entry.failed = int((ratio > 1).sum())
    flat = int(ratio.reshape(-1).argmax())
    entry.ratio = float(ratio.reshape(-1)[flat])
    entry.worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape)) if w.dim() else ()
    entry.got, entry.want = g0.reshape(-1)[flat].item(), w0.reshape(-1)[flat].item()  # in their own dtype
    finite = w[w.isfinite()].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    worst_diff = float(diff.max())  # inf for a NaN
    entry.rel = 0.0 if worst_diff == 0 else worst_diff / scale if scale > 0 else math.inf
    return entry


def assert_close(got, want, rtol=None, atol=None, name="tensor"):
    """Every element of got within atol + rtol * |want| of want's (equal infinities are equal; a NaN on
    either side is a difference), else an AssertionError naming the worst element and how far it is.
    rtol, atol: by default tolerances(want.dtype), whose atol is the floor under what is 0 in math (both
    sides' rounding noise of an exactly-zero gradient pass). A different dtype or shape is refused with a
    sentence: cast on purpose, never broadcast. got and want may be on different devices. Returns the
    Entry (its worst element and ratio) when it passes."""
    entry = compare(got, want, rtol, atol, name)
    if not entry.ok:
        raise AssertionError(entry.sentence())
    return entry


@dataclass
class StateReport:
    """compare_state's result: entries (one per key in both, in want's order), missing (in want, not in
    got) and extra (in got, not in want) keys. str() is the report: a headline, the worst entries (the
    failing ones first, by how far beyond their tolerance), the missing and extra keys."""
    entries: list
    missing: list = field(default_factory=list)
    extra: list = field(default_factory=list)
    shown: int = 5

    @property
    def ok(self):
        return not self.missing and not self.extra and all(e.ok for e in self.entries)

    @property
    def failed(self):
        return [e for e in self.entries if not e.ok]

    def worst(self, n=None):
        """The entries, the worst first: those that could not be compared, then by ratio."""
        ranked = sorted(self.entries, key=lambda e: (e.problem is None, -e.ratio))
        return ranked if n is None else ranked[:n]

    def __str__(self):
        bad = self.failed
        head = (f"compare_state: {len(bad)} of {len(self.entries)} entries differ" if bad else
                f"compare_state: all {len(self.entries)} entries in both are within their tolerance")
        head += f"; {len(self.missing)} missing from got, {len(self.extra)} extra in got"
        lines = [head]
        worst = self.worst(max(self.shown, len(bad)) if len(bad) <= 3 * self.shown else self.shown)
        if worst:
            lines.append("the worst entries:" if bad else "the closest to their tolerance:")
            lines += [f"  {'FAIL' if not e.ok else 'ok  '} {e.sentence()}" for e in worst]
            if len(bad) > len(worst):
                lines.append(f"  ... and {len(bad) - len(worst)} more failing entries (report.failed)")
        if self.missing:
            lines.append(f"missing from got (in want): {', '.join(self.missing)}")
        if self.extra:
            lines.append(f"extra in got (not in want): {', '.join(self.extra)}")
        return "\n".join(lines)


def compare_state(got, want, rtol=None, atol=None, check=True):
    """Two state dicts (any mapping of names to tensors: a model's state_dict(), {name: grad}, our full
    state dict), key by key with assert_close's rule and tolerances (rtol, atol: one for every key, by
    default each tensor's dtype's). Returns the StateReport; with check=True (the default) an
    AssertionError carrying the report is raised instead when any entry differs, cannot be compared,
    or a key is missing or extra."""
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    entries = [compare(got[k], want[k], rtol, atol, name=str(k)) for k in want if k in got]
    report = StateReport(entries, [str(k) for k in missing], [str(k) for k in extra])
    if check and not report.ok:
        raise AssertionError(str(report))
    return report
