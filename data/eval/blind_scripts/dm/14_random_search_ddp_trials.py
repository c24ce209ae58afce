"""Random search over a small Transformer text classifier on AG News.

Trials run one after the other; each trial is trained with DDP on every GPU.
All ranks draw the same configurations from a shared seed, so no parameters
need to be exchanged.  Results are appended to ``trials.jsonl`` by rank 0 and
the best model is kept.

Input: ``agnews_tok.pt`` with ``train_ids``/``train_labels``/``test_ids``/``test_labels``
(int64, padded to 128 tokens, pad id 0) and ``vocab_size``.

    torchrun --nproc_per_node=8 search_agnews.py --data data/agnews_tok.pt --trials 24
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/agnews_tok.pt")
    ap.add_argument("--out", default="runs/agnews_search")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


class TextTransformer(nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, ff_mult, dropout, n_classes=4, max_len=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model, padding_idx=0)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, ff_mult * d_model, dropout,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        self.cls = nn.Linear(d_model, n_classes)

    def forward(self, ids):
        pad = ids.eq(0)
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.encoder(self.emb(ids) + self.pos(pos), src_key_padding_mask=pad)
        h = self.norm(h).masked_fill(pad.unsqueeze(-1), 0.0)
        pooled = h.sum(1) / (~pad).sum(1, keepdim=True).clamp(min=1)
        return self.cls(pooled)


def sample_trials(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        d = int(rng.choice([128, 256, 384]))
        out.append({
            "id": i,
            "lr": float(10 ** rng.uniform(-4, -2.7)),
            "weight_decay": float(rng.choice([0.0, 0.01, 0.1])),
            "d_model": d,
            "n_layers": int(rng.integers(2, 7)),
            "n_heads": int(rng.choice([h for h in (4, 8) if d % h == 0])),
            "ff_mult": int(rng.choice([2, 4])),
            "dropout": float(rng.uniform(0.0, 0.3)),
            "warmup_frac": float(rng.uniform(0.02, 0.1)),
        })
    return out


def warmup_cosine(opt, warmup, total):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for ids, y in loader:
        ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(ids)
        s[0] += F.cross_entropy(logits, y, reduction="sum")
        s[1] += (logits.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def run_trial(cfg, data, args, device, rank):
    train_ds = TensorDataset(data["train_ids"], data["train_labels"])
    test_ds = TensorDataset(data["test_ids"], data["test_labels"])
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=2, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=512, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=2, pin_memory=True)

    torch.manual_seed(args.seed + cfg["id"])
    model = TextTransformer(data["vocab_size"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                            cfg["ff_mult"], cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total = args.epochs * len(train_loader)
    sched = warmup_cosine(opt, int(cfg["warmup_frac"] * total), total)
    scaler = torch.cuda.amp.GradScaler()

    curve = []
    for epoch in range(args.epochs):
        model.train()
        for ids, y in train_loader:
            ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(ids), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
        val_loss, val_acc = evaluate(model, test_loader, device)
        curve.append({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc})
        if rank == 0:
            print(f"  trial {cfg['id']} epoch {epoch}: loss {val_loss:.4f} acc {val_acc:.4f}", flush=True)
    return model, curve


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    data = torch.load(args.data)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_acc = 0.0
    for cfg in sample_trials(args.trials, args.seed):
        t0 = time.time()
        model, curve = run_trial(cfg, data, args, device, rank)
        final_acc = curve[-1]["val_acc"]
        if rank == 0:
            rec = {**cfg, "final_acc": final_acc, "curve": curve, "minutes": (time.time() - t0) / 60}
            with open(os.path.join(args.out, "trials.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"trial {cfg['id']}: acc {final_acc:.4f} ({rec['minutes']:.1f} min) {cfg}", flush=True)
            if final_acc > best_acc:
                best_acc = final_acc
                torch.save({"model": model.module.state_dict(), "config": cfg, "acc": final_acc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()
        del model

    if rank == 0:
        print(f"best accuracy {best_acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
