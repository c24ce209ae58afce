"""
Global + horizontal-part (PCB-like) re-ID model on DukeMTMC-reID.

Schedule: the global BNNeck branch is trained alone for the first
--part-start epochs, then the part branch joins (its stripes are unstable
on a cold backbone).

    torchrun --nnodes=1 --nproc_per_node=4 08_duke_global_part.py --root /data/DukeMTMC-reID
"""
import argparse
import os
import random
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--pretrained", default="/data/models/resnet50-19c8e357.pth")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--part-start", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=3.5e-4)
    ap.add_argument("--out", default="out/duke_gp")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def scan(folder, relabel):
    rx = re.compile(r"([-\d]+)_c(\d)")
    rows = []
    for p in sorted(glob(os.path.join(folder, "*.jpg"))):
        pid, cam = map(int, rx.search(p).groups())
        rows.append((p, pid, cam - 1))
    if relabel:
        m = {pid: i for i, pid in enumerate(sorted({r[1] for r in rows}))}
        rows = [(p, m[pid], c) for p, pid, c in rows]
    return rows


class Images(Dataset):
    def __init__(self, rows, tf):
        self.rows, self.tf = rows, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, pid, cam = self.rows[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedPK(Sampler):
    def __init__(self, rows, batch, k, rank, world, seed=1):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.local = batch // world
        self.epoch = 0
        self.groups = defaultdict(list)
        for i, (_, pid, _) in enumerate(rows):
            self.groups[pid].append(i)
        self.keys = sorted(self.groups)
        self.n = sum(max(len(v), k) // k for v in self.groups.values()) * k // batch

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.n * self.local

    def __iter__(self):
        r = random.Random(self.seed + self.epoch)
        chunks = {}
        for key in self.keys:
            v = self.groups[key][:]
            while len(v) < self.k:
                v.append(r.choice(self.groups[key]))
            r.shuffle(v)
            chunks[key] = [v[i:i + self.k] for i in range(0, len(v) - self.k + 1, self.k)]
        live, order = list(self.keys), []
        while len(live) >= self.batch // self.k and len(order) < self.n * self.batch:
            for key in r.sample(live, self.batch // self.k):
                order += chunks[key].pop()
                if not chunks[key]:
                    live.remove(key)
        for b in range(len(order) // self.batch):
            yield from order[b * self.batch + self.rank * self.local: b * self.batch + (self.rank + 1) * self.local]


class GlobalPartNet(nn.Module):
    def __init__(self, num_classes, parts, pretrained):
        super().__init__()
        r = resnet50()
        r.load_state_dict(torch.load(pretrained, map_location="cpu"))
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.parts = parts
        self.use_parts = False
        self.g_neck = nn.BatchNorm1d(2048)
        self.g_neck.bias.requires_grad_(False)
        self.g_cls = nn.Linear(2048, num_classes, bias=False)
        self.p_reduce = nn.ModuleList([nn.Sequential(nn.Linear(2048, 256, bias=False), nn.BatchNorm1d(256),
                                                     nn.ReLU(inplace=True)) for _ in range(parts)])
        self.p_cls = nn.ModuleList([nn.Linear(256, num_classes, bias=False) for _ in range(parts)])
        for m in [self.g_cls, *self.p_cls]:
            nn.init.normal_(m.weight, std=0.001)

    def forward(self, x):
        fmap = self.backbone(x)
        g = F.adaptive_avg_pool2d(fmap, 1).flatten(1)
        g_bn = self.g_neck(g)
        if not self.training:
            stripes = F.adaptive_avg_pool2d(fmap, (self.parts, 1)).flatten(2)
            p = [red(stripes[:, :, i]) for i, red in enumerate(self.p_reduce)]
            return torch.cat([F.normalize(g_bn, dim=1)] + [F.normalize(t, dim=1) for t in p], 1)
        out = {"g_logits": self.g_cls(g_bn), "g_feat": g}
        if self.use_parts:
            stripes = F.adaptive_avg_pool2d(fmap, (self.parts, 1)).flatten(2)
            out["p_logits"] = [cls(red(stripes[:, :, i]))
                               for i, (red, cls) in enumerate(zip(self.p_reduce, self.p_cls))]
        return out


def hard_triplet(f, y, margin=0.3):
    d = torch.cdist(f, f)
    same = y[:, None] == y[None]
    return F.relu(d.masked_fill(~same, 0).amax(1) - d.masked_fill(same, 1e5).amin(1) + margin).mean()


def evaluate(dist_mat, qp, gp, qc, gc):
    idx = np.argsort(dist_mat, 1)
    aps, cmc1, cmc5 = [], [], []
    for i in range(len(qp)):
        o = idx[i]
        good = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        m = gp[o][good] == qp[i]
        if not m.any():
            continue
        hits = np.flatnonzero(m)
        aps.append(np.mean(np.arange(1, len(hits) + 1) / (hits + 1)))
        cmc1.append(hits[0] < 1)
        cmc5.append(hits[0] < 5)
    return np.mean(aps), np.mean(cmc1), np.mean(cmc5)


@torch.no_grad()
def test(net, query, gallery, tf, device):
    net.eval()
    loader = DataLoader(Images(query + gallery, tf), batch_size=256, num_workers=8, pin_memory=True)
    f = torch.cat([net(x.to(device, non_blocking=True)) for x, _, _ in loader])
    qf, gf = f[:len(query)], f[len(query):]
    d = (-qf @ gf.t()).cpu().numpy()
    arr = lambda rows, j: np.array([r[j] for r in rows])
    return evaluate(d, arr(query, 1), arr(gallery, 1), arr(query, 2), arr(gallery, 2))


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    train = scan(os.path.join(args.root, "bounding_box_train"), True)
    query = scan(os.path.join(args.root, "query"), False)
    gallery = scan(os.path.join(args.root, "bounding_box_test"), False)
    n_cls = len({r[1] for r in train})

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((384, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])
    sampler = DistributedPK(train, args.batch, args.k, rank, world)
    loader = DataLoader(Images(train, tf), batch_size=args.batch // world, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=True)

    net = GlobalPartNet(n_cls, args.parts, args.pretrained)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DistributedDataParallel(net, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [40, 70], 0.1)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.use_parts = epoch >= args.part_start
        model.train()
        t0 = time.time()
        run = torch.zeros(3, device=dev)
        for x, y, _ in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            out = model(x)
            l_g = ce(out["g_logits"], y) + hard_triplet(out["g_feat"], y)
            l_p = sum(ce(z, y) for z in out["p_logits"]) / args.parts if "p_logits" in out else torch.zeros_like(l_g)
            loss = l_g + l_p
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([l_g.detach(), l_p.detach(), torch.ones_like(l_g)])
        sched.step()
        dist.all_reduce(run)
        if rank == 0:
            print(f"ep {epoch + 1:3d} global {run[0] / run[2]:.3f} part {run[1] / run[2]:.3f} "
                  f"parts={'on' if net.use_parts else 'off'} {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % 10 == 0:
                mAP, r1, r5 = test(net, query, gallery, test_tf, dev)
                print(f"  mAP {mAP:.4f} R1 {r1:.4f} R5 {r5:.4f}", flush=True)
                torch.save(net.state_dict(), os.path.join(args.out, f"gp_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
