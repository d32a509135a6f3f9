"""GPT-2 weights in and out: Hugging Face's GPT2LMHeadModel layout, and plain state dicts.

    import_gpt2(path, cfg=None) -> (GPTConfig, full state dict, tokenizer or None)
        a local directory with config.json and model.safetensors (needs the optional safetensors
        package) or pytorch_model.bin; or a .pt written by 05's --export-state-dict (cfg: the
        model flags, which a .pt without its own config must fit)
    check_full(cfg, full, what)     refuses a full state dict unlike cfg's model, naming key and shapes
    export_gpt2(cfg, full, out)     a directory GPT2LMHeadModel loads
    export_checkpoint(root, ...)    the newest checkpoint under root, as either or both

Every tensor read is checked: a float dtype, finite, and exactly the parameters the config
describes (no more, no fewer, each of its shape); each refusal names the file and the tensor. An
export writes only finite values, never over a file it reads, and replaces an existing file only
with --overwrite; each file appears whole (written beside it, then renamed).

Our parameter names are GPT2LMHeadModel's. Its four projection matrices are Conv1D weights, (in,
out), the transpose of nn.Linear's, so they are transposed on the way in and out; its causal-mask
buffers are skipped, and its output layer is tied to wte. Nothing is downloaded.
"""
import dataclasses
import importlib
import json
import os
import re

import torch

from plumbing import checks, paths
from plumbing.checkpoint import hold, latest_checkpoint, load_error, only_gpt2, read_checkpoint, unusable
from plumbing.tokenizer import TOKENIZERS

tensor_parallel = importlib.import_module("01_tensor_parallel")

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SHAPE_FIELDS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
# config.json fields whose other values change the function our GPT-2 computes: each must be
# absent (Hugging Face's default is ours) or one of these values.
OURS = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
        "tie_word_embeddings": (True,), "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
        "add_cross_attention": (False,), "n_inner": (None,), "model_type": ("gpt2",)}


def config_from_hf(hf, file):
    """01's GPTConfig from a GPT-2 config.json, refusing every field at a value we do not implement."""
    if not isinstance(hf, dict):
        raise ValueError(f"{file} is not a JSON object")
    for k in SHAPE_FIELDS:
        if not (isinstance(hf.get(k), int) and not isinstance(hf.get(k), bool) and hf[k] >= 1):
            raise ValueError(f"{file}: {k} must be a positive integer, got {hf.get(k, 'nothing')!r}")
    if hf["n_embd"] % hf["n_head"]:  # invisible in the weights' shapes, but every head would be cut wrong
        raise ValueError(f"{file}: n_embd={hf['n_embd']} is not divisible by n_head={hf['n_head']}, so its "
                         f"attention heads do not fit the weights")
    for k, values in OURS.items():
        n_inner = k == "n_inner" and hf.get(k) == 4 * hf["n_embd"]  # GPT-2's own MLP width, written out
        if k in hf and hf[k] not in values and not n_inner:
            raise ValueError(f"{file}: {k}={hf[k]!r} is not supported (this GPT-2 implements "
                             f"{' or '.join(map(repr, values))}): its logits would differ")
    cfg = tensor_parallel.GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                                    n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0)
    too_large = _too_large(cfg, dict(block_size="n_positions"))
    if too_large:
        raise ValueError(f"{file}: {too_large}")
    return cfg


MAX_ELEMENTS = 2**60  # more elements than this, and a tensor's size in bytes overflows torch's int64


def _too_large(cfg, names=None):
    """Which size field makes one of cfg's tensors too large to exist, in words, or None: a model
    torch cannot even describe (its storage size overflows) is refused by the field, not by torch.
    names: the fields' names in the file (config.json's n_positions for block_size)."""
    names = names or {}
    C = cfg.n_embd
    for field, what, numel in (("n_embd", "MLP weight of 4 n_embd x n_embd", 4 * C * C),
                               ("vocab_size", "token embedding of vocab_size x n_embd", cfg.vocab_size * C),
                               ("block_size", "position embedding of n_positions x n_embd", cfg.block_size * C)):
        if numel > MAX_ELEMENTS:
            return (f"{names.get(field, field)}={getattr(cfg, field)} makes its {what} hold {numel:,} elements, more "
                    f"than any tensor can ({MAX_ELEMENTS:,}): not a GPT-2 that can exist")
    return None


