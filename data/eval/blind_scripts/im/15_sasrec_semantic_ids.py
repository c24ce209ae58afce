"""
Decoder-only generative retrieval: a causal transformer over the flattened semantic-ID
stream of a user's history (item_1 codes, item_2 codes, ...). Next item = next L tokens.

    torchrun --nproc_per_node=4 15_sasrec_semantic_ids.py --data data/ml20m --sem artifacts/ml20m/sem_ids.npy
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class CausalSemIdLM(nn.Module):
    def __init__(self, vocab, levels, d=256, heads=4, layers=4, max_items=50, dropout=0.2):
        super().__init__()
        self.levels = levels
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.item_pos = nn.Embedding(max_items + 1, d)
        self.level_emb = nn.Embedding(levels, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, x):
        T = x.size(1)
        t = torch.arange(T, device=x.device)
        h = self.tok(x) + self.item_pos(t // self.levels)[None] + self.level_emb(t % self.levels)[None]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=x.device), 1)
        # left padding; positions whose input is a pad are dropped from the loss
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.out(self.ln(h))


class Windows(Dataset):
    """Left-padded token windows; the last item of each window is the prediction target."""

    def __init__(self, seqs, sem, K, max_items, split):
        self.sem, self.K, self.L, self.max_items = sem, K, sem.shape[1], max_items
        self.rows = []
        for s in seqs:
            if split == "train":
                for end in range(2, len(s) - 1):
                    self.rows.append(s[max(0, end - max_items):end])
            elif split == "valid":
                self.rows.append(s[max(0, len(s) - 1 - max_items):len(s) - 1])
            else:
                self.rows.append(s[-max_items:])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        items = self.rows[i]
        toks = [1 + l * self.K + int(c) for it in items for l, c in enumerate(self.sem[it])]
        x = torch.zeros(self.max_items * self.L, dtype=torch.long)
        x[-len(toks):] = torch.tensor(toks)
        return x


@torch.no_grad()
def beam_next_item(model, hist, levels, K, beam):
    """hist: B x T (left padded, ends at an item boundary)."""
    B = hist.size(0)
    seqs = hist.repeat_interleave(beam, 0)
    scores = torch.zeros(B, beam, device=hist.device)
    scores[:, 1:] = -1e9
    for l in range(levels):
        logits = model(seqs)[:, -1]
        lo = 1 + l * K
        lp = F.log_softmax(logits[:, lo:lo + K].float(), -1).view(B, beam, K)
        tot = (scores[..., None] + lp).view(B, -1)
        scores, flat = tot.topk(beam, -1)
        src_beam = flat // K
        seqs = seqs.view(B, beam, -1).gather(1, src_beam[..., None].expand(-1, -1, seqs.size(-1)))
        seqs = torch.cat([seqs, (lo + flat % K)[..., None]], -1).view(B * beam, -1)
    return seqs[:, -levels:].view(B, beam, levels)


def evaluate(model, loader, levels, K, device, beam=20):
    model.eval()
    s = torch.zeros(4, device=device)
    for x in loader:
        x = x.to(device)
        hist, tgt = x[:, :-levels], x[:, -levels:]
        pred = beam_next_item(model, hist, levels, K, beam)
        m = (pred == tgt[:, None]).all(-1)
        s[0] += m[:, :10].any(-1).sum()
        s[1] += m[:, :20].any(-1).sum()
        pos = m.float().argmax(-1)
        s[2] += (m[:, :10].any(-1).float() / torch.log2(pos.float() + 2)).sum()
        s[3] += x.size(0)
    dist.all_reduce(s)
    model.train()
    return {"R@10": (s[0] / s[3]).item(), "R@20": (s[1] / s[3]).item(), "N@10": (s[2] / s[3]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--sem", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--max_items", type=int, default=50)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--out", default="runs/sem_lm")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3407)

    sem = np.load(args.sem)
    levels = sem.shape[1]
    with open(os.path.join(args.data, "user_seqs.json")) as f:
        seqs = [s for s in json.load(f) if len(s) >= 4]
    train = Windows(seqs, sem, args.K, args.max_items, "train")
    valid = Windows(seqs, sem, args.K, args.max_items, "valid")
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=3407)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    valid_dl = DataLoader(Subset(valid, list(range(rank, len(valid), world))), batch_size=128, num_workers=2)

    net = CausalSemIdLM(1 + levels * args.K, levels, max_items=args.max_items).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    writer = SummaryWriter(args.out) if rank == 0 else None
    best, bad, step = 0.0, 0, 0
    for epoch in range(args.epochs):
        model.train()
        ep_loss = torch.zeros(2, device=device)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
            tgt = x[:, 1:].masked_fill(x[:, :-1].eq(0), 0)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ep_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
        dist.all_reduce(ep_loss)
        if rank == 0:
            writer.add_scalar("train/loss", (ep_loss[0] / ep_loss[1]).item(), epoch)

        if (epoch + 1) % args.eval_every == 0:
            metrics = evaluate(net, valid_dl, levels, args.K, device)
            improved = metrics["R@10"] > best
            if improved:
                best, bad = metrics["R@10"], 0
            else:
                bad += 1
            if rank == 0:
                for k, v in metrics.items():
                    writer.add_scalar(f"valid/{k}", v, epoch)
                print(f"epoch {epoch + 1}: {metrics}", flush=True)
                if improved:
                    torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
            if bad >= args.patience:
                break

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
