"""
Lightweight re-ID model for the edge trackers: MobileNetV3-Large + BNNeck, trained on
Market-1501, best checkpoint re-evaluated and exported to ONNX at the end.

    torchrun --nproc_per_node=4 17_market_mbv3_export.py --root /data/Market-1501-v15.09.15 --out exp/mbv3_market
"""
import argparse
import os
import os.path as osp
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import mobilenet_v3_large, MobileNet_V3_Large_Weights


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="exp/mbv3_market")
    p.add_argument("--batch", type=int, default=128, help="global P*K")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def market(folder, relabel=False):
    rx = re.compile(r"([-\d]+)_c(\d)")
    out = []
    for f in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, rx.search(osp.basename(f)).groups())
        if pid != -1:
            out.append((f, pid, cam - 1))
    if relabel:
        m = {pid: i for i, pid in enumerate(sorted({o[1] for o in out}))}
        out = [(f, m[pid], c) for f, pid, c in out]
    return out


class Reid(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, pid, cam = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), pid, cam


class PKSamplerDDP(Sampler):
    def __init__(self, items, batch, k, rank, world, seed=11):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.per_gpu = batch // world
        self.epoch = 0
        self.groups = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.groups[pid].append(i)
        self.pids = sorted(self.groups)
        self.num_batches = sum(max(len(g), k) // k for g in self.groups.values()) * k // batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_batches * self.per_gpu

    def __iter__(self):
        r = random.Random(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            g = self.groups[pid][:]
            while len(g) < self.k:
                g.append(r.choice(self.groups[pid]))
            r.shuffle(g)
            chunks[pid] = [g[i:i + self.k] for i in range(0, len(g) - self.k + 1, self.k)]
        live, seq = list(self.pids), []
        while len(live) >= self.batch // self.k and len(seq) < self.num_batches * self.batch:
            for pid in r.sample(live, self.batch // self.k):
                seq += chunks[pid].pop()
                if not chunks[pid]:
                    live.remove(pid)
        for b in range(len(seq) // self.batch):
            base = b * self.batch + self.rank * self.per_gpu
            yield from seq[base:base + self.per_gpu]


class MobileReID(nn.Module):
    def __init__(self, num_classes, emb):
        super().__init__()
        m = mobilenet_v3_large(weights=MobileNet_V3_Large_Weights.IMAGENET1K_V2)
        self.features = m.features
        self.reduce = nn.Sequential(nn.Conv2d(960, emb, 1, bias=False), nn.BatchNorm2d(emb), nn.Hardswish())
        self.neck = nn.BatchNorm1d(emb)
        self.neck.bias.requires_grad_(False)
        self.classifier = nn.Linear(emb, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.reduce(self.features(x)), 1).flatten(1)
        b = self.neck(f)
        return (self.classifier(b), f) if self.training else b


def tri_hard(f, y, margin=0.3):
    d = torch.cdist(f, f)
    same = y[:, None] == y[None]
    return F.relu(d.masked_fill(~same, 0).amax(1) - d.masked_fill(same, 1e6).amin(1) + margin).mean()


def cmc_map(sim, qp, gp, qc, gc):
    aps, cmc = [], np.zeros(10)
    nv = 0
    for i in range(sim.shape[0]):
        o = np.argsort(-sim[i])
        keep = (gp[o] != qp[i]) | (gc[o] != qc[i])
        m = gp[o][keep] == qp[i]
        if not m.any():
            continue
        nv += 1
        h = np.flatnonzero(m)
        aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
        if h[0] < 10:
            cmc[h[0]:] += 1
    return float(np.mean(aps)), cmc / nv


@torch.no_grad()
def evaluate(net, query, gallery, tf, device):
    net.eval()
    dl = DataLoader(Reid(query + gallery, tf), batch_size=512, num_workers=8, pin_memory=True)
    f = F.normalize(torch.cat([net(x.to(device, non_blocking=True)) for x, _, _ in dl]), dim=1)
    sim = (f[:len(query)] @ f[len(query):].t()).cpu().numpy()
    get = lambda L, j: np.array([t[j] for t in L])
    return cmc_map(sim, get(query, 1), get(gallery, 1), get(query, 2), get(gallery, 2))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    train = market(osp.join(args.root, "bounding_box_train"), relabel=True)
    query, gallery = market(osp.join(args.root, "query")), market(osp.join(args.root, "bounding_box_test"))
    num_classes = len({t[1] for t in train})
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ColorJitter(0.2, 0.2, 0.1), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = PKSamplerDDP(train, args.batch, args.k, rank, world)
    loader = DataLoader(Reid(train, tf), batch_size=args.batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = MobileReID(num_classes, args.emb)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader), pct_start=0.05)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    best_path = osp.join(args.out, "best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        s = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x)
            l1, l2 = ce(logits, y), tri_hard(feat, y)
            opt.zero_grad(set_to_none=True)
            (l1 + l2).backward()
            opt.step()
            sched.step()
            s += torch.stack([l1.detach(), l2.detach(), torch.ones_like(l1)])
        dist.all_reduce(s)
        if rank == 0:
            print(f"[{epoch + 1:3d}] id {s[0] / s[2]:.3f} tri {s[1] / s[2]:.3f} {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
                mAP, cmc = evaluate(model.module, query, gallery, test_tf, device)
                print(f"      mAP {100 * mAP:.1f} R1 {100 * cmc[0]:.1f} R5 {100 * cmc[4]:.1f}", flush=True)
                if mAP > best:
                    best = mAP
                    torch.save({"state_dict": model.state_dict(), "epoch": epoch + 1, "mAP": mAP}, best_path)
        dist.barrier()

    if rank == 0:
        # re-check the best checkpoint on a clean single-GPU model, then export for the trackers
        deploy = MobileReID(num_classes, args.emb)
        ckpt = torch.load(best_path, map_location="cpu")
        deploy.load_state_dict(ckpt["state_dict"])
        deploy = deploy.to(device).eval()
        mAP, cmc = evaluate(deploy, query, gallery, test_tf, device)
        print(f"best (epoch {ckpt['epoch']}): mAP {100 * mAP:.1f} R1 {100 * cmc[0]:.1f}", flush=True)
        torch.onnx.export(deploy, torch.randn(1, 3, 256, 128, device=device), osp.join(args.out, "reid_mbv3.onnx"),
                          input_names=["images"], output_names=["embeddings"],
                          dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}}, opset_version=17)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
