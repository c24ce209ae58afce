"""
MMoE multi-task ranker (click / like / long-view) for the notifications + home + search surfaces.

PyTorchJob with elasticPolicy (minReplicas 2, maxReplicas 4, maxRestarts 5) on the V100 pool
(8x V100-32G per pod, so fp16 + GradScaler rather than bf16):

    torchrun --nnodes=2:4 --nproc_per_node=8 --max_restarts=5 \
        --rdzv_backend=c10d --rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT) --rdzv_id=$(PET_RDZV_ID) \
        mmoe_ranker.py --train-dir /data/rank/2024w31/train --eval-dir /data/rank/2024w31/eval \
        --ckpt /mnt/ckpt/mmoe-2024w31.pt

Checkpoints hold the full (unsharded) model, so a restart with a different number of pods
simply continues from the start of the interrupted epoch.
"""
import argparse
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter

TASKS = ("click", "like", "longview")
SURFACES = ("home", "search", "notif")
N_SPARSE = 24
HASH_BUCKETS = 1_000_003


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tb-dir", default="/mnt/tb/mmoe")
    return p.parse_args()


class NpzShards(Dataset):
    def __init__(self, root):
        files = sorted(glob.glob(os.path.join(root, "*.npz")))
        parts = [np.load(f) for f in files]
        self.dense = np.concatenate([p["dense"] for p in parts]).astype(np.float32)
        self.sparse = np.concatenate([p["sparse"] for p in parts]).astype(np.int64)
        self.surface = np.concatenate([p["surface"] for p in parts]).astype(np.int64)
        self.labels = np.concatenate([p["labels"] for p in parts]).astype(np.float32)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.surface[i], self.labels[i]


class MMoE(nn.Module):
    def __init__(self, n_dense=32, emb=32, n_experts=8, d_exp=256):
        super().__init__()
        self.emb = nn.Embedding(HASH_BUCKETS, emb)
        d_in = n_dense + N_SPARSE * emb
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, d_exp), nn.ReLU())
                                      for _ in range(n_experts)])
        # one gate per (surface, task); search traffic is sparse in some hourly partitions
        self.gates = nn.ModuleDict({f"{s}_{t}": nn.Linear(d_in, n_experts) for s in SURFACES for t in TASKS})
        self.towers = nn.ModuleDict({t: nn.Sequential(nn.Linear(d_exp, 128), nn.ReLU(), nn.Linear(128, 1)) for t in TASKS})

    def forward(self, dense, sparse, surface):
        x = torch.cat([dense, self.emb(sparse % HASH_BUCKETS).flatten(1)], dim=1)
        e = torch.stack([ex(x) for ex in self.experts], dim=1)             # B, E, d
        out = {t: torch.zeros(x.size(0), device=x.device, dtype=e.dtype) for t in TASKS}
        for si, s in enumerate(SURFACES):
            idx = (surface == si).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            for t in TASKS:
                w = torch.softmax(self.gates[f"{s}_{t}"](x[idx]), dim=-1)  # b, E
                h = (w.unsqueeze(-1) * e[idx]).sum(1)
                out[t] = out[t].index_put((idx,), self.towers[t](h).squeeze(-1).to(out[t].dtype))
        return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds = {t: [] for t in TASKS}
    labels = {t: [] for t in TASKS}
    for dense, sparse, surface, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.module(dense.to(device), sparse.to(device), surface.to(device))
        for j, t in enumerate(TASKS):
            preds[t].append(torch.sigmoid(out[t].float()).cpu().numpy())
            labels[t].append(y[:, j].numpy())
    local = {t: (np.concatenate(preds[t]), np.concatenate(labels[t])) for t in TASKS}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    aucs = {}
    for t in TASKS:
        p = np.concatenate([g[t][0] for g in gathered])
        l = np.concatenate([g[t][1] for g in gathered])
        aucs[t] = float(roc_auc_score(l, p))
    return aucs


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, eval_ds = NpzShards(a.train_dir), NpzShards(a.eval_dir)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    # strided split without padding so every eval row is scored exactly once
    eval_dl = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=8192,
                         shuffle=False, num_workers=2)

    model = MMoE(n_experts=a.experts).to(device)
    start_epoch = 0
    ckpt = None
    if os.path.exists(a.ckpt):
        ckpt = torch.load(a.ckpt, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    # gates of a surface that is absent from a micro-batch get no gradient that step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr * world / 16)
    scaler = torch.cuda.amp.GradScaler()
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        for g in opt.param_groups:
            g["lr"] = a.lr * world / 16

    tb = SummaryWriter(a.tb_dir) if rank == 0 else None
    step = 0
    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (dense, sparse, surface, y) in enumerate(train_dl):
            dense, sparse = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True)
            surface, y = surface.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % a.accum == 0
            ctx = model.no_sync() if not boundary else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(dense, sparse, surface)
                loss = sum(F.binary_cross_entropy_with_logits(out[t].float(), y[:, j]) for j, t in enumerate(TASKS))
                scaler.scale(loss / a.accum).backward()
            if not boundary:
                continue
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                red = loss.detach().clone()
                dist.all_reduce(red, op=dist.ReduceOp.AVG)
                if tb:
                    tb.add_scalar("train/loss", red.item(), step)
                    tb.add_scalar("train/loss_scale", scaler.get_scale(), step)

        aucs = evaluate(model, eval_dl, device)
        if rank == 0:
            for t, v in aucs.items():
                tb.add_scalar(f"eval/auc_{t}", v, epoch)
            print(f"epoch {epoch} " + " ".join(f"{t}={v:.4f}" for t, v in aucs.items()), flush=True)
            tmp = a.ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, a.ckpt)
        dist.barrier()

    if tb:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
