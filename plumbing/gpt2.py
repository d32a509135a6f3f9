"""GPT-2 weights in and out: Hugging Face's GPT2LMHeadModel layout, and plain state dicts.

    import_gpt2(path) -> (GPTConfig, full state dict, tokenizer or None)
        a local directory with config.json and model.safetensors (needs the optional safetensors
        package) or pytorch_model.bin; or a .pt written by 05's --export-state-dict
    export_gpt2(cfg, full, out)     a directory GPT2LMHeadModel loads
    export_checkpoint(root, ...)    the newest checkpoint under root, as either

Our parameter names are GPT2LMHeadModel's. Its four projection matrices are Conv1D weights, (in,
out), the transpose of nn.Linear's, so they are transposed on the way in and out; its causal-mask
buffers are skipped, and its output layer is tied to wte. Nothing is downloaded.
"""
import dataclasses
import importlib
import json
import os

import torch

from plumbing.checkpoint import latest_checkpoint, read_checkpoint

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
    for k, values in OURS.items():
        n_inner = k == "n_inner" and hf.get(k) == 4 * hf["n_embd"]  # GPT-2's own MLP width, written out
        if k in hf and hf[k] not in values and not n_inner:
            raise ValueError(f"{file}: {k}={hf[k]!r} is not supported (this GPT-2 implements "
                             f"{' or '.join(map(repr, values))}): its logits would differ")
    return tensor_parallel.GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                                     n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0)


def import_gpt2(path):
    """(GPTConfig, full state dict, tokenizer) from a local GPT-2 directory (config.json with
    model.safetensors or pytorch_model.bin) or from a plain serial state dict file (.pt) of our own
    names. The tokenizer ("bytes", "gpt2", "ids") is known only for a .pt that records it."""
    if os.path.isfile(path):
        return _import_state_dict(path)
    if not os.path.isdir(path):
        raise ValueError(f"--init-from {path}: no such file or directory")
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} has no readable config.json: {e}") from None
    cfg = config_from_hf(hf, os.path.join(path, "config.json"))
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"{st} needs the safetensors package (pip install safetensors)") from None
        raw = _load(st, load_file)
    elif os.path.exists(pt):
        raw = _load(pt, lambda f: torch.load(f, map_location="cpu", weights_only=True))
    else:
        raise ValueError(f"{path} holds no weights: neither model.safetensors nor pytorch_model.bin")
    full, head = {}, None
    for key, value in raw.items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if name == "lm_head.weight":
            head = value  # tied to wte: checked equal below
        elif not name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers
            full[name] = value.t().contiguous() if name.endswith(CONV1D) else value
    wte = full.get("transformer.wte.weight")
    if head is not None and wte is not None and not torch.equal(head, wte):  # False for other shapes too
        raise ValueError(f"{path}: lm_head.weight differs from transformer.wte.weight; this GPT-2 ties its "
                         f"output layer to the token embedding and cannot represent an untied one")
    bad = _misfits(cfg, full)[0]
    if bad:
        raise ValueError(f"{path} does not fit its config.json: " + "; ".join(bad[:5]))
    return cfg, full, None


def _misfits(cfg, full):
    """What in `full` does not fit cfg's GPT-2: (each parameter missing or of another shape, the
    names it has beyond them)."""
    want = {n: p.shape for n, p in tensor_parallel.GPT(cfg, device="meta").named_parameters()}
    bad = [f"{n}: {tuple(full[n].shape) if torch.is_tensor(full.get(n)) else 'missing'} instead of {tuple(s)}"
           for n, s in want.items() if not torch.is_tensor(full.get(n)) or full[n].shape != s]
    return bad, sorted(set(full) - set(want))


def _load(file, read):
    try:
        raw = read(file)
    except Exception as e:  # a truncated or garbage file: torch and safetensors raise many kinds
        raise ValueError(f"{file} cannot be read as weights: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in raw.items()):
        raise ValueError(f"{file} is not a state dict (names to tensors)")
    return raw


def _import_state_dict(path):
    """A .pt that --export-state-dict wrote: our names, with its config and tokenizer."""
    try:
        full = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--init-from {path}: not a state dict that --export-state-dict writes "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(full, dict):
        raise ValueError(f"--init-from {path}: holds a {type(full).__name__}, not a state dict")
    cfg = None
    if "_config" in full:
        try:
            cfg = tensor_parallel.GPTConfig(**full.pop("_config"))
        except TypeError as e:
            raise ValueError(f"--init-from {path}: its _config is not a GPTConfig ({e})") from None
    tokenizer = full.pop("_tokenizer", None)
    bad, extra = _misfits(cfg, full) if cfg is not None else ([], [])
    if bad or extra:
        raise ValueError(f"--init-from {path} does not fit its own config: "
                         + "; ".join(bad[:3] or [f"unexpected {extra[:3]}"]))
    return cfg, full, tokenizer


def export_gpt2(cfg, full, out):
    """Write a full state dict in GPT2LMHeadModel's layout, with its config.json."""
    os.makedirs(out, exist_ok=True)  # our names are GPT2LMHeadModel's; only Conv1D is transposed
    hf = {k: (v.t() if k.endswith(CONV1D) else v).contiguous() for k, v in full.items()}
    hf["lm_head.weight"] = full["transformer.wte.weight"].clone()
    eos = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    with open(os.path.join(out, "config.json"), "w") as f:  # complete: nothing left to a default
        json.dump(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                       n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=None, activation_function="gelu_new",
                       layer_norm_epsilon=1e-5, tie_word_embeddings=True, scale_attn_weights=True,
                       scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                       add_cross_attention=False, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                       attn_pdrop=cfg.dropout, initializer_range=0.02, bos_token_id=eos, eos_token_id=eos,
                       use_cache=True), f, indent=1)
    try:
        from safetensors.torch import save_file
        save_file(hf, os.path.join(out, "model.safetensors"))
    except ImportError:
        torch.save(hf, os.path.join(out, "pytorch_model.bin"))


def export_checkpoint(root, hf_dir=None, state_dict_path=None):
    """05's --export-hf / --export-state-dict: the newest checkpoint under root, in any layout,
    written as a GPT-2 directory or as a plain serial state dict (with its config and tokenizer).
    Offline: the shards are read, nothing is launched."""
    path = latest_checkpoint(root) if root else None
    if not path:
        raise ValueError(f"exporting needs --resume DIR with a complete checkpoint; got {root!r}")
    manifest, full, _ = read_checkpoint(path)
    cfg = tensor_parallel.GPTConfig(**manifest["model"])
    if hf_dir:
        export_gpt2(cfg, full, hf_dir)
    else:
        torch.save({**full, "_config": dataclasses.asdict(cfg), "_tokenizer": manifest.get("tokenizer")},
                   state_dict_path)
    print(f"exported step {manifest['step']} of {path} to {hf_dir or state_dict_path}")
