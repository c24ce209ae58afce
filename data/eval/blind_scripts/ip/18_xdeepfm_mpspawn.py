"""xDeepFM (CIN + DNN) on one multi-GPU box, started with torch.multiprocessing.spawn.

    python 18_xdeepfm_mpspawn.py --train_glob '/ssd/ads/hashed/2024-07-0[1-6].npz' \
        --valid /ssd/ads/hashed/2024-07-07.npz --init /ssd/ads/models/xdeepfm_prev.pt
"""
import argparse
import glob
import math
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class HashedNpz(Dataset):
    def __init__(self, path, num_fields, bucket):
        z = np.load(path)
        ids = z["ids"][:, :num_fields].astype(np.int64) % bucket
        self.ids = torch.from_numpy(ids + np.arange(num_fields, dtype=np.int64) * bucket)
        self.y = torch.from_numpy(z["click"].astype(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.ids[i], self.y[i]


class CIN(nn.Module):
    def __init__(self, num_fields, layer_sizes):
        super().__init__()
        self.convs = nn.ModuleList()
        prev = num_fields
        for h in layer_sizes:
            self.convs.append(nn.Conv1d(num_fields * prev, h, kernel_size=1))
            prev = h
        self.out_dim = sum(layer_sizes)

    def forward(self, x0):                      # B, m, D
        B, m, D = x0.shape
        xs, x = [], x0
        for conv in self.convs:
            z = torch.einsum("bmd,bhd->bmhd", x0, x).reshape(B, -1, D)
            x = F.relu(conv(z))
            xs.append(x.sum(-1))
        return torch.cat(xs, 1)


class XDeepFM(nn.Module):
    def __init__(self, num_fields, bucket, dim, cin_sizes, dnn_sizes):
        super().__init__()
        self.emb = nn.Embedding(num_fields * bucket, dim)
        self.lin = nn.Embedding(num_fields * bucket, 1)
        nn.init.normal_(self.emb.weight, std=1e-3)
        nn.init.zeros_(self.lin.weight)
        self.cin = CIN(num_fields, cin_sizes)
        layers, d = [], num_fields * dim
        for h in dnn_sizes:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.dnn = nn.Sequential(*layers)
        self.head = nn.Linear(self.cin.out_dim + d, 1)

    def forward(self, ids):
        e = self.emb(ids)
        z = torch.cat([self.cin(e), self.dnn(e.flatten(1))], 1)
        return (self.head(z) + self.lin(ids).sum(1)).squeeze(1)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@torch.no_grad()
def gather_scores(net, loader, device, world):
    net.eval()
    p, y = [], []
    for ids, lab in loader:
        p.append(torch.sigmoid(net(ids.to(device))))
        y.append(lab.to(device))
    net.train()
    p, y = torch.cat(p), torch.cat(y)
    n = torch.tensor([p.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    pad = lambda t: torch.cat([t, t.new_zeros(m - t.numel())])
    ps = [torch.empty(m, device=device) for _ in range(world)]
    ys = [torch.empty(m, device=device) for _ in range(world)]
    dist.all_gather(ps, pad(p))
    dist.all_gather(ys, pad(y))
    keep = [slice(0, int(s.item())) for s in sizes]
    return (torch.cat([t[k] for t, k in zip(ps, keep)]).double(),
            torch.cat([t[k] for t, k in zip(ys, keep)]).double())


def auc_and_logloss(p, y):
    order = p.argsort()
    ranks = torch.empty_like(p)
    ranks[order] = torch.arange(1, p.numel() + 1, dtype=p.dtype, device=p.device)
    npos = y.sum()
    auc = ((ranks * y).sum() - npos * (npos + 1) / 2) / (npos * (p.numel() - npos))
    ll = F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y)
    return auc.item(), ll.item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    train_ds = ConcatDataset([HashedNpz(f, args.num_fields, args.bucket)
                              for f in sorted(glob.glob(args.train_glob))])
    valid_ds = HashedNpz(args.valid, args.num_fields, args.bucket)
    valid_part = Subset(valid_ds, range(rank, len(valid_ds), world_size))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=5)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_part, batch_size=8192, num_workers=2)

    torch.manual_seed(5)
    net = XDeepFM(args.num_fields, args.bucket, args.dim, args.cin, args.dnn)
    if args.init:
        state = torch.load(args.init, map_location="cpu")["model"]
        consume_prefix_in_state_dict_if_present(state, "module.")
        net.load_state_dict(state)
    model = DDP(net.to(device), device_ids=[rank])

    # base_lr is tuned for a global batch of 4096; scale linearly and warm up
    lr = args.base_lr * args.batch_size * world_size / 4096
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    total = args.epochs * len(train_dl)
    warmup = max(1, int(0.02 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    run = None
    if rank == 0:
        import wandb
        run = wandb.init(project="ads-xdeepfm", config={**vars(args), "world_size": world_size, "lr": lr})

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (ids, y) in enumerate(train_dl):
            ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(ids), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if run is not None and it % 100 == 0:
                run.log({"loss": loss.item(), "lr": sched.get_last_lr()[0]})
        p, y = gather_scores(model.module, valid_dl, device, world_size)
        if rank == 0:
            auc, ll = auc_and_logloss(p, y)
            run.log({"epoch": epoch, "val_auc": auc, "val_logloss": ll, "epoch_s": time.time() - t0})
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_auc": auc}, args.out)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", default="/ssd/ads/hashed/2024-07-0[1-6].npz")
    ap.add_argument("--valid", default="/ssd/ads/hashed/2024-07-07.npz")
    ap.add_argument("--init", default="")
    ap.add_argument("--out", default="/ssd/ads/models/xdeepfm.pt")
    ap.add_argument("--num_fields", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=10)
    ap.add_argument("--cin", type=int, nargs="+", default=[200, 200, 200])
    ap.add_argument("--dnn", type=int, nargs="+", default=[400, 400])
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--base_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
