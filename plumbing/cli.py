"""The command line, generated from the config dataclasses: one source for flags, defaults and help.

Every field of a config dataclass becomes a flag (`n_layer` -> `--n-layer`). Its help text is the
comment written after the field in the source, its default is the field's, and a field typed
`Literal["a", "b"]` offers exactly those choices. A field without a comment is refused when the
parser is built, so the help can never fall behind the config:

    @dataclass
    class TrainConfig:
        steps: int = 200  # optimizer steps
        dtype: Literal["auto", "float32"] = "auto"  # parameter dtype; auto: float32 on CPU

    parser = make_parser(__doc__)
    add_dataclass_args(parser, TrainConfig)
    tc = from_args(TrainConfig, parser.parse_args())

make_parser also makes the process's own output safe (guard_streams): a stdout or stderr that is
closed, full or whose reader went away never costs a run or its checkpoints.
"""
import argparse
import dataclasses
import inspect
import io
import os
import sys
import tokenize
import types
import typing

from plumbing import checks, paths


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default (an empty string shows as none, None as unset),
    unless the help already speaks of it; the description and the epilog keep their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, argparse._StoreTrueAction):
            return text  # it says its default itself, or has none worth saying
        shown = {None: "unset", "": "none"}.get(action.default, "%(default)s") \
            if isinstance(action.default, (str, type(None))) else "%(default)s"
        return f"{text} (default: {shown})"


def make_parser(doc, **kwargs):
    """A parser described by the script docstring's first line, with its "Run it:" paragraph (the
    commands to try) as the epilog. Every script makes one first: it guards the streams too."""
    guard_streams()
    paragraphs = doc.strip().split("\n\n")
    run = [p for p in paragraphs if p.startswith("Run it")]
    return argparse.ArgumentParser(description=paragraphs[0].split("\n")[0],
                                   epilog=run[0] if run else None, formatter_class=HelpFormatter,
                                   **kwargs)


# ----------------------------------------------------------------------------------------------
# The command's own output: what a run prints is never worth the run.


def guard_streams():
    """Make stdout and stderr safe to write, whatever the shell gave: a descriptor closed at start
    (`>&-`) is opened on /dev/null, so that no file or socket the run opens later takes its number
    and receives its output; a write that fails later (a reader gone, `| head`; a full disk,
    /dev/full) points the descriptor at /dev/null, says so once on stderr, and the run goes on.
    Streams another program replaced (a test's capture) are left alone. Idempotent."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        closed = _closed(fd)
        if closed:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if fd and getattr(sys, name) is None:  # closed when Python started: print() would say nothing...
            at = fd if closed else os.open(os.devnull, os.O_WRONLY)  # ...but flush() would raise
            setattr(sys, name, io.TextIOWrapper(io.FileIO(at, "w", closefd=False), line_buffering=True))
        stream = getattr(sys, name)
        if fd and type(stream) is io.TextIOWrapper and _fileno(stream) == fd:  # Python's own, or as it makes them
            setattr(sys, name, _Forgiving(stream, name))


def _closed(fd):
    try:
        os.fstat(fd)
        return False
    except OSError:
        return True


def _fileno(stream):
    try:
        return stream.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):
        return None


class _Forgiving:
    """sys.stdout or sys.stderr whose failure to write (EPIPE, ENOSPC, EBADF, EIO) costs nothing:
    its descriptor is pointed at /dev/null, where what was buffered goes too, and stderr is told
    once that stdout failed. Everything else is the stream's own."""

    def __init__(self, stream, name):
        self._stream, self._name, self._failed = stream, name, False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self._fail(e)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._fail(e)

    def _fail(self, error):
        fd = _fileno(self._stream)
        if fd is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        try:
            self._stream.flush()  # into /dev/null now; without a descriptor, the buffer is dropped below
        except (OSError, ValueError):
            pass
        if not self._failed and self._name == "stdout":
            print(f"note: stdout failed ({error.strerror or error}); the run goes on, printing nothing more there",
                  file=sys.stderr, flush=True)
        self._failed = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def field_comments(cls):
    """{field name: the comment after it in cls's source}, read with the tokenizer, so a '#' inside
    a string default is not mistaken for a comment. Cached by where the class is written (file,
    its modification time, qualified name, fields) rather than by the class object: a script run
    again in a forked process (runpy, as the tests do) makes new classes from the same source, and
    finding a class's source parses its whole file (most of a --help or a refused flag's time)."""
    try:
        file = inspect.getsourcefile(cls)
        key = (file, os.path.getmtime(file), cls.__qualname__, tuple(f.name for f in dataclasses.fields(cls)))
    except (TypeError, OSError):
        key = cls
    if key not in _COMMENTS:
        _COMMENTS[key] = _read_comments(cls)
    return _COMMENTS[key]


