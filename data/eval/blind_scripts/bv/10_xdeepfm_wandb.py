"""xDeepFM (CIN + DNN + linear) for app-install CTR, tracked in Weights & Biases.

    torchrun --standalone --nproc_per_node=4 10_xdeepfm_wandb.py --run-name xdfm_cin200x3
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
import wandb
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/data/app_install/tfrecord_npy")
    p.add_argument("--run-name", default=None)
    p.add_argument("--project", default="ctr-xdeepfm")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cin", default="200,200,200")
    p.add_argument("--dnn", default="400,400")
    p.add_argument("--bs", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=3000)
    p.add_argument("--ckpt-dir", default="/data/app_install/ckpt")
    return p.parse_args()


class Shard(Dataset):
    """ids.npy [N, F] int32 (global ids, field offsets applied), label.npy [N] uint8"""

    def __init__(self, d):
        self.ids = np.load(os.path.join(d, "ids.npy"), mmap_mode="r")
        self.label = np.load(os.path.join(d, "label.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.ids[i].astype(np.int64), np.float32(self.label[i])


class CIN(nn.Module):
    def __init__(self, num_fields, layer_sizes):
        super().__init__()
        self.convs = nn.ModuleList()
        prev = num_fields
        for h in layer_sizes:
            self.convs.append(nn.Conv1d(num_fields * prev, h, kernel_size=1))
            prev = h
        self.out_dim = sum(layer_sizes)

    def forward(self, x0):
        B, Fn, D = x0.shape
        xs, h = [], x0
        for conv in self.convs:
            z = torch.einsum("bhd,bmd->bhmd", x0, h).reshape(B, -1, D)
            h = F.relu(conv(z))
            xs.append(h.sum(dim=2))
        return torch.cat(xs, dim=1)


class XDeepFM(nn.Module):
    def __init__(self, vocab, num_fields, dim, cin, dnn):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Embedding(vocab, 1)
        nn.init.normal_(self.emb.weight, std=0.01)
        nn.init.zeros_(self.lin.weight)
        self.cin = CIN(num_fields, cin)
        layers, d = [], num_fields * dim
        for h in dnn:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU()]
            d = h
        self.dnn = nn.Sequential(*layers)
        self.out = nn.Linear(self.cin.out_dim + d, 1)

    def forward(self, ids):
        e = self.emb(ids)
        lin = self.lin(ids).sum(dim=(1, 2))
        return lin + self.out(torch.cat([self.cin(e), self.dnn(e.flatten(1))], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    probs, labels = [], []
    for ids, y in loader:
        probs.append(torch.sigmoid(model(ids.to(device, non_blocking=True))))
        labels.append(y.to(device, non_blocking=True))
    p, y = torch.cat(probs), torch.cat(labels)
    ws = dist.get_world_size()
    P, Y = [torch.zeros_like(p) for _ in range(ws)], [torch.zeros_like(y) for _ in range(ws)]
    dist.all_gather(P, p)
    dist.all_gather(Y, y)
    p = torch.stack(P, 1).flatten()[:n_total].double()
    y = torch.stack(Y, 1).flatten()[:n_total].double()
    ll = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
    auc = roc_auc_score(y.cpu().numpy(), p.cpu().numpy())
    model.train()
    return auc, ll


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data_dir, "meta.json")) as f:
        meta = json.load(f)

    run = wandb.init(project=args.project, name=args.run_name,
                     config={**vars(args), "world_size": world_size, "vocab": meta["vocab_size"]})

    train = Shard(os.path.join(args.data_dir, "train"))
    valid = Shard(os.path.join(args.data_dir, "valid"))
    sampler = DistributedSampler(train, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid, batch_size=8192, sampler=DistributedSampler(valid, shuffle=False),
                              num_workers=4, pin_memory=True)

    model = XDeepFM(meta["vocab_size"], meta["num_fields"], args.dim,
                    [int(x) for x in args.cin.split(",")], [int(x) for x in args.dnn.split(",")])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    wandb.watch(model, log="gradients", log_freq=1000)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    step, best = 0, -math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, y in train_loader:
            ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(ids)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                wandb.log({"train/loss": loss.item(), "train/epoch": epoch,
                           "train/ex_per_s": 100 * args.bs * world_size / (time.time() - t0)}, step=step)
                t0 = time.time()

            if step % args.eval_every == 0:
                auc, ll = evaluate(model, valid_loader, device, len(valid))
                wandb.log({"valid/auc": auc, "valid/logloss": ll}, step=step)
                if rank == 0 and auc > best:
                    best = auc
                    torch.save({"model": model.module.state_dict(), "step": step, "auc": auc},
                               os.path.join(args.ckpt_dir, f"{run.name}_best.pt"))
                dist.barrier()

    auc, ll = evaluate(model, valid_loader, device, len(valid))
    wandb.log({"valid/auc": auc, "valid/logloss": ll}, step=step)
    wandb.summary["best_auc"] = max(best, auc)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