def import_gpt2(path, cfg=None):
    """(GPTConfig, full state dict, tokenizer) from a local GPT-2 directory (config.json with
    model.safetensors or pytorch_model.bin) or from a plain serial state dict file (.pt) of our own
    names. The tokenizer ("bytes", "gpt2", "ids") is known only for a .pt that records it. A .pt
    without a config is checked against cfg (the model flags), and its GPTConfig is None."""
    if os.path.isfile(path):
        return _import_state_dict(path, cfg)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--init-from {path}: it is {paths.describe(path)}, not a .pt file or a GPT-2 directory")
    if not os.path.isdir(path):
        raise ValueError(f"--init-from {path}: no such file or directory")
    if paths.is_checkpoint(path) or latest_checkpoint(path):
        raise ValueError(f"--init-from {path}: this is a checkpoint of this trainer (step_N with its manifest.json), "
                         f"not a GPT-2 directory: use --resume {path} to continue it")
    config = os.path.join(path, "config.json")
    try:
        paths.regular_file(config, "--init-from's config")
        with open(config) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} has no readable config.json: {e}") from None
    cfg = config_from_hf(hf, config)
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"{st} needs the safetensors package (pip install safetensors)") from None
        weights, raw = st, _load(st, load_file)
    elif os.path.exists(pt):
        weights, raw = pt, _load(pt, lambda f: torch.load(f, map_location="cpu", weights_only=True))
    else:
        raise ValueError(f"{path} holds no weights: neither model.safetensors nor pytorch_model.bin")
    return cfg, full_from_hf(raw, cfg, weights, path), None


def full_from_hf(raw, cfg, weights, path, config="its config.json"):
    """Our full state dict from GPT2LMHeadModel's (or GPT2Model's, unprefixed) tensors, checked to be
    exactly cfg's GPT-2: the Conv1D weights transposed, the causal-mask buffers skipped, lm_head.weight
    (tied) checked equal to wte and dropped. weights, path: the names the refusals give (the weight file,
    its directory); config: what cfg is, in words. megatron_scratch.convert.from_hf calls it in memory."""
    full, head = {}, None
    for key, value in raw.items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
            continue
        _check_weight(weights, key, value)
        if name == "lm_head.weight":
            head = value  # tied to wte: checked equal below
        else:
            full[name] = value.t().contiguous() if name.endswith(CONV1D) else value
    wte = full.get("transformer.wte.weight")
    if head is not None and wte is not None and not torch.equal(head, wte):  # False for other shapes too
        raise ValueError(f"{path}: lm_head.weight differs from transformer.wte.weight; this GPT-2 ties its "
                         f"output layer to the token embedding and cannot represent an untied one")
    bad, extra = _misfits(cfg, full)
    if bad:
        raise ValueError(f"{path} does not fit {config}: " + "; ".join(bad[:5]))
    if extra:
        raise ValueError(f"{weights} holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which the GPT-2 "
                         f"of {config} (n_layer={cfg.n_layer}) does not have: the weights and the config do "
                         f"not belong together")
    return full


def hf_from_full(full):
    """GPT2LMHeadModel's tensors from our full state dict: the Conv1D weights transposed (new, contiguous
    tensors), lm_head.weight a copy of wte (tied); no causal-mask buffers. export_gpt2 writes them."""
    hf = {k: (v.t() if k.endswith(CONV1D) else v).contiguous() for k, v in full.items()}
    hf["lm_head.weight"] = full["transformer.wte.weight"].clone()
    return hf


def _check_weight(file, name, value):
    """A weight must be a floating-point tensor of finite values: integers or booleans are not
    weights (they would be cast silently), and one NaN or inf ends a run in skipped steps."""
    if not value.is_floating_point():
        raise ValueError(f"{file}: {name} is {value.dtype}, not floating-point weights")
    why = unusable(value)
    if why:
        raise ValueError(f"{file}: {name} {why}; weights must be finite numbers")


def _misfits(cfg, full):
    """What in `full` does not fit cfg's GPT-2: (each parameter missing or of another shape, the
    names it has beyond them)."""
    held = 1 + max((int(m[1]) for n in full if (m := re.match(r"transformer\.h\.(\d+)\.", n))), default=-1)
    if cfg.n_layer > held:  # said before a model of n_layer blocks is built (2**31 of them would never finish)
        return [f"n_layer={cfg.n_layer}, but the weights hold {held} layer{'s' if held != 1 else ''} "
                f"(transformer.h.0 to h.{held - 1})" if held else f"n_layer={cfg.n_layer}, but the weights hold no layer"], []
    want = {n: p.shape for n, p in tensor_parallel.GPT(cfg, device="meta").named_parameters()}
    bad = [f"{n}: {tuple(full[n].shape) if torch.is_tensor(full.get(n)) else 'missing'} instead of {tuple(s)}"
           for n, s in want.items() if not torch.is_tensor(full.get(n)) or full[n].shape != s]
    return bad, sorted(set(full) - set(want))


