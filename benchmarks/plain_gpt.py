"""A plain-PyTorch GPT training loop with a TIED or a LEV input embedding: the baseline of
`bench_lev_quality.py`.

Independent of `megatron_ext` on purpose: does the same math train the same way outside the
stack? The backbone is the stack's LLaMA style, initialised as megatron-core does; LEV follows
docs/lev.md section 2 literally. Reads a Megatron indexed dataset split like `--split`; prints
Megatron-style validation lines.

    python -m benchmarks.plain_gpt --data-path data/kjv8k_text_document \\
        --vocab-size 8000 --embedding lev --train-iters 300
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.harness import add_defaults, add_study_flags


class PlainLEV(torch.nn.Module):
    """ids [b, s] -> [b, s, D], docs/lev.md section 2, every intermediate kept for autograd."""

    def __init__(self, vocab, hidden, k, d_seed, kappa, rank, heads, tau, output_std=None):
        super().__init__()
        base = 2
        while base**k < vocab:
            base += 1
        self.k, self.base, self.kappa, self.tau = k, base, kappa, tau
        self.codebooks = torch.nn.Parameter(torch.randn(k, base, d_seed) * 0.02)
        self.seed_proj = torch.nn.Parameter(torch.randn(heads, d_seed, d_seed) * 0.02)
        self.ln_weight = torch.nn.Parameter(torch.ones(heads, d_seed))
        self.ln_bias = torch.nn.Parameter(torch.zeros(heads, d_seed))
        self.delta = torch.nn.Parameter(torch.randn(heads, d_seed, kappa, rank) * 0.1)
        self.out = torch.nn.Parameter(torch.randn(heads, rank, hidden) * 0.02 / math.sqrt(heads))
        if output_std is not None:
            with torch.no_grad():
                self.out.mul_(output_std / self.embed(torch.arange(vocab)).std())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D]."""
        powers = self.base ** torch.arange(self.k - 1, -1, -1)
        digits = (ids.unsqueeze(-1) // powers) % self.base  # [N, k]
        z = sum(self.codebooks[m][digits[:, m]] for m in range(self.k))  # [N, d]
        u = torch.einsum("nd,hed->hne", z, self.seed_proj)  # [h, N, d]
        u = F.layer_norm(u, u.shape[-1:], eps=1e-5)
        u = u * self.ln_weight[:, None] + self.ln_bias[:, None]
        t = torch.sigmoid(u / self.tau)
        x = ((self.kappa - 1) * t.unsqueeze(-1) - torch.arange(self.kappa)).abs()
        basis = torch.where(x < 0.5, 0.75 - x**2, 0.5 * (1.5 - x).clamp(min=0) ** 2)
        basis = basis / basis.sum(-1, keepdim=True)  # [h, N, d, kappa]
        phi = torch.einsum("hndj,hdjr->hndr", basis, 1 + self.delta)
        sign = 1 - 2 * ((phi < 0).sum(2) % 2)
        modes = sign * torch.exp(torch.log(phi.abs() + 1e-9).sum(2))  # [h, N, r]
        return torch.einsum("hnr,hrD->nD", modes, self.out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        return self.embed(unique)[inverse]


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x [b, heads, s, hd] rotated by position (halves layout, as megatron-core)."""
    s, hd = x.shape[-2], x.shape[-1]
    freqs = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), freqs)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, ffn, rope: bool):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.norm1 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # [b, s, D]
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class PlainGPT(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.hidden_size
        self.tied = args.embedding == "tied"
        if self.tied:
            self.embedding = torch.nn.Embedding(args.vocab_size, d)
        else:
            self.embedding = PlainLEV(
                args.vocab_size, d, args.lev_num_digits, args.lev_seed_dim, args.lev_num_knots,
                args.lev_rank, args.lev_num_heads, args.lev_temperature, args.lev_init_output_std,
            )  # fmt: skip
            self.head = torch.nn.Linear(d, args.vocab_size, bias=False)
        learned = args.positions == "learned"
        self.positions = torch.nn.Embedding(args.seq_length, d) if learned else None
        self.blocks = torch.nn.ModuleList(
            Block(d, args.num_attention_heads, args.ffn_hidden_size, rope=not learned)
            for _ in range(args.num_layers)
        )
        self.final_norm = torch.nn.RMSNorm(d, eps=1e-5)
        out_std = 0.02 / math.sqrt(2 * args.num_layers)
        for name, p in self.named_parameters():
            if name.startswith("embedding.") and not self.tied:
                continue  # LEV keeps the spec's init
            if p.dim() >= 2:
                std = out_std if name.endswith(("proj.weight", "down.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, ids):  # [b, s] -> logits [b, s, V]
        x = self.embedding(ids)
        if self.positions is not None:
            x = x + self.positions.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        weight = self.embedding.weight if self.tied else self.head.weight
        return x @ weight.t()


def token_streams(prefix: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) token streams of a Megatron indexed dataset, split by documents."""
    # deferred: keeps megatron.core (slow) out of this module's import
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    shares = [float(x) for x in split.split(",")]
    n = len(data)
    n_train = int(round(n * shares[0] / sum(shares)))
    n_valid = int(round(n * shares[1] / sum(shares)))

    def stream(lo, hi):
        return torch.from_numpy(np.concatenate([data[i] for i in range(lo, hi)]).astype("int64"))

    return stream(0, n_train), stream(n_train, n_train + n_valid)


def lr_at(step: int, args) -> float:
    """Megatron's schedule: linear warmup from 0, then cosine from --lr to --min-lr."""
    if step < args.lr_warmup_iters:
        return args.lr * step / args.lr_warmup_iters
    ratio = (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (math.cos(math.pi * min(1.0, ratio)) + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-path", required=True)
    p.add_argument("--split", default="95,5,0")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--embedding", choices=("tied", "lev"), default="lev")
    p.add_argument("--positions", choices=("rope", "learned"), default="rope")
    add_study_flags(p)
    p.add_argument(
        "--decay-all", action="store_true", help="weight decay on every parameter (else >= 2-D)"
    )
    add_defaults(p, adam_beta1=0.9, seed=0)
    p.add_argument("--lev-init-output-std", type=float, default=None)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    train, valid = token_streams(args.data_path, args.split)
    s = args.seq_length
    n_eval = min(args.eval_samples, (len(valid) - 1) // s)
    eval_x = torch.stack([valid[i * s : i * s + s + 1] for i in range(n_eval)])
    model = PlainGPT(args)
    decay = [p for p in model.parameters() if args.decay_all or p.dim() >= 2]
    rest = [p for p in model.parameters() if not (args.decay_all or p.dim() >= 2)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0}],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            total = sum(
                F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten(), reduction="sum")
                for b in eval_x.split(args.global_batch_size)
            )
        model.train()
        return float(total) / (n_eval * s)

    start = time.time()
    for it in range(1, args.train_iters + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(it, args)
        starts = torch.randint(0, len(train) - s - 1, (args.global_batch_size,), generator=gen)
        batch = torch.stack([train[i : i + s + 1] for i in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        if it % args.log_interval == 0:
            ms = 1000 * (time.time() - start) / it
            print(f" iteration {it:8d}/{args.train_iters:8d} | elapsed time per iteration (ms): "
                  f"{ms:.1f} | lm loss: {loss.item():.6E} |", flush=True)  # fmt: skip
        if it % args.eval_interval == 0 or it == args.train_iters:
            print(f" validation loss at iteration {it} | lm loss value: {evaluate():.6E} |",
                  flush=True)  # fmt: skip
    print("done (finished)", flush=True)


if __name__ == "__main__":
    main()
