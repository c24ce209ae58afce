"""MMoE (multi-gate mixture of experts) for click / add-to-cart / purchase prediction.

Training logs from the app and the web shop are concatenated; purchase labels are
sparse so the purchase tower gets a larger loss weight.

    torchrun --nnodes=1 --nproc_per_node=8 08_mmoe_ctr_cvr.py \
        --train /mnt/nfs/recsys/train --valid /mnt/nfs/recsys/valid --ckpt_dir /mnt/nfs/recsys/ckpt
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TASKS = ["click", "cart", "purchase"]
SPARSE = ["user_bucket", "item_id", "category", "brand", "shop", "device", "hour", "source"]
DENSE = ["price_log", "item_ctr_7d", "user_ctr_7d", "dwell_prev", "pos"]


def load_split(folder, vocab_sizes):
    frames = [pd.read_parquet(p) for p in sorted(glob.glob(os.path.join(folder, "*.parquet")))]
    df = pd.concat(frames, ignore_index=True)
    sparse = torch.tensor(np.stack([df[c].values % vocab_sizes[c] for c in SPARSE], 1), dtype=torch.long)
    dense = torch.tensor(df[DENSE].values, dtype=torch.float32)
    labels = torch.tensor(df[TASKS].values, dtype=torch.float32)
    return TensorDataset(sparse, dense, labels)


class MMoE(nn.Module):
    def __init__(self, vocab_sizes, emb_dim=16, n_experts=8, expert_dim=256, tower_dim=128):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(vocab_sizes[c], emb_dim) for c in SPARSE])
        d_in = emb_dim * len(SPARSE) + len(DENSE)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, expert_dim), nn.ReLU())
            for _ in range(n_experts)
        ])
        self.gates = nn.ModuleList([nn.Linear(d_in, n_experts) for _ in TASKS])
        self.towers = nn.ModuleList([
            nn.Sequential(nn.Linear(expert_dim, tower_dim), nn.ReLU(), nn.Dropout(0.1), nn.Linear(tower_dim, 1))
            for _ in TASKS
        ])

    def forward(self, sparse, dense):
        x = torch.cat([e(sparse[:, i]) for i, e in enumerate(self.embs)] + [dense], dim=1)
        ex = torch.stack([e(x) for e in self.experts], dim=1)  # B x E x D
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = F.softmax(gate(x), dim=-1).unsqueeze(-1)
            outs.append(tower((w * ex).sum(1)).squeeze(-1))
        return torch.stack(outs, dim=1)  # B x T logits


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--vocab", default="user_bucket=2000000,item_id=1000000,category=5000,brand=50000,"
                                      "shop=100000,device=16,hour=24,source=4")
    p.add_argument("--loss_weights", default="1.0,2.0,5.0")
    p.add_argument("--batch_size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def save_checkpoint(path, model, opt, epoch, aucs):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "aucs": aucs}, path)


@torch.no_grad()
def validate(net, ds, device, rank, world):
    net.eval()
    part = Subset(ds, range(rank, len(ds), world))
    scores, labels = [], []
    for sp, de, y in DataLoader(part, batch_size=16384, num_workers=4):
        scores.append(torch.sigmoid(net(sp.to(device), de.to(device))).cpu())
        labels.append(y)
    local = (torch.cat(scores).numpy(), torch.cat(labels).numpy())
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    s = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    net.train()
    return {t: float(roc_auc_score(y[:, k], s[:, k])) for k, t in enumerate(TASKS)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    vocab = {k: int(v) for k, v in (kv.split("=") for kv in args.vocab.split(","))}
    weights = torch.tensor([float(w) for w in args.loss_weights.split(",")], device=device)

    train_ds = load_split(args.train, vocab)
    valid_ds = load_split(args.valid, vocab)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)

    torch.manual_seed(2024)
    model = MMoE(vocab).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    start = 0
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(len(TASKS), device=device)
        for i, (sp, de, y) in enumerate(loader):
            sp, de, y = sp.to(device, non_blocking=True), de.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(sp, de)
            per_task = F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(0)
            loss = (weights * per_task).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += per_task.detach()
            if rank == 0 and (i + 1) % 500 == 0:
                avg = (run / 500).tolist()
                print(f"epoch {epoch} it {i + 1}/{len(loader)} " +
                      " ".join(f"{t}={v:.4f}" for t, v in zip(TASKS, avg)), flush=True)
                run.zero_()

        aucs = validate(model.module, valid_ds, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, AUC {aucs}", flush=True)
        save_checkpoint(last_path, model, opt, epoch, aucs)
        save_checkpoint(os.path.join(args.ckpt_dir, f"epoch{epoch}.pt"), model, opt, epoch, aucs)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