def check_full(cfg, full, what):
    """Refuse a full (serial) state dict that does not fit cfg's GPT-2, naming each key that is missing or
    of another shape (with both shapes) and each key beyond them: before anything is built or sent."""
    if not isinstance(full, dict):
        raise TypeError(f"{what}: a {type(full).__name__}, not a state dict (parameter names to tensors)")
    bad, extra = _misfits(cfg, full)
    if bad or extra:
        more = [f"and {len(bad) - 5} more"] if len(bad) > 5 else []
        raise ValueError(f"{what} does not fit the model ({cfg}): "
                         + "; ".join(bad[:5] + more + ([f"unexpected {extra}"] if extra else [])))


def _load(file, read):
    try:
        raw = read(file)
    except Exception as e:  # a truncated or garbage file: torch and safetensors raise many kinds
        raise ValueError(f"{file} cannot be read as weights: {type(e).__name__}: {load_error(e)}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in raw.items()):
        raise ValueError(f"{file} is not a state dict (names to tensors)")
    return raw


def _import_state_dict(path, flags_cfg=None):
    """A .pt that --export-state-dict wrote: our names, with its config and tokenizer. Without a
    config its weights must fit flags_cfg, the model flags (when given)."""
    try:
        paths.regular_file(path, "--init-from")
        full = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--init-from {path}: not a state dict that --export-state-dict writes "
                         f"({type(e).__name__}: {load_error(e)})") from None
    if not isinstance(full, dict):
        raise ValueError(f"--init-from {path}: holds a {type(full).__name__}, not a state dict")
    cfg = None
    if "_config" in full:
        fields = {f.name for f in dataclasses.fields(tensor_parallel.GPTConfig)}
        config = full.pop("_config")
        if not isinstance(config, dict) or set(config) != fields:
            got = sorted(config) if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"--init-from {path}: its _config is not a GPTConfig (want the fields {sorted(fields)}, "
                             f"got {got})")
        wrong = [f"{k} must be {p}, got {v!r}" for k, v in config.items()
                 if (p := checks.value_problem(tensor_parallel.GPTConfig, k, v))]
        if not wrong and config["n_embd"] % config["n_head"]:
            wrong = [f"n_embd={config['n_embd']} is not divisible by n_head={config['n_head']}"]
        if not wrong and _too_large(tensor_parallel.GPTConfig(**config)):
            wrong = [_too_large(tensor_parallel.GPTConfig(**config))]
        if wrong:
            raise ValueError(f"--init-from {path}: its _config is malformed: " + "; ".join(wrong))
        cfg = tensor_parallel.GPTConfig(**config)
    tokenizer = full.pop("_tokenizer", None)
    if tokenizer is not None and tokenizer not in TOKENIZERS:
        raise ValueError(f"--init-from {path}: its _tokenizer {tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    for name, value in full.items():
        if not isinstance(name, str):
            raise ValueError(f"--init-from {path}: it has the key {name!r} ({type(name).__name__}) where a state "
                             f"dict has parameter names (text): not a state dict (names to tensors)")
        if not torch.is_tensor(value):
            raise ValueError(f"--init-from {path}: {name!r} is {type(value).__name__}, not a tensor: not a state dict "
                             f"(names to tensors)")
        _check_weight(path, name, value)
    fit = cfg if cfg is not None else flags_cfg
    bad, extra = _misfits(fit, full) if fit is not None else ([], [])
    if bad or extra:
        whose = "its own config" if cfg is not None else "the model flags (it holds no config of its own)"
        raise ValueError(f"--init-from {path} does not fit {whose}: "
                         + "; ".join(bad[:3] or [f"unexpected {extra[:3]}"]))
    return cfg, full, tokenizer


def export_gpt2(cfg, full, out, overwrite=False):
    """Write a full state dict in GPT2LMHeadModel's layout, with its config.json. Refuses a
    non-finite value, and files already in `out` unless overwrite; then the weight file of the
    other format is removed too, so that a reader cannot take a stale one."""
    _check_finite(full, f"the export to {out}")
    names = ("config.json", "model.safetensors", "pytorch_model.bin")
    paths.check_outputs([("--export-hf", os.path.join(out, n)) for n in names], overwrite=overwrite)
    make_dir(out, "--export-hf")  # our names are GPT2LMHeadModel's; only Conv1D is transposed
    hf = hf_from_full(full)
    eos = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                  n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd,
                  n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=None, activation_function="gelu_new",
                  layer_norm_epsilon=1e-5, tie_word_embeddings=True, scale_attn_weights=True,
                  scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                  add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                  attn_pdrop=cfg.dropout, initializer_range=0.02, bos_token_id=eos, eos_token_id=eos,
                  use_cache=True)  # complete: nothing left to a default
    _replace(os.path.join(out, "config.json"), lambda f: f.write(json.dumps(config, indent=1).encode()))
    try:
        from safetensors.torch import save as safetensors_bytes
        written, stale = "model.safetensors", "pytorch_model.bin"
        _replace(os.path.join(out, written), lambda f: f.write(safetensors_bytes(hf)))
    except ImportError:
        written, stale = "pytorch_model.bin", "model.safetensors"
        _replace(os.path.join(out, written), lambda f: torch.save(hf, f))
    if os.path.lexists(os.path.join(out, stale)):  # allowed above only with overwrite
        os.remove(os.path.join(out, stale))


