"""
MultiResCNN (Li & Yu, 2020) for MIMIC-III top-50 ICD-9 coding, multi-GPU with DDP.
Multi-filter residual convolutions with BatchNorm, label attention per code, BCE loss.

First run tokenises the notes and writes a cache next to the data; later runs just load it.

    torchrun --standalone --nproc_per_node=4 15_icd_multirescnn.py --data_dir data/mimic3_50 --out runs/mrcnn50
"""
import argparse
import json
import os
import re
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z][a-z0-9]*")


def build_cache(data_dir, max_len, min_freq):
    splits = {s: pd.read_csv(os.path.join(data_dir, f"{s}_50.csv")) for s in ("train", "dev", "test")}
    codes = sorted({c for cs in splits["train"]["LABELS"] for c in cs.split(";")})
    cnt = Counter(t for text in splits["train"]["TEXT"] for t in TOKEN_RE.findall(text.lower()))
    vocab = ["<pad>", "<unk>"] + sorted(w for w, n in cnt.items() if n >= min_freq)
    w2i = {w: i for i, w in enumerate(vocab)}
    c2i = {c: i for i, c in enumerate(codes)}
    tensors = {}
    for s, df in splits.items():
        x = torch.zeros(len(df), max_len, dtype=torch.int32)
        y = torch.zeros(len(df), len(codes), dtype=torch.uint8)
        for r, (text, labels) in enumerate(zip(df["TEXT"], df["LABELS"])):
            ids = [w2i.get(t, 1) for t in TOKEN_RE.findall(text.lower())][:max_len]
            x[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            for c in labels.split(";"):
                if c in c2i:
                    y[r, c2i[c]] = 1
        tensors[s] = (x, y)
    return {"vocab": vocab, "codes": codes, "tensors": tensors}


class ResBlock(nn.Module):
    def __init__(self, cin, cout, k, dropout):
        super().__init__()
        self.left = nn.Sequential(
            nn.Conv1d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm1d(cout), nn.Tanh(),
            nn.Conv1d(cout, cout, k, padding=k // 2, bias=False), nn.BatchNorm1d(cout))
        self.shortcut = nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(torch.tanh(self.left(x) + self.shortcut(x)))


class MultiResCNN(nn.Module):
    def __init__(self, vocab_size, n_codes, emb_dim=100, filters=(3, 5, 9, 15, 19, 25), n_filt=50, dropout=0.2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.emb_drop = nn.Dropout(dropout)
        self.channels = nn.ModuleList()
        for k in filters:
            self.channels.append(nn.Sequential(
                nn.Conv1d(emb_dim, emb_dim, k, padding=k // 2), nn.Tanh(), ResBlock(emb_dim, n_filt, k, dropout)))
        d = n_filt * len(filters)
        self.U = nn.Linear(d, n_codes)
        self.final = nn.Linear(d, n_codes)

    def forward(self, x):
        e = self.emb_drop(self.emb(x)).transpose(1, 2)              # B x E x T
        h = torch.cat([ch(e) for ch in self.channels], dim=1).transpose(1, 2)   # B x T x d
        a = self.U.weight.matmul(h.transpose(1, 2))                 # B x L x T
        a = a.masked_fill((x == 0).unsqueeze(1), -1e4).softmax(-1)
        m = a.matmul(h)                                             # B x L x d
        return self.final.weight.mul(m).sum(-1) + self.final.bias


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    idx_l, prob_l, y_l = [], [], []
    for idx, x, y in loader:
        idx_l.append(idx.to(device))
        prob_l.append(torch.sigmoid(model(x.long().to(device))))
        y_l.append(y.to(device))
    idx, prob, y = torch.cat(idx_l), torch.cat(prob_l), torch.cat(y_l)
    world = dist.get_world_size()
    out = []
    for t in (idx, prob, y):                        # every shard has the same length (sampler pads)
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        out.append(torch.cat(buf))
    idx, prob, y = out
    order = torch.argsort(idx)
    keep = torch.ones_like(order, dtype=torch.bool)
    keep[1:] = idx[order][1:] != idx[order][:-1]    # drop the repeated padding samples
    sel = order[keep]
    assert sel.numel() == n
    prob, y = prob[sel].cpu().numpy(), y[sel].cpu().numpy()
    pred = (prob >= 0.5).astype(int)
    top5 = np.argsort(-prob, 1)[:, :5]
    return {"micro_f1": f1_score(y, pred, average="micro", zero_division=0),
            "macro_f1": f1_score(y, pred, average="macro", zero_division=0),
            "micro_auc": roc_auc_score(y, prob, average="micro"),
            "p@5": float(np.take_along_axis(y, top5, 1).mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=2500)
    ap.add_argument("--min_freq", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    cache = os.path.join(args.data_dir, f"cache_len{args.max_len}_min{args.min_freq}.pt")
    if rank == 0 and not os.path.exists(cache):
        tmp = cache + f".tmp{os.getpid()}"
        torch.save(build_cache(args.data_dir, args.max_len, args.min_freq), tmp)
        os.replace(tmp, cache)
    dist.barrier()
    data = torch.load(cache)
    vocab, codes = data["vocab"], data["codes"]
    tr_x, tr_y = data["tensors"]["train"]
    dv_x, dv_y = data["tensors"]["dev"]
    train_ds = TensorDataset(tr_x, tr_y.float())
    dev_ds = TensorDataset(torch.arange(len(dv_x)), dv_x, dv_y.float())

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False), num_workers=2)

    model = MultiResCNN(len(vocab), len(codes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    start, best = 0, -1.0
    last_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.long().to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        m = evaluate(model, dev_dl, device, len(dev_ds))
        if rank == 0:
            print(json.dumps({"epoch": epoch, "loss": round((loss_acc[0] / loss_acc[1]).item(), 5),
                              **{k: round(float(v), 4) for k, v in m.items()}}), flush=True)
            os.makedirs(args.out, exist_ok=True)
            best = max(best, m["micro_f1"])
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best,
                        "codes": codes}, last_path)
            if m["micro_f1"] >= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
