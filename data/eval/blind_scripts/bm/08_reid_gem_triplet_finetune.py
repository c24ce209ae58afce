"""Re-ID training with GeM pooling; supports softmax+triplet pre-training and a
triplet-only fine-tuning stage that starts from the softmax model.

    torchrun --nproc_per_node=4 08_reid_gem_triplet_finetune.py \
        --loss triplet --init logs/stage1/model_final.pth --out logs/stage2
"""
import argparse
import os
import os.path as osp
import re
import random
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_parser():
    parser = argparse.ArgumentParser("reid")
    parser.add_argument("--root", default="/data/market1501")
    parser.add_argument("--loss", choices=["softmax_triplet", "triplet"], default="softmax_triplet")
    parser.add_argument("--init", default="", help="weights to start from (full model)")
    parser.add_argument("--P", type=int, default=16)
    parser.add_argument("--K", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3.5e-4)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--margin", type=float, default=0.3)
    parser.add_argument("--out", default="logs/stage1")
    return parser


def market_list(folder, relabel=False):
    pat = re.compile(r"([-\d]+)_c(\d)")
    rows = []
    for p in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, pat.search(p).groups())
        if pid >= 0:
            rows.append([p, pid, cam])
    if relabel:
        ids = {pid: i for i, pid in enumerate(sorted({r[1] for r in rows}))}
        for r in rows:
            r[1] = ids[r[1]]
    return rows


class ImageList(Dataset):
    def __init__(self, rows, tf):
        self.rows, self.tf = rows, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, pid, cam = self.rows[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam, i


class BalancedIdentitySampler(Sampler):
    """Global P*K batches drawn with a seed shared by all ranks; rank r takes every world-th batch."""

    def __init__(self, rows, P, K, rank, world, seed=0):
        self.by_pid = defaultdict(list)
        for i, r in enumerate(rows):
            self.by_pid[r[1]].append(i)
        self.P, self.K, self.rank, self.world, self.seed = P, K, rank, world, seed
        self.epoch = 0
        self.num_batches = (len(self.by_pid) // P) // world

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.num_batches * self.P * self.K

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)
        pids = sorted(self.by_pid)
        g.shuffle(pids)
        for b in range(self.num_batches):
            chunk = pids[(b * self.world + self.rank) * self.P:(b * self.world + self.rank + 1) * self.P]
            for pid in chunk:
                idxs = self.by_pid[pid]
                picks = g.sample(idxs, self.K) if len(idxs) >= self.K else [g.choice(idxs) for _ in range(self.K)]
                yield from picks


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p)


class ReIDNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        self.pool = GeM()
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)

    def forward(self, x):
        feat = self.pool(self.backbone(x)).flatten(1)
        bn_feat = self.neck(feat)
        if not self.training:
            return bn_feat
        return self.classifier(bn_feat), feat


def hard_triplet(f, y, margin):
    d = torch.cdist(f, f, p=2)
    pos = y[:, None] == y[None, :]
    ap = torch.where(pos, d, torch.zeros_like(d)).max(1).values
    an = torch.where(~pos, d, torch.full_like(d, float("inf"))).min(1).values
    return F.margin_ranking_loss(an, ap, torch.ones_like(ap), margin=margin)


@torch.no_grad()
def gather_features(model, loader, device):
    model.eval()
    local = []
    for x, pid, cam, idx in loader:
        f = model(x.to(device)) + model(x.flip(3).to(device))
        local.append((F.normalize(f).cpu(), pid, cam, idx))
    model.train()
    feats = torch.cat([l[0] for l in local])
    meta = torch.stack([torch.cat([l[k] for l in local]) for k in (1, 2, 3)], 1)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (feats, meta))
    feats = torch.cat([o[0] for o in out])
    meta = torch.cat([o[1] for o in out])
    _, first = np.unique(meta[:, 2].numpy(), return_index=True)
    return feats[first], meta[first, 0].numpy(), meta[first, 1].numpy()


def evaluate(qf, qp, qc, gf, gp, gc):
    dist_mat = 1 - qf @ gf.t()
    order = dist_mat.argsort(dim=1).numpy()
    aps, r1 = [], []
    for i in range(len(qp)):
        o = order[i]
        valid = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        m = (gp[o] == qp[i])[valid]
        if m.sum() == 0:
            continue
        r1.append(float(m[0]))
        hits = np.cumsum(m)
        aps.append(float((hits[m] / (np.flatnonzero(m) + 1)).mean()))
    return float(np.mean(aps)), float(np.mean(r1))


def main():
    args = get_parser().parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_rows = market_list(osp.join(args.root, "bounding_box_train"), relabel=True)
    q_rows = market_list(osp.join(args.root, "query"))
    g_rows = market_list(osp.join(args.root, "bounding_box_test"))
    train_tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10),
                          T.RandomCrop((384, 128)), T.ToTensor(), norm, T.RandomErasing()])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])

    sampler = BalancedIdentitySampler(train_rows, args.P, args.K, rank, world)
    train_loader = DataLoader(ImageList(train_rows, train_tf), batch_size=args.P * args.K, sampler=sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    q_set, g_set = ImageList(q_rows, test_tf), ImageList(g_rows, test_tf)
    q_loader = DataLoader(q_set, batch_size=128, sampler=DistributedSampler(q_set, shuffle=False), num_workers=4)
    g_loader = DataLoader(g_set, batch_size=128, sampler=DistributedSampler(g_set, shuffle=False), num_workers=4)

    net = ReIDNet(num_classes=len({r[1] for r in train_rows}))
    if args.init:
        state = torch.load(args.init, map_location="cpu")
        net.load_state_dict(state)
        if rank == 0:
            print(f"loaded {args.init}")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank])

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-7)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, pid, _, _) in enumerate(train_loader):
            x, pid = x.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(x)
            loss = hard_triplet(feat, pid, args.margin)
            if args.loss == "softmax_triplet":
                loss = loss + ce(logits, pid)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 40 == 0:
                print(f"[{epoch}/{args.epochs}] it {it} loss {loss.item():.4f} gem_p {net.pool.p.item():.2f}", flush=True)
        scheduler.step()

        if (epoch + 1) % 10 == 0:
            qf, qp, qc = gather_features(model, q_loader, device)
            gf, gp, gc = gather_features(model, g_loader, device)
            if rank == 0:
                mAP, rank1 = evaluate(qf, qp, qc, gf, gp, gc)
                print(f"epoch {epoch + 1}: mAP {mAP:.4f} rank-1 {rank1:.4f}", flush=True)
                torch.save(model.module.state_dict(), osp.join(args.out, "model_final.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