def make_dir(out, name):
    """The directory an export writes into, made if missing; one that cannot be made (a parent that
    is a file, or missing under /proc; no permission) is a sentence naming the flag."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name} {out}: cannot make the directory ({e.strerror or e}"
                         f"{': ' + e.filename if e.filename and e.filename != out else ''})") from None


def export_state_dict(cfg, full, tokenizer, out, overwrite=False):
    """The serial state dict with its config and tokenizer, as --init-from reads it back."""
    _check_finite(full, f"the export to {out}")
    paths.check_outputs([("--export-state-dict", out)], overwrite=overwrite)
    _replace(out, lambda f: torch.save({**full, "_config": dataclasses.asdict(cfg), "_tokenizer": tokenizer}, f))


def _check_finite(full, what):
    bad = [name for name, t in full.items() if t.is_floating_point() and unusable(t)]
    if bad:
        raise ValueError(f"not writing {what}: {', '.join(bad[:3])} hold non-finite values; an export holds only "
                         f"finite numbers")


def _replace(path, write):
    """Write path whole or not at all: into a file beside it, then renamed over it (so a link at
    path is replaced, not followed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    made = False
    try:
        with paths.create_new(tmp, "wb") as f:  # a file or link planted under the name is never written
            made = True
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if made and os.path.lexists(tmp):
            os.remove(tmp)


def export_checkpoint(root, hf_dir=None, state_dict_path=None, overwrite=False):
    """05's --export-hf / --export-state-dict: the newest checkpoint under root, in any layout,
    written as a GPT-2 directory, as a plain serial state dict (with its config and tokenizer), or
    both. Offline: the shards are read, nothing is launched. Every output is checked against the
    checkpoint's own files first: an export never writes into the checkpoint it reads."""
    path = latest_checkpoint(root, flag="--resume") if root else None
    if not path:
        raise ValueError(f"exporting needs --resume DIR with a complete checkpoint; got {root!r}")
    hold(path)  # read under a shared lock: another run's --keep rotation leaves it
    only_gpt2(path, "--export-hf" if hf_dir else "--export-state-dict")  # GPT-2's formats hold no experts
    if hf_dir and os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ValueError(f"--export-hf {hf_dir}: it is {paths.describe(hf_dir) or 'a file'}, not a directory")
    if hf_dir:
        paths.refuse_source_directory(hf_dir, "--export-hf")
    outputs = [("--export-hf", os.path.join(hf_dir, n)) for n in ("config.json", "model.safetensors",
                                                                     "pytorch_model.bin")] if hf_dir else []
    outputs += [("--export-state-dict", state_dict_path)] if state_dict_path else []
    reads = [("--resume", os.path.join(path, n)) for n in sorted(os.listdir(path))]
    paths.check_outputs(outputs, reads, [("--resume", path, None)], overwrite)
    if hf_dir:
        make_dir(hf_dir, "--export-hf")  # before the shards are read, which may take minutes
    manifest, full, _ = read_checkpoint(path)
    cfg = tensor_parallel.GPTConfig(**manifest["model"])
    if hf_dir:
        export_gpt2(cfg, full, hf_dir, overwrite)
        print(f"exported step {manifest['step']} of {path} to {hf_dir}")
    if state_dict_path:
        export_state_dict(cfg, full, manifest.get("tokenizer"), state_dict_path, overwrite)
        print(f"exported step {manifest['step']} of {path} to {state_dict_path}")
