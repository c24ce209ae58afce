"""Point Cloud Transformer (PCT-style) on ScanObjectNN (PB_T50_RS), DDP + EMA + stochastic depth.

Old launcher (cluster image still has torch 1.13 on some nodes, 2.x on others):
    python -m torch.distributed.launch --nproc_per_node=4 17_pct_scanobjectnn_ema.py --data data/h5_files/main_split
"""
import argparse
import copy
import math
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    # torch.distributed.launch passes --local_rank (<2.0) or --local-rank (>=2.0)
    p.add_argument('--local_rank', '--local-rank', type=int, default=int(os.environ.get('LOCAL_RANK', 0)))
    p.add_argument('--data', default='data/h5_files/main_split')
    p.add_argument('--npoints', type=int, default=1024)
    p.add_argument('--bs', type=int, default=32)
    p.add_argument('--epochs', type=int, default=250)
    p.add_argument('--lr', type=float, default=5e-4)
    p.add_argument('--wd', type=float, default=0.05)
    p.add_argument('--drop_path', type=float, default=0.1)
    p.add_argument('--ema', type=float, default=0.999)
    p.add_argument('--out', default='runs/pct_sonn')
    return p.parse_args()


class ScanObjectNN(Dataset):
    def __init__(self, root, train, npoints):
        name = 'training_objectdataset_augmentedrot_scale75.h5' if train else 'test_objectdataset_augmentedrot_scale75.h5'
        with h5py.File(os.path.join(root, name), 'r') as f:
            self.pts = f['data'][:].astype(np.float32)
            self.lbl = f['label'][:].astype(np.int64)
        self.train, self.n = train, npoints

    def __len__(self):
        return len(self.lbl)

    def __getitem__(self, i):
        p = self.pts[i][:self.n].copy()
        if self.train:
            np.random.shuffle(p)
            p = p * np.random.uniform(2 / 3, 3 / 2, (1, 3)).astype(np.float32) + np.random.uniform(-0.2, 0.2, (1, 3)).astype(np.float32)
        return torch.from_numpy(p), self.lbl[i]


class SequentialDistributedSampler(Sampler):
    """Contiguous chunks, padded so every rank has the same length; results are
    gathered in rank order and cut back to len(dataset)."""

    def __init__(self, dataset, rank, world):
        self.n = len(dataset)
        self.per = int(math.ceil(self.n / world))
        idx = list(range(self.n))
        idx += idx[:self.per * world - self.n]
        self.idx = idx[rank * self.per:(rank + 1) * self.per]

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return self.per


def knn_group(x, k):
    d = torch.cdist(x, x)
    return d.topk(k, largest=False, dim=-1)[1]


class Embed(nn.Module):
    def __init__(self, d, k=16):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Conv2d(6, d // 2, 1, bias=False), nn.BatchNorm2d(d // 2), nn.GELU(),
                                 nn.Conv2d(d // 2, d, 1, bias=False), nn.BatchNorm2d(d), nn.GELU())

    def forward(self, xyz):
        idx = knn_group(xyz, self.k)                                     # B N k
        nb = torch.gather(xyz[:, None].expand(-1, xyz.size(1), -1, -1), 2, idx[..., None].expand(-1, -1, -1, 3))
        feat = torch.cat([nb - xyz[:, :, None], xyz[:, :, None].expand_as(nb)], -1)  # B N k 6
        return self.mlp(feat.permute(0, 3, 1, 2)).max(-1)[0].transpose(1, 2)  # B N d


class Block(nn.Module):
    def __init__(self, d, heads, drop_path):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop_path = drop_path

    def forward(self, x):
        # stochastic depth at the block level: the whole block is skipped for this step
        if self.training and random.random() < self.drop_path:
            return x
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class PCT(nn.Module):
    def __init__(self, n_cls=15, d=256, depth=8, heads=8, drop_path=0.1):
        super().__init__()
        self.embed = Embed(d)
        dpr = [drop_path * i / (depth - 1) for i in range(depth)]
        self.blocks = nn.ModuleList([Block(d, heads, dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(2 * d, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Dropout(0.5), nn.Linear(256, n_cls))

    def forward(self, xyz):
        x = self.embed(xyz)
        for b in self.blocks:
            x = b(x)
        x = self.norm(x)
        return self.head(torch.cat([x.max(1)[0], x.mean(1)], -1))


@torch.no_grad()
def evaluate(net, loader, n_total, device, world):
    net.eval()
    preds, labels = [], []
    for pts, y in loader:
        preds.append(net(pts.to(device)).argmax(-1))
        labels.append(y.to(device))
    preds, labels = torch.cat(preds), torch.cat(labels)
    # same length on every rank thanks to the padded sampler
    p_all = [torch.empty_like(preds) for _ in range(world)]
    y_all = [torch.empty_like(labels) for _ in range(world)]
    dist.all_gather(p_all, preds)
    dist.all_gather(y_all, labels)
    p_all, y_all = torch.cat(p_all)[:n_total], torch.cat(y_all)[:n_total]
    oa = (p_all == y_all).float().mean().item()
    per_cls = [(p_all[y_all == c] == c).float().mean().item() for c in y_all.unique()]
    return oa, float(np.mean(per_cls))


@torch.no_grad()
def ema_update(ema, model, decay):
    msd = model.state_dict()
    for k, v in ema.state_dict().items():
        if v.dtype.is_floating_point:
            v.mul_(decay).add_(msd[k].detach(), alpha=1 - decay)
        else:
            v.copy_(msd[k])


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', args.local_rank)
    random.seed(rank)
    np.random.seed(rank)

    tr, te = ScanObjectNN(args.data, True, args.npoints), ScanObjectNN(args.data, False, args.npoints)
    tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_loader = DataLoader(tr, args.bs, sampler=tr_sampler, num_workers=6, drop_last=True, pin_memory=True)
    te_loader = DataLoader(te, 64, sampler=SequentialDistributedSampler(te, rank, world), num_workers=4)

    torch.manual_seed(0)
    model = PCT(drop_path=args.drop_path)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ema = copy.deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    # blocks dropped by stochastic depth have no grad in that step (and differ per rank)
    model = DDP(model, device_ids=[args.local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.bs / 128, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(tr_loader), eta_min=1e-6)
    crit = nn.CrossEntropyLoss(label_smoothing=0.2)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for pts, y in tr_loader:
            pts, y = pts.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(pts), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema_update(ema, model.module, args.ema)

        oa, macc = evaluate(model.module, te_loader, len(te), device, world)
        ema_oa, _ = evaluate(ema, te_loader, len(te), device, world)
        if rank == 0:
            print(f'ep {epoch} loss {loss.item():.3f} OA {oa * 100:.2f} mAcc {macc * 100:.2f} EMA-OA {ema_oa * 100:.2f} '
                  f'({time.time() - t0:.0f}s)')
            writer.add_scalar('test/oa', oa, epoch)
            writer.add_scalar('test/ema_oa', ema_oa, epoch)
            if max(oa, ema_oa) > best:
                best = max(oa, ema_oa)
                torch.save({'model': model.module.state_dict(), 'ema': ema.state_dict(), 'epoch': epoch,
                            'oa': oa, 'ema_oa': ema_oa}, os.path.join(args.out, 'best.pth'))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
