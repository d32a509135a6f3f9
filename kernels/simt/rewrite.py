"""The rewriter: a .cu (or .cuh) as g++ can compile it against kernels/simt/simt.h, changing only
what g++ cannot parse, on the same lines (so #line 1 keeps every error, sanitizer report and
fault sentence on the original file and line):

    kernel<<<grid, block, bytes, stream>>>(args)    kernel | ::simt::Config(grid, block, bytes, stream)(args)
    __shared__ T name[N];                           ::simt::id<T[N]>& name = ::simt::static_shared<T[N]>(k);
    extern __shared__ T name[];                     T* name = ::simt::dynamic_shared<T>();
    __global__ ... kernel(...) {                    ... kernel(...) { if (::simt::kernel_entry<T[N], ...>()) return;

kernel_entry lists the kernel's static __shared__ declarations, so a launch can learn the kernel's
static shared memory (as cudaFuncGetAttributes reads it from a cubin) before it runs a thread.
Everything else (qualifiers, intrinsics, the built-in variables) is a macro of simt.h.
"""
import re


class RewriteError(ValueError):
    """Source the rewriter cannot take; the sentence names the file and line."""


def _masked(text):
    """text with every comment and string or character literal blanked (newlines kept), so that
    the searches below see code only, at the same offsets."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _matching(code, start, open_, close):
    """The index of the bracket closing the one at code[start]."""
    depth = 0
    for i in range(start, len(code)):
        if code[i] == open_:
            depth += 1
        elif code[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise RewriteError(f"an unclosed {open_!r}")


def _line(text, offset):
    return text.count("\n", 0, offset) + 1


SHARED = re.compile(r"(?P<extern>\bextern\s+)?\b__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?"
                    r"(?P<type>[A-Za-z_][\w:<>,\s*]*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*(?P<ext>(?:\[[^\]]*\]\s*)*);")


def rewrite(text, path):
    """The g++-ready text of one .cu or .cuh file; path: the original, named by #line."""
    code = _masked(text)
    edits = []  # (start, end, replacement), non-overlapping

    def where(offset):
        return f"{path}:{_line(text, offset)}"

    # Launches: the first >>> after each <<<.
    for m in re.finditer(r"<<<", code):
        end = code.find(">>>", m.end())
        if end < 0:
            raise RewriteError(f"{where(m.start())}: a launch's <<< without its >>>")
        edits.append((m.start(), m.end(), " | ::simt::Config("))
        edits.append((end, end + 3, ")"))

    # Kernels and the shared memory they declare.
    spans = []  # the __shared__ declarations taken
    for m in re.finditer(r"\b__global__\b", code):
        paren = code.find("(", m.end())
        close = _matching(code, paren, "(", ")")
        rest = re.match(r"\s*([{;])", code[close + 1:])
        if not rest or rest[1] == ";":
            continue  # a declaration
        body = close + 1 + rest.start(1)
        body_end = _matching(code, body, "{", "}")
        types = []
        for d in SHARED.finditer(code, body, body_end):
            spans.append((d.start(), d.end()))
            type_, name, ext = " ".join(d["type"].split()), d["name"], "".join(d["ext"].split())
            if d["extern"]:
                if ext != "[]":
                    raise RewriteError(f"{where(d.start())}: extern __shared__ {name} must be declared {name}[]")
                new = f"{type_}* {name} = ::simt::dynamic_shared<{type_}>();"
            else:
                new = f"::simt::id<{type_}{ext}>& {name} = ::simt::static_shared<{type_}{ext}>({len(types)});"
                types.append(f"{type_}{ext}")
            edits.append((d.start(), d.end(), new + "\n" * text.count("\n", d.start(), d.end())))
        edits.append((body + 1, body + 1, f" if (::simt::kernel_entry<{', '.join(types)}>()) return;"))
    for m in re.finditer(r"\b__shared__\b", code):
        if not any(start <= m.start() < end for start, end in spans):
            raise RewriteError(f"{where(m.start())}: a __shared__ declaration the emulator cannot take: only "
                               f"`__shared__ T name[N];` and `extern __shared__ T name[];`, directly in a "
                               f"__global__ function's body")

    out, at = [], 0
    for start, end, new in sorted(edits):
        out += [text[at:start], new]
        at = end
    out.append(text[at:])
    return f'#line 1 "{path}"\n' + "".join(out)