_COMMENTS = {}  # field_comments' cache


def _read_comments(cls):
    comments = {}
    for base in reversed(cls.__mro__[1:]):  # inherited fields keep their base class's comments
        if dataclasses.is_dataclass(base):
            comments.update(field_comments(base))
    line_field = {}
    names = {f.name for f in dataclasses.fields(cls)}
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline)
    previous = None
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string == ":" and previous is not None \
                and previous.type == tokenize.NAME and previous.string in names:
            line_field.setdefault(tok.start[0], previous.string)
        if tok.type == tokenize.COMMENT and tok.start[0] in line_field:
            comments[line_field[tok.start[0]]] = tok.string.lstrip("#").strip()
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            previous = tok
    return comments


def choices_of(field):
    """The values a Literal[...] field allows, or None."""
    return typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal else None


def add_dataclass_args(parser, cls, title=None, **defaults):
    """Add a --field-name option for every field of cls (defaults= overrides a field's default)."""
    target = parser.add_argument_group(title) if title else parser
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name not in comments:
            raise TypeError(f"{cls.__name__}.{f.name} has no comment: the comment is its --help text")
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        if typing.get_origin(f.type) is list:  # repeatable: each use adds one value
            target.add_argument(flag, action="append", default=[], metavar=f.name.upper(),
                                help=comments[f.name] + " (repeatable)")
        elif f.type in (bool, bool | None):  # None: decided at run time (say, by the device)
            target.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                                help=comments[f.name])
        else:
            kind = next((t for t in typing.get_args(f.type) if t is not type(None)), None) \
                if typing.get_origin(f.type) in (typing.Union, types.UnionType) else f.type
            kind = kind if kind in (int, float, str) else type(default)
            target.add_argument(flag, default=default, type=kind, choices=choices_of(f),
                                metavar=f.name.upper() if choices_of(f) is None else None,
                                help=comments[f.name])


def given(parser, argv=None):
    """The names (dests) of the options on the command line, whatever their value: parsed again
    into a namespace that already holds every name, which argparse then leaves alone unless the
    option is given (abbreviations and --flag=value included)."""
    # A repeatable flag's action appends to a copy of what the namespace holds: a list, then.
    unset = {a.dest: [] if isinstance(a, argparse._AppendAction) else object() for a in parser._actions
             if a.dest != argparse.SUPPRESS}
    parsed = parser.parse_args(argv, namespace=argparse.Namespace(**unset))
    return {name for name, value in vars(parsed).items() if value is not unset.get(name)}


def demo_parser(doc, demo_cls, model_cls, **model_defaults):
    """The parser of a numbered file's demo: its own flags, then the model's (defaults overridden),
    and --overwrite for the file a demo writes (its --trace), where it has one."""
    parser = make_parser(doc)
    add_dataclass_args(parser, demo_cls, "demo")
    if "trace" in {f.name for f in dataclasses.fields(demo_cls)}:
        parser.add_argument("--overwrite", action="store_true",
                            help="let --trace replace a file this run did not write")
    add_dataclass_args(parser, model_cls, "model", **model_defaults)
    parser.configs = demo_cls, model_cls
    return parser


def demo_args(parser, argv=None, train_parser=None, **resolve):
    """Parse a demo's flags, set each resolve[name](args) (a default that depends on other flags),
    and check every field and relation (plumbing.checks) before anything starts. Returns (the
    model's config, the parsed flags). train_parser: the chapter's --train flags (06, 07), so that
    one of them given without --train is named as such rather than as unknown."""
    if train_parser is not None:
        extra = parser.parse_known_args(argv)[1]
        for flag in (x.split("=")[0] for x in extra if x.startswith("--")):
            if flag in train_parser._option_string_actions:
                raise ValueError(f"{flag} is a flag of training, not of the demo: add --train "
                                 f"(python3 {parser.prog} --train {flag} ...)")
    args = parser.parse_args(argv)
    for name, value in resolve.items():
        setattr(args, name, value(args))
    demo_cls, model_cls = parser.configs
    cfg, demo = from_args(model_cls, args), from_args(demo_cls, args)
    checks.check_config(cfg, demo)
    if cfg.dropout:  # every demo holds its models to the serial one, which needs the same masks
        raise ValueError(f"--dropout {cfg.dropout:g}: the demo compares its models with the serial one exactly, and "
                         f"dropout draws other masks in other layouts; give 0 (05's trainer takes --dropout)")
    paths.check_outputs([("--trace", getattr(demo, "trace", ""))], overwrite=getattr(args, "overwrite", False))
    checks.check_paths(demo)
    return cfg, args


def from_args(cls, args):
    """The dataclass cls filled from parsed arguments."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
