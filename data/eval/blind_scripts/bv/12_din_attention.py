"""Deep Interest Network (DIN) on e-commerce click logs.

Each sample: user profile ids, candidate item (id, category, shop), and the
user's last MAX_LEN behaviours (item, category). Attention over the history is
conditioned on the candidate.

    torchrun --nproc_per_node=8 12_din_attention.py --data /data/ecom/din_tfrec_npz --epochs 2
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_LEN = 100


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/data/ecom/din_npz")
    parser.add_argument("--n-items", type=int, default=4_200_000)
    parser.add_argument("--n-cates", type=int, default=10_000)
    parser.add_argument("--n-shops", type=int, default=600_000)
    parser.add_argument("--n-profile", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", default="/data/ecom/runs/din")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class DinData(Dataset):
    def __init__(self, path):
        z = np.load(path)
        self.profile = z["profile"]        # [N, 6]
        self.cand = z["cand"]              # [N, 3] item, cate, shop
        self.hist = z["hist"]              # [N, MAX_LEN, 2] item, cate, left padded with 0
        self.label = z["label"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.profile[i].astype(np.int64), self.cand[i].astype(np.int64), \
            self.hist[i].astype(np.int64), self.label[i]


class Dice(nn.Module):
    def __init__(self, d, eps=1e-8):
        super().__init__()
        self.bn = nn.BatchNorm1d(d, eps=eps, affine=False)
        self.alpha = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        p = torch.sigmoid(self.bn(x2)).reshape(shape)
        return p * x + (1 - p) * self.alpha * x


class ActivationUnit(nn.Module):
    def __init__(self, d, hidden=80):
        super().__init__()
        self.fc1 = nn.Linear(4 * d, hidden)
        self.act = Dice(hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, query, keys, mask):
        q = query.unsqueeze(1).expand_as(keys)
        x = torch.cat([q, keys, q - keys, q * keys], dim=-1)
        w = self.fc2(self.act(self.fc1(x))).squeeze(-1)
        w = w.masked_fill(~mask, 0.0)           # DIN keeps un-normalised weights
        return (w.unsqueeze(-1) * keys).sum(1)


class DIN(nn.Module):
    def __init__(self, a):
        super().__init__()
        d = a.dim
        self.item = nn.Embedding(a.n_items, d, padding_idx=0)
        self.cate = nn.Embedding(a.n_cates, d, padding_idx=0)
        self.shop = nn.Embedding(a.n_shops, d)
        self.profile = nn.Embedding(a.n_profile, d)
        self.att = ActivationUnit(2 * d)
        self.mlp = nn.Sequential(nn.Linear(6 * d + 2 * d + d + 2 * d, 200), Dice(200),
                                 nn.Linear(200, 80), Dice(80), nn.Linear(80, 1))

    def forward(self, profile, cand, hist):
        p = self.profile(profile).flatten(1)
        c = torch.cat([self.item(cand[:, 0]), self.cate(cand[:, 1])], -1)
        s = self.shop(cand[:, 2])
        h = torch.cat([self.item(hist[..., 0]), self.cate(hist[..., 1])], -1)
        mask = hist[..., 0] > 0
        interest = self.att(c, h, mask)
        return self.mlp(torch.cat([p, c, s, interest], -1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    out_p, out_y = [], []
    for profile, cand, hist, y in loader:
        out_p.append(torch.sigmoid(model(profile.to(device), cand.to(device), hist.to(device))))
        out_y.append(y.to(device))
    p, y = torch.cat(out_p), torch.cat(out_y)
    world = dist.get_world_size()
    gp = [torch.zeros_like(p) for _ in range(world)]
    gy = [torch.zeros_like(y) for _ in range(world)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    model.train()
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(message)s")
    log = logging.getLogger(__name__)

    train = DinData(os.path.join(args.data, "train.npz"))
    test = DinData(os.path.join(args.data, "test.npz"))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test, batch_size=4096, num_workers=4, pin_memory=True,
                             sampler=DistributedSampler(test, num_replicas=world, rank=rank, shuffle=False))

    model = nn.SyncBatchNorm.convert_sync_batchnorm(DIN(args)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (profile, cand, hist, y) in enumerate(train_loader):
            profile, cand = profile.to(device, non_blocking=True), cand.to(device, non_blocking=True)
            hist, y = hist.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(profile, cand, hist), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 200 == 0:
                log.info("epoch %d iter %d/%d loss %.4f %.1fs", epoch, it, len(train_loader),
                         loss.item(), time.time() - t0)

        auc = evaluate(model, test_loader, device, len(test))
        if rank == 0:
            log.info("epoch %d test auc %.4f", epoch, auc)
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(args.save, "din_best.pt"))
        dist.barrier()

    if rank == 0:
        log.info("best test auc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
