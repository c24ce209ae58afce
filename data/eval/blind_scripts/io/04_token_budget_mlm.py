#!/usr/bin/env python
# ESM-style masked language model pretraining on UniRef50 with token-budget batches.
#
# Sequences longer than --max_len are randomly cropped (ESM-2 recipe). Batches are
# formed by a token budget rather than a fixed count so that short and long
# proteins use the GPU equally well.
#
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
#       04_token_budget_mlm.py --fasta /lustre/uniref50/uniref50.fasta --index /lustre/uniref50/uniref50.idx
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

TOKENS = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + ["<mask>"]
TOK = {t: i for i, t in enumerate(TOKENS)}
CLS, PAD, EOS, UNK, MASK = TOK["<cls>"], TOK["<pad>"], TOK["<eos>"], TOK["<unk>"], TOK["<mask>"]


class IndexedFasta(Dataset):
    """Random access into a big FASTA through a precomputed (offset, length) index."""

    def __init__(self, fasta, index, max_len):
        idx = np.load(index)
        self.offsets, self.lengths = idx["offsets"], idx["lengths"]
        self.fasta, self.max_len = fasta, max_len
        self._fh = None

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, i):
        if self._fh is None:
            self._fh = open(self.fasta, "rb")
        self._fh.seek(int(self.offsets[i]))
        header = self._fh.readline()
        chunks = []
        while True:
            line = self._fh.readline()
            if not line or line.startswith(b">"):
                break
            chunks.append(line.strip())
        seq = b"".join(chunks).decode()
        if len(seq) > self.max_len:
            start = random.randint(0, len(seq) - self.max_len)
            seq = seq[start:start + self.max_len]
        return torch.tensor([CLS] + [TOK.get(a, UNK) for a in seq] + [EOS])


class DistributedTokenBatchSampler(Sampler):
    """Shuffles, gives each rank its share of sequences, then packs them by length into batches
    of at most max_tokens (padded) tokens."""

    def __init__(self, lengths, max_tokens, max_len, rank, world_size, seed=0):
        self.lengths = np.minimum(lengths, max_len) + 2
        self.max_tokens, self.rank, self.world_size, self.seed = max_tokens, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(len(self.lengths))
        shard = order[self.rank::self.world_size]
        shard = shard[np.argsort(self.lengths[shard], kind="stable")]
        batches, cur, cur_max = [], [], 0
        for i in shard:
            l = int(self.lengths[i])
            if cur and max(cur_max, l) * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(int(i))
            cur_max = max(cur_max, l)
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        yield from self._batches()

    def __len__(self):
        return len(self._batches())


def mask_tokens(tokens, p=0.15):
    labels = tokens.clone()
    special = (tokens == CLS) | (tokens == EOS) | (tokens == PAD)
    probs = torch.full(tokens.shape, p)
    probs[special] = 0.0
    masked = torch.bernoulli(probs).bool()
    labels[~masked] = -100
    replace = torch.bernoulli(torch.full(tokens.shape, 0.8)).bool() & masked
    tokens = tokens.clone()
    tokens[replace] = MASK
    rand = torch.bernoulli(torch.full(tokens.shape, 0.5)).bool() & masked & ~replace
    tokens[rand] = torch.randint(4, 24, tokens.shape)[rand]
    return tokens, labels


def collate(batch):
    tokens = nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=PAD)
    return mask_tokens(tokens)


class RotaryTransformerLM(nn.Module):
    def __init__(self, vocab, dim, layers, heads, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len + 2, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)[None]
        x = self.layers(x, src_key_padding_mask=tokens == PAD)
        return self.lm_head(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--index", required=True)
    ap.add_argument("--val_fasta", default=None)
    ap.add_argument("--val_index", default=None)
    ap.add_argument("--max_len", type=int, default=1022)
    ap.add_argument("--max_tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=640)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--out", default="/lustre/runs/esm_t30")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    data = IndexedFasta(args.fasta, args.index, args.max_len)
    sampler = DistributedTokenBatchSampler(data.lengths, args.max_tokens, args.max_len, rank, world, args.seed)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, prefetch_factor=4)

    model = RotaryTransformerLM(len(TOKENS), args.dim, args.layers, args.heads, args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    total = args.epochs * len(sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / total))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.1f}M params, {len(data)} sequences, world {world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tok_count = time.time(), 0
        for tokens, labels in loader:
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1),
                                   ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            tok_count += int((tokens != PAD).sum())
            if step % 100 == 0 and rank == 0:
                dt = time.time() - t0
                print(f"ep {epoch} step {step} loss {loss.item():.3f} ppl {math.exp(loss.item()):.2f} "
                      f"{tok_count / dt:.0f} tok/s/gpu lr {sched.get_last_lr()[0]:.2e}", flush=True)
                t0, tok_count = time.time(), 0
            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch},
                               os.path.join(args.out, f"ckpt_{step}.pt"))
                dist.barrier()

        if args.val_fasta:
            val = IndexedFasta(args.val_fasta, args.val_index, args.max_len)
            shard = torch.utils.data.Subset(val, range(rank, len(val), world))
            vloader = DataLoader(shard, batch_size=16, collate_fn=collate, num_workers=2)
            totals = torch.zeros(2, device=device, dtype=torch.float64)
            model.eval()
            with torch.no_grad():
                for tokens, labels in vloader:
                    tokens, labels = tokens.to(device), labels.to(device)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model.module(tokens)
                    totals[0] += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1),
                                                 ignore_index=-100, reduction="sum")
                    totals[1] += (labels != -100).sum()
            dist.all_reduce(totals)
            if rank == 0:
                print(f"epoch {epoch} val ppl {math.exp(totals[0].item() / totals[1].item()):.3f}", flush=True)

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
