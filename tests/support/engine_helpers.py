"""Drafters with real, varied acceptance for the engine tests (no trainer needed).

`fit_drafter` overfits a small drafter to a few greedy references with plain
same-position CE through `forward_blocks` (the training layout), so its drafts depend on
context and are right often but not always: accept lengths spread over 1..B, which is
what an exact replay test needs (a random drafter only ever gives 1).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch
import torch.nn.functional as F

from dflash_train.core.model import DFlashDrafter
from dflash_train.core.speculative import greedy_generate
from dflash_train.core.target import Target


def references(target: Target, prompts: list[list[int]], max_new: int, eos: int | None = None) -> list[list[int]]:
    return [p + greedy_generate(target, p, max_new, eos_token_id=eos) for p in prompts]


def fit_drafter(target: Target, drafter: DFlashDrafter, sequences: list[list[int]], prompt_lens: list[int],
                steps: int = 60, lr: float = 3e-3, seed: int = 0, leak: str | None = None) -> DFlashDrafter:
    """A few Adam steps of same-position CE on every response anchor of `sequences`.

    `leak` injects a known training bug: "anchor_state" (context kv <= anchor, SF #455) or
    "shifted_labels" (slot k trained on the token at anchor + k + 1).
    """
    torch.manual_seed(seed)
    cfg = drafter.config
    B, embed, head = cfg.block_size, target.parts.embed_tokens, target.parts.lm_head
    data = []
    for seq, P in zip(sequences, prompt_lens, strict=False):
        ids = torch.tensor([seq])
        feats = target.forward(ids, cfg.target_layer_ids).features
        anchors = torch.arange(P, len(seq) - 1)[None]
        pos = anchors[0, :, None] + torch.arange(B)[None] + (leak == "shifted_labels")  # [N, B] label positions
        labels = torch.where(pos < len(seq), ids[0, pos.clamp(max=len(seq) - 1)], -100)
        labels[:, 0] = -100  # slot 0 is the anchor itself, not a prediction
        data.append((ids, feats, anchors, labels))
    drafter.train()
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        for ids, feats, anchors, labels in data:
            hidden = drafter.forward_blocks(embed, ids, feats, anchors, backend="sdpa",
                                            see_anchor_state=leak == "anchor_state")
            logits = head(hidden[0])
            loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


def fit_on_target_predictions(target: Target, drafter: DFlashDrafter, rows: torch.Tensor, steps: int = 200,
                              lr: float = 2e-2, seed: int = 0, leak: str | None = None) -> tuple[DFlashDrafter, float]:
    """Full-batch same-position CE on every anchor of token `rows` `[N, S]`, labels = the target's own
    argmax there (verifier targets, as speculators trains). Returns the drafter and its slot-1
    accuracy on `rows` as its trainer would log it (through the same, possibly leaky, view).
    `leak="anchor_state"` trains with context kv <= anchor (SF #455)."""
    torch.manual_seed(seed)
    B, (n, S) = drafter.config.block_size, rows.shape
    with torch.no_grad():
        out = target.forward(rows, drafter.config.target_layer_ids)
        pred = target.greedy_tokens(out.last_hidden.reshape(n * S, -1)).view(n, S)  # pred[p]: token at p + 1
    anchors = torch.arange(1, S - B + 1).expand(n, -1)
    pos = anchors[..., None] + torch.arange(B)
    labels = torch.gather(pred, 1, (pos - 1).reshape(n, -1)).view(n, -1, B)
    labels[..., 0] = -100
    embed, head = target.parts.embed_tokens, target.parts.lm_head
    drafter.train()
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        hidden = drafter.forward_blocks(embed, rows, out.features, anchors, backend="sdpa",
                                        see_anchor_state=leak == "anchor_state")
        logits = head(hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = (logits.argmax(-1).view(n, -1, B)[..., 1] == labels[..., 1]).float().mean().item()
    return drafter.eval(), acc


class CannedServer:
    """A real HTTP server on 127.0.0.1 answering /v1/completions with a canned body."""

    def __init__(self, respond):
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                status, payload = respond(body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def forced_reference(drafter: DFlashDrafter, embed, head, vocab: int, feats: torch.Tensor, prompt: list[int], n: int,
                     policy: str, rng) -> list[int]:
    """A response of n tokens (+ B-1 lookahead) whose online walk accepts what `policy` says, drafted with
    the target parts `embed`/`head` (vocabulary `vocab`).

    At each step the block is drafted (the spec loop's one-block path) and the reference continues with
    the first `a` drafts, then a token the drafter did not propose: `accept_all` a = B-1 (τ = B),
    `accept_none` 0 (τ = 1), `random` uniform in 0..B-1, `mostly` in B/2..B-1, `low` 1 in about a
    third of the steps (τ ≈ 1.35). Used by the walk tests and `bench/walk_cost.py`'s forced cases."""
    from eval_worker.engine.drafting import draft_one_block

    B = drafter.config.block_size
    ext = [int(rng.integers(0, vocab - 1))]
    s = 0
    while len(ext) < n + B - 1:
        ids = torch.tensor(prompt + ext)
        drafts = draft_one_block(drafter, embed, head, ids, feats, len(prompt) + s)[0].tolist()
        least = B // 2 if policy == "mostly" else 0
        if policy == "low":
            a = int(rng.random() < 0.35)
        else:
            a = {"accept_all": B - 1, "accept_none": 0}.get(policy, int(rng.integers(least, B)))
        ext += drafts[:a]
        if a < B - 1:  # the first rejected slot gets a token the drafter did not propose
            ext.append(int((drafts[a] + 1 + rng.integers(0, vocab - 3)) % (vocab - 1)))
        s = len(ext) - 1
        if a == B - 1:  # a full block: the bonus token, then the next block drafts from it
            ext.append(int(rng.integers(0, vocab - 1)))
            s = len(ext) - 1
    return ext[: n + B - 1]
