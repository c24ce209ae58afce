"""
Fine-tune the re-ID model on tracklets harvested from our own site cameras.

Data layout (written by the tracklet harvester):
    <data>/<identity_id>/<cam>_<frame>.jpg

The last --val-ratio of identities (sorted by id) are held out; for each of them one
image per camera is a query and the rest is gallery.

    torchrun --nproc_per_node=4 20_site_finetune_resume.py --data /data/site_reid/2024q2 \
        --init /models/reid/market_r50_bnneck.pth --out runs/site_2024q2
    # continue an interrupted run
    torchrun --nproc_per_node=4 20_site_finetune_resume.py --data /data/site_reid/2024q2 \
        --out runs/site_2024q2 --resume runs/site_2024q2/checkpoint.pth
"""
import argparse
import os
import os.path as osp
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="", help="BNNeck checkpoint to start from (backbone + neck)")
    p.add_argument("--resume", default="")
    p.add_argument("--val-ratio", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=64, help="global P*K")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def scan_site(root, val_ratio):
    ids = sorted(d for d in os.listdir(root) if osp.isdir(osp.join(root, d)))
    n_val = int(len(ids) * val_ratio)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    train = []
    for label, ident in enumerate(train_ids):
        for f in sorted(os.listdir(osp.join(root, ident))):
            cam = int(f.split("_")[0])
            train.append((osp.join(root, ident, f), label, cam))
    query, gallery = [], []
    for ident in val_ids:
        seen_cams = set()
        for f in sorted(os.listdir(osp.join(root, ident))):
            cam = int(f.split("_")[0])
            rec = (osp.join(root, ident, f), int(ident), cam)
            if cam not in seen_cams:
                seen_cams.add(cam)
                query.append(rec)
            else:
                gallery.append(rec)
    return train, query, gallery, len(train_ids)


class SiteSet(Dataset):
    def __init__(self, recs, tf):
        self.recs, self.tf = recs, tf

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        p, pid, cam = self.recs[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedPK(Sampler):
    def __init__(self, recs, batch, k, rank, world, seed=0):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.local = batch // world
        self.epoch = 0
        self.groups = defaultdict(list)
        for i, (_, pid, _) in enumerate(recs):
            self.groups[pid].append(i)
        self.pids = sorted(self.groups)
        self.n = sum(max(len(v), k) // k for v in self.groups.values()) * k // batch

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.n * self.local

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            v = self.groups[pid][:]
            while len(v) < self.k:
                v.append(rng.choice(self.groups[pid]))
            rng.shuffle(v)
            chunks[pid] = [v[i:i + self.k] for i in range(0, len(v) - self.k + 1, self.k)]
        live, seq = list(self.pids), []
        while len(live) >= self.batch // self.k and len(seq) < self.n * self.batch:
            for pid in rng.sample(live, self.batch // self.k):
                seq.extend(chunks[pid].pop())
                if not chunks[pid]:
                    live.remove(pid)
        for b in range(len(seq) // self.batch):
            s = b * self.batch + self.rank * self.local
            yield from seq[s:s + self.local]


class BNNeckR50(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet50()
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        b = self.bottleneck(f)
        return (self.classifier(b), f) if self.training else b


def triplet(f, y, margin=0.3):
    d = torch.cdist(f, f)
    pos = y[:, None] == y[None]
    return F.relu(d.masked_fill(~pos, 0).amax(1) - d.masked_fill(pos, 1e6).amin(1) + margin).mean()


@torch.no_grad()
def site_eval(net, query, gallery, tf, device):
    net.eval()
    dl = DataLoader(SiteSet(query + gallery, tf), batch_size=256, num_workers=8, pin_memory=True)
    f = F.normalize(torch.cat([net(x.to(device, non_blocking=True)) for x, _, _ in dl]), dim=1)
    sim = (f[:len(query)] @ f[len(query):].t()).cpu().numpy()
    qp, qc = np.array([q[1] for q in query]), np.array([q[2] for q in query])
    gp, gc = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    aps, r1 = [], []
    for i in range(len(query)):
        o = np.argsort(-sim[i])
        m = gp[o][(gp[o] != qp[i]) | (gc[o] != qc[i])] == qp[i]
        if m.any():
            h = np.flatnonzero(m)
            aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
            r1.append(h[0] == 0)
    return float(np.mean(aps)), float(np.mean(r1))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train, query, gallery, n_ids = scan_site(args.data, args.val_ratio)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ColorJitter(0.3, 0.3, 0.2, 0.05), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = DistributedPK(train, args.batch, args.k, rank, world)
    loader = DataLoader(SiteSet(train, tf), batch_size=args.batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = BNNeckR50(n_ids)
    if args.init and not args.resume:
        sd = torch.load(args.init, map_location="cpu")
        sd = {k: v for k, v in sd.items() if not k.startswith("classifier.")}
        missing, _ = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print("initialised from", args.init, "- new:", missing)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    opt = torch.optim.Adam([
        {"params": [p for n, p in net.named_parameters() if n.startswith("base.")], "lr": args.lr},
        {"params": [p for n, p in net.named_parameters() if not n.startswith("base.") and p.requires_grad],
         "lr": args.lr * 10},
    ], weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-7)

    start_epoch, best = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume)
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        start_epoch, best = checkpoint["epoch"], checkpoint["best_mAP"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")
    model = DDP(net, device_ids=[local_rank])
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x)
            l_id, l_tri = ce(logits, y), triplet(feat, y)
            opt.zero_grad(set_to_none=True)
            (l_id + l_tri).backward()
            opt.step()
            acc += torch.stack([l_id.detach(), l_tri.detach(), torch.ones_like(l_id)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            msg = f"epoch {epoch + 1}: id {acc[0] / acc[2]:.3f} tri {acc[1] / acc[2]:.3f} {time.time() - t0:.0f}s"
            mAP = None
            if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
                mAP, r1 = site_eval(net, query, gallery, test_tf, device)
                msg += f" | site mAP {100 * mAP:.1f} R1 {100 * r1:.1f}"
                if mAP > best:
                    best = mAP
                    torch.save(net.state_dict(), osp.join(args.out, "best_model.pth"))
            print(msg, flush=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "epoch": epoch + 1, "best_mAP": best}, osp.join(args.out, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
