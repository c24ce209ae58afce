"""
Cosine-softmax appearance descriptor (Deep SORT style wide residual net, 128x64 input)
trained on identities from MOT20 ground truth.

    torchrun --nproc_per_node=4 14_mot20_cosine_metric.py \
        --mot-root /data/MOT20/train --crop-dir /data/MOT20/reid_crops --out exp/mot20_cosine
"""
import argparse
import json
import os
import os.path as osp
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEQS = ["MOT20-01", "MOT20-02", "MOT20-03", "MOT20-05"]
HOLDOUT = "MOT20-02"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mot-root", required=True)
    p.add_argument("--crop-dir", required=True)
    p.add_argument("--out", default="exp/mot20_cosine")
    p.add_argument("--every", type=int, default=3, help="take every n-th frame")
    p.add_argument("--min-vis", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=512, help="total over all GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def prepare_crops(mot_root, crop_dir, every, min_vis):
    """Cut person crops from GT once; returns the list written to index.json."""
    index_file = osp.join(crop_dir, "index.json")
    if osp.exists(index_file):
        with open(index_file) as f:
            return json.load(f)
    entries = []
    for seq in SEQS:
        gt = np.loadtxt(osp.join(mot_root, seq, "gt", "gt.txt"), delimiter=",")
        keep = (gt[:, 6] == 1) & (gt[:, 7] == 1) & (gt[:, 8] >= min_vis) & (gt[:, 0] % every == 0)
        gt = gt[keep]
        out_dir = osp.join(crop_dir, seq)
        os.makedirs(out_dir, exist_ok=True)
        by_frame = defaultdict(list)
        for row in gt:
            by_frame[int(row[0])].append(row)
        for frame, rows in sorted(by_frame.items()):
            img = Image.open(osp.join(mot_root, seq, "img1", f"{frame:06d}.jpg")).convert("RGB")
            W, H = img.size
            for row in rows:
                tid = int(row[1])
                x0, y0 = max(0, int(row[2])), max(0, int(row[3]))
                x1, y1 = min(W, int(row[2] + row[4])), min(H, int(row[3] + row[5]))
                if y1 - y0 < 32 or x1 - x0 < 12:
                    continue
                path = osp.join(out_dir, f"{tid:05d}_{frame:06d}.jpg")
                img.crop((x0, y0, x1, y1)).save(path)
                entries.append({"path": path, "seq": seq, "tid": tid, "frame": frame})
    with open(index_file, "w") as f:
        json.dump(entries, f)
    return entries


class CropSet(Dataset):
    def __init__(self, entries, label_of, tf):
        self.entries = entries
        self.label_of = label_of
        self.tf = tf

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        e = self.entries[i]
        return self.tf(Image.open(e["path"]).convert("RGB")), self.label_of[(e["seq"], e["tid"])], e["frame"]


class ResidualBlock(nn.Module):
    def __init__(self, cin, cout, down):
        super().__init__()
        stride = 2 if down else 1
        self.bn0 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False) if down or cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.elu(self.bn0(x)))
        h = self.conv2(F.dropout(F.elu(self.bn1(h)), 0.4, self.training))
        return h + self.proj(x)


class WideResNetDescriptor(nn.Module):
    """Deep SORT descriptor network: 128-d unit-norm embedding, cosine softmax head."""

    def __init__(self, num_classes, dim=128):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ELU(),
                                  nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ELU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(ResidualBlock(32, 32, False), ResidualBlock(32, 32, False),
                                    ResidualBlock(32, 64, True), ResidualBlock(64, 64, False),
                                    ResidualBlock(64, 128, True), ResidualBlock(128, 128, False))
        self.fc = nn.Linear(128 * 16 * 8, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.weights = nn.Parameter(torch.randn(num_classes, dim) * 0.01)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def embed(self, x):
        h = self.blocks(self.stem(x)).flatten(1)
        return F.normalize(F.elu(self.bn(self.fc(F.dropout(h, 0.4, self.training)))), dim=1)

    def forward(self, x):
        e = self.embed(x)
        if not self.training:
            return e
        scale = F.softplus(self.log_scale)
        return scale * e @ F.normalize(self.weights, dim=1).t()


@torch.no_grad()
def holdout_retrieval(net, entries, tf, device, min_gap=100):
    net.eval()
    loader = DataLoader(CropSet(entries, defaultdict(int), tf), batch_size=512, num_workers=8)
    feats = torch.cat([net(x.to(device)) for x, _, _ in loader])
    tids = torch.tensor([e["tid"] for e in entries], device=device)
    frames = torch.tensor([e["frame"] for e in entries], device=device)
    first = {}
    for i, e in enumerate(entries):
        first.setdefault(e["tid"], i)
    aps, top1 = [], []
    for q in first.values():
        ok = (tids != tids[q]) | ((frames - frames[q]).abs() >= min_gap)
        s = feats[ok] @ feats[q]
        rel = (tids[ok] == tids[q]).float()[s.argsort(descending=True)]
        if rel.sum() == 0:
            continue
        prec = rel.cumsum(0) / torch.arange(1, len(rel) + 1, device=device)
        aps.append(((prec * rel).sum() / rel.sum()).item())
        top1.append(rel[0].item())
    return float(np.mean(aps)), float(np.mean(top1))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    entries = prepare_crops(args.mot_root, args.crop_dir, args.every, args.min_vis)
    train_entries = [e for e in entries if e["seq"] != HOLDOUT]
    val_entries = [e for e in entries if e["seq"] == HOLDOUT]
    keys = sorted({(e["seq"], e["tid"]) for e in train_entries})
    label_of = {k: i for i, k in enumerate(keys)}

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((128, 64)), T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2),
                    T.RandomAffine(0, translate=(0.05, 0.05)), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize((128, 64)), T.ToTensor(), norm])
    train_set = CropSet(train_entries, label_of, tf)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(WideResNetDescriptor(len(keys))).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(keys)} train identities, {len(train_entries)} crops; holdout {len(val_entries)} crops")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), (logits.argmax(1) == y).float().mean(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % 5 == 0:
                mAP, top1 = holdout_retrieval(net, val_entries, test_tf, device)
                print(f"  {HOLDOUT} mAP {mAP:.3f} top1 {top1:.3f}", flush=True)
                torch.save({"model": net.state_dict(), "num_classes": len(keys)},
                           osp.join(args.out, f"descriptor_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
