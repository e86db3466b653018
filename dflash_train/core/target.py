"""Target models: loading, locating their parts, and the one feature-extraction path.

Trainer and worker both get context features from `Target.forward`: the outputs of the
configured decoder layers (HF `hidden_states[id + 1]`), concatenated on the last axis.
The decoder stack is found by structure, so wrapped vision-language targets
(`Qwen3_5ForConditionalGeneration`: text stack under `model.language_model`) work
the same as a plain `Qwen3ForCausalLM`: the seeds' harness hooked the wrong stack.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_train.common.errors import DFlashError

from . import cache_compat
from .config import DrafterConfig
from .fingerprint import FileDigests, FingerprintError, directory_state, tensor_digest

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TargetError(DFlashError, ValueError):
    """A target that cannot be used (not found, unknown layout, drafter mismatch)."""


@dataclass
class TargetParts:
    """The pieces of a causal LM that DFlash touches."""

    text_model: nn.Module  # decoder stack: .layers, .embed_tokens, .norm
    layers: nn.ModuleList
    embed_tokens: nn.Embedding
    final_norm: nn.Module
    lm_head: nn.Linear  # used as one: its weight is [vocab, hidden] and it maps final hiddens to logits
    text_config: Any


def locate_parts(model: nn.Module) -> TargetParts:
    """Find the text decoder stack, embedding, final norm and LM head of a HF model."""
    candidates = []
    for path in ("model.language_model", "language_model", "model.text_model", "model", ""):
        obj: nn.Module | None = model
        for attr in filter(None, path.split(".")):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None:
            candidates.append((path or "<root>", obj))
    for path, stack in candidates:
        layers = getattr(stack, "layers", None)
        embed = getattr(stack, "embed_tokens", None)
        norm = getattr(stack, "norm", None)
        if isinstance(layers, nn.ModuleList) and isinstance(embed, nn.Embedding) and norm is not None:
            get_head = getattr(model, "get_output_embeddings", None)  # a transformers model's
            head = get_head() if get_head is not None else None
            if head is None:
                head = getattr(model, "lm_head", None)
            if head is None:
                raise TargetError(f"{type(model).__name__} has a decoder stack at {path} but no LM head")
            cfg = getattr(stack, "config", None) or getattr(model.config, "text_config", None) or model.config
            return TargetParts(stack, layers, embed, norm, head, cfg)
    raise TargetError(
        f"cannot find the decoder stack of {type(model).__name__}: looked for .layers/.embed_tokens/.norm under "
        + ", ".join(p for p, _ in candidates))


@dataclass
class TargetOutput:
    features: torch.Tensor  # [batch, seq, n_layers * hidden]
    last_hidden: torch.Tensor  # [batch, seq, hidden], after the final norm (input of the LM head)
    past_key_values: Any = None


class Target:
    """A frozen target model with the DFlash view of it."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, source: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.source = source
        self.parts = locate_parts(model)
        self._fingerprint: str | None = None
        self._files_digest: str | None = None  # set by `load`: the digest of the directory it read

    # --- loading ----------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | None = None,
             device_map: str | dict | None = None, trust_remote_code: bool = False) -> Target:
        """Load a local HF causal LM (or conditional-generation wrapper) and its tokenizer.

        Never downloads: `path` must be a local directory.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise TargetError(f"{path} is not a model directory (no config.json)")
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        kwargs: dict[str, Any] = dict(dtype=torch_dtype, local_files_only=True, trust_remote_code=trust_remote_code)
        if device_map is not None:
            kwargs["device_map"] = device_map  # placement through accelerate
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        archs = getattr(config, "architectures", None) or []
        wrapped = any("ConditionalGeneration" in a for a in archs)
        loader = AutoModelForImageTextToText if wrapped else AutoModelForCausalLM
        before = directory_state(path)
        try:
            files = FileDigests().directory_digest(path)  # identity of exactly what is read below
            model = loader.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, FingerprintError) as e:
            raise TargetError(f"cannot load target from {path}: {e}") from e
        if directory_state(path) != before:
            raise TargetError(f"the files of {path} changed while the target was loading; load it again")
        if device is not None and device_map is None:
            module: nn.Module = model  # transformers' `to` wrapper has no signature mypy can bind; same call
            module.to(device)  # in place (a module's `to` returns itself)
        target = cls(model, tokenizer, source=str(path))
        target._files_digest = files
        return target

    # --- shape --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.parts.layers)

    @property
    def hidden_size(self) -> int:
        return self.parts.embed_tokens.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (the ids a drafter can embed, the mask token included)."""
        return self.parts.embed_tokens.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.parts.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.embed_tokens.weight.dtype

    def mask_token_id(self) -> int | None:
        tok = self.tokenizer
        if tok is None:
            return None
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        ids = tok.convert_tokens_to_ids(["<|MASK|>"])
        return None if ids[0] in (None, tok.unk_token_id) else int(ids[0])

    def check_drafter(self, cfg: DrafterConfig) -> None:
        """Raise a TargetError naming every way `cfg` does not fit this target."""
        problems = []
        if cfg.hidden_size != self.hidden_size:
            problems.append(f"drafter hidden_size {cfg.hidden_size} != target hidden size {self.hidden_size} "
                            "(the drafter shares the target's embeddings and LM head)")
        if cfg.target_hidden_size != self.hidden_size:
            problems.append(f"drafter expects {cfg.target_hidden_size}-wide target features, target gives "
                            f"{self.hidden_size}")
        too_deep = [i for i in cfg.target_layer_ids or [] if i >= self.num_layers]
        if too_deep:
            problems.append(f"target_layer_ids {too_deep} beyond the target's {self.num_layers} layers")
        if cfg.num_target_layers is not None and cfg.num_target_layers != self.num_layers:
            problems.append(f"drafter was built for a {cfg.num_target_layers}-layer target, this one has "
                            f"{self.num_layers}")
        if cfg.mask_token_id is None:
            problems.append("mask_token_id is not resolved (DrafterConfig.resolve_mask_token)")
        elif not 0 <= cfg.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {cfg.mask_token_id} is outside the target's embedding ({self.vocab_size} "
                            f"rows)")
        head_rows = self.parts.lm_head.weight.shape[0]
        if cfg.vocab_size != head_rows:
            problems.append(f"drafter vocab_size {cfg.vocab_size} != target LM head rows {head_rows}")
        if problems:
            raise TargetError("drafter and target do not fit: " + "; ".join(problems))

    # --- the one extraction path -------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, layer_ids: list[int], *, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                position_ids: torch.Tensor | None = None) -> TargetOutput:
        """Run the decoder stack once; return concatenated features and the final hidden.

        Feature i is the output of decoder layer `layer_ids[i]`, i.e. HF
        `hidden_states[layer_ids[i] + 1]` (index 0 is the embedding output).
        """
        bad = [i for i in layer_ids if not -1 <= i < self.num_layers]
        if bad:
            raise TargetError(f"layer ids {bad} outside the target's {self.num_layers} layers")
        captured: dict[int, torch.Tensor] = {}

        def hook(idx):
            def fn(_module, _inputs, output):
                captured[idx] = output[0] if isinstance(output, tuple) else output
            return fn

        # id -1 is the embedding output (HF hidden_states[0]): DeepSpec drafters read it
        handles = [(self.parts.layers[i] if i >= 0 else self.parts.embed_tokens).register_forward_hook(hook(i))
                   for i in sorted(set(layer_ids))]
        kwargs = {}
        if past_key_values is not None:  # transformers renamed `past_key_values` to `cache`
            kwargs[_cache_kwarg(self.parts.text_model)] = past_key_values
        try:
            out = self.parts.text_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        use_cache=use_cache, **kwargs)
        finally:
            for h in handles:
                h.remove()
        last = out.last_hidden_state
        feats = []
        for i in layer_ids:
            f = captured[i]
            if i == self.num_layers - 1:  # HF's last hidden_states entry is after the final norm
                f = last
            feats.append(f)
        features = torch.cat(feats, dim=-1) if feats else last[..., :0]
        return TargetOutput(features, last, past_key_values)

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.parts.lm_head(last_hidden)

    @torch.no_grad()
    def greedy_tokens(self, last_hidden: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """argmax of the LM head, in chunks of positions so [seq, vocab] is never whole
        (default chunk: `logits_rows`, so the temporary is the same size at any vocabulary)."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        chunk = chunk or logits_rows(self.parts.lm_head.weight.shape[0])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for s in range(0, flat.shape[0], chunk):
            out[s:s + chunk] = self.parts.lm_head(flat[s:s + chunk]).argmax(-1)
        return out.view(last_hidden.shape[:-1])

    # --- identity -------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Identity of everything that shapes this target's outputs (`dflash_train.core.fingerprint`).

        Loaded from a directory: every byte of its files (weights, config, tokenizer, chat
        template, generation config), digested when `load` read them, plus the dtypes it
        runs in. In memory only: every byte of every tensor plus the config. Cached.
        """
        if self._fingerprint is None:
            dtypes = sorted({str(p.dtype) for p in self.model.parameters()})
            if self._files_digest is not None:
                ident = f"files:{self._files_digest}:{','.join(dtypes)}"
            else:
                cfg = self.model.config.to_dict()
                for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
                    cfg.pop(k, None)
                ident = "tensors:" + tensor_digest(sorted(self.model.state_dict().items()), cfg)
            self._fingerprint = hashlib.sha256(ident.encode()).hexdigest()[:32]
        return self._fingerprint


def _cache_kwarg(module: nn.Module) -> str:
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


LOGITS_BUDGET_BYTES = 64 << 20  # the largest [rows, vocab] logits temporary of a chunked LM head


def logits_rows(vocab: int, budget: int = LOGITS_BUDGET_BYTES) -> int:
    """Rows per LM-head chunk that keep float32 logits within `budget` at any vocabulary
    (4,096 rows at vocab 4k, 110 at 151,936, 67 at 248,320): memory flat in vocabulary."""
    return max(1, budget // (4 * vocab))


class VerifyCache:
    """The target's cache in a draft-verify loop: extended by each verify pass, then rewound
    to the tokens that were committed.

    Attention layers keep every position and are simply cropped. Recurrent layers (the
    gated delta net of Qwen3.5/3.6's linear attention) keep one state, no history: their
    states are saved before a verify pass and, when drafts were rejected, restored and
    advanced over the accepted tokens only, by running the target over them again. That is
    how serving engines roll such layers back; it costs one forward over the accepted
    tokens per partly rejected block, instead of re-running the whole sequence.
    """

    def __init__(self, target: Target):
        from transformers import DynamicCache

        self.target = target
        self.kv = DynamicCache(config=target.model.config)
        self.recurrent = cache_compat.recurrent_layers(self.kv)
        self.attention = cache_compat.attention_layers(self.kv)
        self._saved: cache_compat.Snapshot = []
        self.rewindable = cache_compat.rewindable(self.kv)

    @property
    def length(self) -> int:
        return cache_compat.seq_length(self.kv)

    def save(self) -> None:
        """Remember the recurrent states (before a verify pass)."""
        self._saved = cache_compat.snapshot(self.recurrent)

    def restore(self, length: int) -> None:
        """Back to the state of `save()`, taken when the cache held `length` positions."""
        self._crop_attention(length)
        cache_compat.restore(self._saved)

    def rewind(self, start: int, committed: torch.Tensor, layer_ids: list[int]) -> None:
        """After a verify pass over a block at positions start.., keep its first
        `committed.shape[1]` tokens (`committed`: `[1, n]` ids)."""
        keep = start + committed.shape[1]
        if not self.recurrent:
            self._crop_attention(keep)
        elif keep < self.length:  # some drafts rejected: the recurrent states went past them
            self.restore(start)
            self.target.forward(committed, layer_ids, past_key_values=self.kv, use_cache=True)

    def _crop_attention(self, keep: int) -> None:
        for layer in self.attention:
            cache_compat.crop_attention(layer, keep)

