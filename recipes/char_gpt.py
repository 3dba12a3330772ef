"""char-gpt: a small GPT in the nanoGPT style, trained on characters (seed 000).

Seed 000 sets up DDP the nanoGPT way: ``ddp = RANK is set``, ``master_process =
rank == 0`` does the logging and the checkpointing, nccl on GPUs. This recipe is
the training system that set-up serves: a decoder-only transformer (causal
self-attention with ``scaled_dot_product_attention``, GELU MLP, pre-LayerNorm,
tied input and output embeddings) learning the next character of a text file.
By default the text is the opening of Shakespeare's *Coriolanus* (public domain,
30 KB, ``recipes/data/coriolanus.txt``, the start of the "tiny Shakespeare" set
that nanoGPT's character model trains on).

The first 90% of the text is cut into windows of ``--block-size`` + 1 characters
every ``--stride`` characters, which a DistributedSampler shards and reshuffles
each epoch (``set_epoch``); the last 10% is the validation text, scored after
every epoch (``val_loss``). One optimizer step takes ``--grad-accum``
micro-batches per rank: the backward passes of all but the last run under
``model.no_sync()``, so DDP all-reduces the gradients once per step, as nanoGPT
does. AdamW with nanoGPT's schedule (linear warm-up, cosine decay to a tenth),
gradient clipping, bf16 autocast on GPUs (fp16 with loss scaling where the GPU
lacks bf16). Only rank 0 reports (``loss``, averaged over all ranks, and
``samples_per_s`` every ``--log-every`` steps), saves the
model, optimizer, step, config and vocabulary every ``--save-every`` epochs, and
prints a sample of generated text at the end.

Run it with torchrun (gloo on CPU, nccl on GPUs):

    torchrun --standalone --nproc-per-node 2 -m recipes.char_gpt --total-epochs 5

or through ddpq (``--text`` is relative to the worker's workspace):

    ddpq submit --recipe char-gpt --world-size 2 -- --total-epochs 5 --text my-corpus.txt
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from recipes._common import (
    Batch,
    Trainer,
    exit_without_finalizing,
    fail,
    parse_args,
    setup,
    sharded_loader,
    teardown,
)

RECIPE = "char-gpt"
DEFAULT_TEXT = Path(__file__).with_name("data") / "coriolanus.txt"
VAL_FRACTION = 0.1
SAMPLE_TEMPERATURE = 0.8  # below 1: fewer unlikely characters in the printed sample


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as GPT-2 and nanoGPT do
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2's init; residual projections scaled down by the depth they add up over.
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        for _ in range(n):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :] / SAMPLE_TEMPERATURE
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """nanoGPT's optimizer: weight matrices decay, biases and LayerNorm gains do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def cosine_lr(peak: float, warmup: int, total: int) -> Callable[[int], float]:
    """nanoGPT's schedule: linear warm-up, then cosine decay to a tenth of ``peak``."""
    floor = peak / 10

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / (warmup + 1)
        if step >= total:
            return floor
        progress = (step - warmup) / max(1, total - warmup)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)

    return lr_at


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(input, target) pairs: ``block`` characters and the same shifted by one."""

    def __init__(self, ids: torch.Tensor, block: int, stride: int) -> None:
        self.ids = ids
        self.block = block
        self.starts = range(0, len(ids) - block, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[self.starts[i] : self.starts[i] + self.block + 1]
        return chunk[:-1], chunk[1:]


def read_text(arg: str) -> str:
    path = Path(arg) if arg else DEFAULT_TEXT
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(RECIPE, f"argument --text: no such file: {arg}")
    except (UnicodeDecodeError, IsADirectoryError) as exc:
        fail(RECIPE, f"argument --text: not a UTF-8 text file: {arg} ({exc})")


class LanguageModel(Trainer):
    def batch_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, None]:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(RECIPE, argv)
    if args.n_embd % args.n_head:
        fail(
            RECIPE, f"argument --n-embd: {args.n_embd} is not a multiple of --n-head {args.n_head}"
        )
    text = read_text(args.text)
    vocab = "".join(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    n_val = int(len(ids) * VAL_FRACTION)
    if n_val <= args.block_size:
        fail(
            RECIPE,
            f"argument --text: {len(text)} characters is too short for --block-size "
            f"{args.block_size}: its last {VAL_FRACTION:.0%} must exceed one block",
        )
    train_set = CharWindows(ids[:-n_val], args.block_size, args.stride)
    val_set = CharWindows(ids[-n_val:], args.block_size, args.block_size)

    env = setup()
    torch.manual_seed(args.seed)  # identical initial weights; DDP also broadcasts rank 0's
    cfg = GPTConfig(
        len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout
    )
    loader = sharded_loader(train_set, env, batch_size=args.batch_size, seed=args.seed)
    steps_per_epoch = math.ceil(len(loader) / args.grad_accum)
    trainer = LanguageModel(
        GPT(cfg),
        lambda m: adamw(m, args.lr, args.weight_decay),
        loader,
        env,
        args,
        grad_accum=args.grad_accum,
        grad_clip=args.grad_clip,
        lr_at=cosine_lr(args.lr, args.warmup_steps, args.total_epochs * steps_per_epoch),
    )
    if trainer.snapshot is not None and trainer.snapshot.get("vocab") != vocab:
        fail(RECIPE, "the checkpoint was trained on a text with other characters than --text")
    trainer.extra_state["vocab"] = vocab
    trainer.train(args.total_epochs, val_set=val_set)
    if env.is_master and args.sample_chars:
        model = trainer.model.module
        model.eval()
        start = ids[:1].view(1, 1).to(env.device)
        with env.autocast():
            out = model.generate(
                start, args.sample_chars, torch.Generator(env.device).manual_seed(args.seed)
            )
        print("sample:\n" + "".join(vocab[i] for i in out[0].tolist()), flush=True)
    teardown()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
