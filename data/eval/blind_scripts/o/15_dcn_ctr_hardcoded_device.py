# DCN-v2 CTR model on Avazu, torchrun on 4 cards.
#   torchrun --standalone --nproc_per_node=4 15_dcn_ctr_hardcoded_device.py --data /data/avazu
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
FIELDS = 22


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/avazu")
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--deep", default="1024,512,256")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="ckpt/dcnv2_avazu.pt")
    return p.parse_args()


class AvazuTensors(Dataset):
    """preprocessed with prep_avazu.py: X (N, 22) int32 with per-field offsets, y (N,) uint8"""

    def __init__(self, root, split):
        self.X = np.load(os.path.join(root, f"{split}_X.npy"), mmap_mode="r")
        self.y = np.load(os.path.join(root, f"{split}_y.npy"), mmap_mode="r")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.X[i].astype(np.int64)), torch.tensor(float(self.y[i]))


class CrossNetV2(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.W = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for lin in self.W:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    def __init__(self, vocab_size, emb_dim, cross_layers, deep):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim)
        nn.init.normal_(self.emb.weight, std=1e-4)
        d = FIELDS * emb_dim
        self.cross = CrossNetV2(d, cross_layers)
        layers, c = [], d
        for h in deep:
            layers += [nn.Linear(c, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1)]
            c = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d + c, 1)

    def forward(self, x):
        e = self.emb(x).flatten(1)
        return self.out(torch.cat([self.cross(e), self.deep(e)], 1)).squeeze(1)


def to_device(batch):
    x, y = batch
    return x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, labels = [], []
    for x, y in loader:
        preds.append(torch.sigmoid(model(x.to(device))))
        labels.append(y.to(device))
    p, l = torch.cat(preds), torch.cat(labels)
    world = dist.get_world_size()
    # ranks may hold a different number of samples: pad to max before all_gather
    n = torch.tensor([p.numel()], device=device)
    ns = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(ns, n)
    m = int(max(t.item() for t in ns))
    pp = torch.zeros(m, device=device)
    ll = torch.zeros(m, device=device)
    pp[:p.numel()], ll[:l.numel()] = p, l
    gp = [torch.zeros_like(pp) for _ in range(world)]
    gl = [torch.zeros_like(ll) for _ in range(world)]
    dist.all_gather(gp, pp)
    dist.all_gather(gl, ll)
    model.train()
    p_all = torch.cat([g[:k.item()] for g, k in zip(gp, ns)]).cpu().numpy()
    l_all = torch.cat([g[:k.item()] for g, k in zip(gl, ns)]).cpu().numpy()
    return roc_auc_score(l_all, p_all), log_loss(l_all, np.clip(p_all, 1e-7, 1 - 1e-7))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    train_ds, val_ds = AvazuTensors(args.data, "train"), AvazuTensors(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_sub = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_sub, batch_size=16384, num_workers=4, pin_memory=True)

    model = DCNv2(meta["vocab_size"], args.emb_dim, args.cross_layers, [int(h) for h in args.deep.split(",")])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        for step, batch in enumerate(train_loader):
            x, y = to_device(batch)
            loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += x.shape[0]
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.5f} "
                      f"{seen * world / (time.time() - t0):.0f} samples/s", flush=True)

        auc, ll = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val AUC {auc:.5f} logloss {ll:.5f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
