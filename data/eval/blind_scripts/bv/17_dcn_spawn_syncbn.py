"""DCN-Mix CTR model launched with torch.multiprocessing.spawn (one process per GPU).

The raw CSV is hashed into a .npz cache in the parent process before any
worker starts, so the workers only ever read a finished cache.

    python 17_dcn_spawn_syncbn.py --gpus 4 --csv /data/coupon_ctr/train.csv
"""
import argparse
import hashlib
import os
import socket
import time
from contextlib import closing

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CAT = ["user_id", "coupon_id", "merchant_id", "coupon_type", "discount_bucket", "distance", "weekday",
       "channel", "city"]
NUM = ["user_hist_redeem", "merchant_hist_redeem", "discount_rate"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/coupon_ctr/train.csv")
    p.add_argument("--cache", default="/data/coupon_ctr/cache")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--buckets", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--valid-frac", type=float, default=0.1)
    p.add_argument("--logdir", default="/data/coupon_ctr/runs/dcn_mix")
    return p.parse_args()


def bucket(field, v, n):
    return int.from_bytes(hashlib.md5(f"{field}:{v}".encode()).digest()[:8], "little") % n


def build_cache(args):
    out = os.path.join(args.cache, f"hashed_{args.buckets}.npz")
    if os.path.exists(out):
        return out
    os.makedirs(args.cache, exist_ok=True)
    df = pd.read_csv(args.csv).sort_values("date")
    cat = np.stack([[bucket(c, v, args.buckets) for v in df[c].astype(str)] for c in CAT], axis=1)
    num = df[NUM].fillna(0).to_numpy(np.float32)
    n_valid = int(len(df) * args.valid_frac)            # last days are the validation set
    tmp = out + ".tmp.npz"
    np.savez(tmp, cat=cat.astype(np.int64), num=num, y=df["redeemed"].to_numpy(np.float32), n_valid=n_valid)
    os.replace(tmp, out)
    return out


class DCNMix(nn.Module):
    """Low-rank mixture-of-experts cross layers + deep tower (DCN-V2 'mix' variant)."""

    def __init__(self, buckets, dim, experts, rank=32, layers=3):
        super().__init__()
        self.emb = nn.Embedding(buckets, dim)
        d = len(CAT) * dim + len(NUM)
        self.U = nn.ParameterList(nn.Parameter(torch.randn(experts, d, rank) * 0.01) for _ in range(layers))
        self.V = nn.ParameterList(nn.Parameter(torch.randn(experts, d, rank) * 0.01) for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(d)) for _ in range(layers))
        self.gate = nn.ModuleList(nn.Linear(d, experts) for _ in range(layers))
        self.deep = nn.Sequential(nn.Linear(d, 256), nn.BatchNorm1d(256), nn.ReLU(),
                                  nn.Linear(256, 128), nn.BatchNorm1d(128), nn.ReLU())
        self.out = nn.Linear(d + 128, 1)
        self.num_bn = nn.BatchNorm1d(len(NUM))

    def forward(self, cat, num):
        x0 = torch.cat([self.emb(cat).flatten(1), self.num_bn(num)], dim=1)
        x = x0
        for U, V, b, g in zip(self.U, self.V, self.b, self.gate):
            low = torch.einsum("bd,edr->ber", x, V)
            up = torch.einsum("ber,edr->bed", torch.tanh(low), U)
            experts = x0.unsqueeze(1) * (up + b)                             # B, E, d
            w = torch.softmax(g(x), dim=-1).unsqueeze(-1)
            x = (w * experts).sum(1) + x
        return self.out(torch.cat([x, self.deep(x0)], dim=1)).squeeze(1)


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker(rank, world_size, args, cache_path, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    z = np.load(cache_path)
    n_valid = int(z["n_valid"])
    cat, num, y = torch.from_numpy(z["cat"]), torch.from_numpy(z["num"]), torch.from_numpy(z["y"])
    num = torch.sign(num) * torch.log1p(num.abs())
    train = TensorDataset(cat[:-n_valid], num[:-n_valid], y[:-n_valid])
    valid = TensorDataset(cat[-n_valid:], num[-n_valid:], y[-n_valid:])

    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True,
                          num_workers=2, pin_memory=True)
    valid_dl = DataLoader(valid, batch_size=4096, num_workers=2, pin_memory=True,
                          sampler=DistributedSampler(valid, num_replicas=world_size, rank=rank, shuffle=False))

    # per-GPU batch is small (512), so BatchNorm statistics are synchronised
    model = nn.SyncBatchNorm.convert_sync_batchnorm(DCNMix(args.buckets, args.dim, args.experts)).to(device)
    model = DDP(model, device_ids=[rank], output_device=rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for c, n, t in train_dl:
            c, n, t = c.to(device, non_blocking=True), n.to(device, non_blocking=True), t.to(device)
            loss = F.binary_cross_entropy_with_logits(model(c, n), t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        model.eval()
        ps, ts = [], []
        with torch.no_grad():
            for c, n, t in valid_dl:
                ps.append(torch.sigmoid(model(c.to(device), n.to(device))))
                ts.append(t.to(device))
        p, t = torch.cat(ps), torch.cat(ts)
        gp = [torch.empty_like(p) for _ in range(world_size)]
        gt = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(gp, p)
        dist.all_gather(gt, t)
        model.train()
        if rank == 0:
            p = torch.stack(gp, 1).flatten()[:len(valid)].cpu().numpy()
            t = torch.stack(gt, 1).flatten()[:len(valid)].cpu().numpy()
            auc = roc_auc_score(t, p)
            writer.add_scalar("valid/auc", auc, step)
            print(f"epoch {epoch} auc {auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.logdir, f"dcn_mix_e{epoch}.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    args = parse_args()
    os.makedirs(args.logdir, exist_ok=True)
    cache_path = build_cache(args)
    world_size = args.gpus
    mp.spawn(worker, args=(world_size, args, cache_path, free_port()), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
