"""One drafter's weights written as each trainer / engine publishes it (fields from their public
code, docs/adoption.md): z-lab, DeepSpec, speculators, vLLM/SGLang, Automodel. Each writer takes
a z-lab drafter directory and the target whose embedding / LM head DeepSpec and speculators ship."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _read(zdir: Path) -> tuple[dict, dict]:
    return json.loads((zdir / "config.json").read_text()), load_file(str(zdir / "model.safetensors"))


def _write(out: Path, cfg: dict, tensors: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _decoder(cfg: dict) -> dict:
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act",
            "attention_bias", "layer_types", "sliding_window", "torch_dtype")
    return {k: cfg[k] for k in keep if k in cfg and cfg[k] is not None}


def vocab_copies(target) -> dict:
    return {"embed_tokens.weight": target.parts.embed_tokens.weight.detach().clone(),
            "lm_head.weight": target.parts.lm_head.weight.detach().clone()}


def deepspec(zdir: Path, out: Path, target, **extra) -> Path:
    """DeepSpec's DSpark with markov_rank 0: ids, mask and block at the top, its own frozen
    embed_tokens / lm_head, HF save_pretrained names (`model.` prefix)."""
    cfg, tensors = _read(zdir)
    d = {**_decoder(cfg), "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
         "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
         "mask_token_id": cfg["dflash_config"]["mask_token_id"],
         "block_size": cfg["block_size"], "num_target_layers": cfg["num_target_layers"], "num_anchors": 512,
         "markov_rank": 0, **extra}
    own = {f"model.{k}": v for k, v in tensors.items()}
    own["model.embed_tokens.weight"] = vocab_copies(target)["embed_tokens.weight"]
    own["lm_head.weight"] = vocab_copies(target)["lm_head.weight"]
    return _write(out, d, own)


def speculators(zdir: Path, out: Path, target, **extra) -> Path:
    """vllm-project/speculators' DFlash: decoder in transformer_layer_config, aux ids = z-lab + 1."""
    cfg, tensors = _read(zdir)
    d = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
         "transformer_layer_config": {**_decoder(cfg), "model_type": "qwen3"},
         "draft_vocab_size": cfg["vocab_size"], "block_size": cfg["block_size"],
         "aux_hidden_state_layer_ids": [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]],
         "mask_token_id": cfg["dflash_config"]["mask_token_id"], "target_hidden_size": cfg["hidden_size"],
         "speculators_version": "0.3.0",
         "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}},
         **extra}
    return _write(out, d, {**tensors, **vocab_copies(target)})


def vllm(zdir: Path, out: Path, target=None, **extra) -> Path:
    """What vLLM / SGLang read: eagle_aux_hidden_state_layer_ids (+1), fused qkv / gate_up weights."""
    cfg, tensors = _read(zdir)
    ids = cfg["dflash_config"].pop("target_layer_ids")
    d = {**cfg, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids], "is_neox_style": True,
         "dflash_config": {**cfg["dflash_config"], "attention_sink_bias": False}, **extra}
    fused = {}
    for layer in sorted({k.split(".")[1] for k in tensors if k.startswith("layers.")}):
        b = f"layers.{layer}."
        fused[b + "self_attn.qkv_proj.weight"] = torch.cat([tensors.pop(b + f"self_attn.{p}_proj.weight")
                                                           for p in "qkv"])
        fused[b + "mlp.gate_up_proj.weight"] = torch.cat([tensors.pop(b + f"mlp.{p}_proj.weight") for p in ("gate",
                                                                                                            "up")])
    return _write(out, d, {**tensors, **fused})


def automodel(zdir: Path, out: Path, target=None, **extra) -> Path:
    """NeMo Automodel: ids / mask / block in dflash_config, projector_type, draft_sliding_window."""
    cfg, tensors = _read(zdir)
    d = {k: v for k, v in cfg.items() if k not in ("block_size", "layer_types", "sliding_window", "use_sliding_window")}
    d["dflash_config"] = {**cfg["dflash_config"], "block_size": cfg["block_size"], "projector_type": "linear"}
    d.update(extra)
    return _write(out, d, {f"draft_model.{k}": v for k, v in tensors.items()})


def zlab_copy(zdir: Path, out: Path, target=None) -> Path:
    shutil.copytree(zdir, out)
    return out


WRITERS = {"deepspec": deepspec, "speculators": speculators, "vllm": vllm, "automodel": automodel}
