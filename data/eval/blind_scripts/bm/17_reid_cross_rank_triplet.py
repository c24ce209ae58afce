"""Person re-ID (Market-1501 / DukeMTMC-reID) with batch-hard triplet mining over the
embeddings of ALL GPUs: every local anchor is mined against the global batch.

    torchrun --nproc_per_node=4 17_reid_cross_rank_triplet.py --root /data/Market-1501-v15.09.15
"""
import argparse
import glob
import os
import os.path as osp
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision.transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/Market-1501-v15.09.15")
    p.add_argument("--p", type=int, default=8, help="identities per GPU")
    p.add_argument("--k", type=int, default=4, help="images per identity")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ckpt", default="checkpoints/xrank_triplet")
    p.add_argument("--resume", default="")
    return p.parse_args()


def scan(folder, relabel):
    items = []
    for f in sorted(glob.glob(osp.join(folder, "*.jpg"))):
        m = re.search(r"([-\d]+)_c(\d)", osp.basename(f))
        pid, cam = int(m.group(1)), int(m.group(2))
        if pid != -1:
            items.append((f, pid, cam))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({x[1] for x in items}))}
        items = [(f, lut[pid], cam) for f, pid, cam in items]
    return items


class ReIDData(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        f, pid, cam = self.items[idx]
        return self.tf(Image.open(f).convert("RGB")), pid, cam, idx


class GlobalPKSampler(Sampler):
    """Same seed on every rank -> same global identity order; each rank takes disjoint identities."""

    def __init__(self, items, p, k, rank, world, seed):
        self.groups = {}
        for i, (_, pid, _) in enumerate(items):
            self.groups.setdefault(pid, []).append(i)
        self.p, self.k, self.rank, self.world, self.seed, self.epoch = p, k, rank, world, seed, 0
        self.steps = len(self.groups) // (p * world)

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.steps * self.p * self.k

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        pids = sorted(self.groups)
        order = [pids[i] for i in torch.randperm(len(pids), generator=g).tolist()]
        for s in range(self.steps):
            start = (s * self.world + self.rank) * self.p
            for pid in order[start:start + self.p]:
                idxs = self.groups[pid]
                pick = torch.randint(len(idxs), (self.k,), generator=g) if len(idxs) < self.k else \
                    torch.randperm(len(idxs), generator=g)[: self.k]
                yield from (idxs[j] for j in pick.tolist())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.neck = nn.BatchNorm1d(2048)

    def forward(self, x):
        return self.neck(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))


def global_batch_hard(local_feats, local_pids, margin):
    rank, world = dist.get_rank(), dist.get_world_size()
    # differentiable gather: other ranks' anchors push gradients back into our features
    all_feats = torch.cat(dist_nn.all_gather(local_feats), dim=0)
    pid_list = [torch.empty_like(local_pids) for _ in range(world)]
    dist.all_gather(pid_list, local_pids)
    all_pids = torch.cat(pid_list)
    b = local_feats.size(0)
    d = torch.cdist(local_feats, all_feats)
    same = local_pids[:, None] == all_pids[None, :]
    self_mask = torch.zeros_like(same)
    ar = torch.arange(b, device=same.device)
    self_mask[ar, rank * b + ar] = True
    pos = same & ~self_mask
    d_ap = d.masked_fill(~pos, -1.0).max(1).values
    d_an = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(d_ap - d_an + margin).mean(), (d_an > d_ap).float().mean()


@torch.no_grad()
def features(model, loader, device):
    model.eval()
    out = []
    for x, pid, cam, idx in loader:
        x = x.to(device, non_blocking=True)
        f = F.normalize(model(x) + model(x.flip(3)))
        out.append((f.cpu(), pid, cam, idx))
    model.train()
    f = torch.cat([o[0] for o in out])
    meta = torch.stack([torch.cat([o[j] for o in out]) for j in (1, 2, 3)], dim=1)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (f, meta))
    f = torch.cat([p[0] for p in parts])
    meta = torch.cat([p[1] for p in parts])
    _, keep = np.unique(meta[:, 2].numpy(), return_index=True)
    return f[keep], meta[keep, 0].numpy(), meta[keep, 1].numpy()


def market_map(qf, qp, qc, gf, gp, gc):
    order = np.argsort(-(qf @ gf.T).numpy(), axis=1)
    aps, top1 = [], []
    for i in range(len(qp)):
        o = order[i]
        valid = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        good = (gp[o] == qp[i])[valid]
        if not good.any():
            continue
        top1.append(good[0])
        pos = np.flatnonzero(good)
        aps.append(np.mean(np.arange(1, len(pos) + 1) / (pos + 1)))
    return float(np.mean(aps)), float(np.mean(top1))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_items = scan(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = scan(osp.join(args.root, "query"), relabel=False)
    gallery = scan(osp.join(args.root, "bounding_box_test"), relabel=False)
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing()])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = GlobalPKSampler(train_items, args.p, args.k, rank, world, args.seed)
    train_loader = DataLoader(ReIDData(train_items, train_tf), batch_size=args.p * args.k, sampler=sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    qset, gset = ReIDData(query, test_tf), ReIDData(gallery, test_tf)
    q_loader = DataLoader(qset, 256, sampler=DistributedSampler(qset, shuffle=False), num_workers=6)
    g_loader = DataLoader(gset, 256, sampler=DistributedSampler(gset, shuffle=False), num_workers=6)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).to(device)
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [40, 60], 0.1)

    start = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["epoch"] + 1

    writer = SummaryWriter(args.ckpt) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
    step = start * len(train_loader)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, pid, _, _ in train_loader:
            x, pid = x.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            loss, prec = global_batch_hard(model(x), pid, args.margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/prec", prec.item(), step)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} prec {prec.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 10 == 0:
            qf, qp, qc = features(model, q_loader, device)
            gf, gp, gc = features(model, g_loader, device)
            if rank == 0:
                mAP, r1 = market_map(qf, qp, qc, gf, gp, gc)
                writer.add_scalar("test/mAP", mAP, epoch)
                writer.add_scalar("test/rank1", r1, epoch)
                print(f"epoch {epoch}: mAP {mAP:.4f} rank-1 {r1:.4f}", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, osp.join(args.ckpt, "last.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
