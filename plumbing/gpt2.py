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


def import_gpt2(path):
    """(GPTConfig, full state dict, tokenizer) from a local GPT-2 directory (config.json with
    model.safetensors or pytorch_model.bin) or from a plain serial state dict file (.pt) of our own
    names. The tokenizer ("bytes", "gpt2", "ids") is known only for a .pt that records it."""
    if os.path.isfile(path):
        full = torch.load(path, map_location="cpu", weights_only=True)
        cfg = tensor_parallel.GPTConfig(**full.pop("_config")) if "_config" in full else None
        return cfg, full, full.pop("_tokenizer", None)
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} has no readable config.json: {e}") from None
    cfg = tensor_parallel.GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                       n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0)
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"{st} needs the safetensors package (pip install safetensors)") from None
        raw = load_file(st)
    elif os.path.exists(pt):
        raw = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} holds no weights: neither model.safetensors nor pytorch_model.bin")
    full = {}
    for key, value in raw.items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers, and the output layer tied to wte
        full[name] = value.t().contiguous() if name.endswith(CONV1D) else value
    want = {n: p.shape for n, p in tensor_parallel.GPT(cfg, device="meta").named_parameters()}
    bad = [f"{n}: {tuple(full[n].shape) if n in full else 'missing'} instead of {tuple(s)}"
           for n, s in want.items() if n not in full or full[n].shape != s]
    if bad:
        raise ValueError(f"{path} does not fit its config.json: " + "; ".join(bad[:5]))
    return cfg, full, None


def export_gpt2(cfg, full, out):
    """Write a full state dict in GPT2LMHeadModel's layout, with its config.json."""
    os.makedirs(out, exist_ok=True)  # our names are GPT2LMHeadModel's; only Conv1D is transposed
    hf = {k: (v.t() if k.endswith(CONV1D) else v).contiguous() for k, v in full.items()}
    hf["lm_head.weight"] = full["transformer.wte.weight"].clone()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                       n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                       layer_norm_epsilon=1e-5, tie_word_embeddings=True), f, indent=1)
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
