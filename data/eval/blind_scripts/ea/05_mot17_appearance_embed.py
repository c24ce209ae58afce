"""
Appearance embedding for the tracker (DeepSORT-style re-ID head), trained on
person crops cut from MOT17 ground truth.

Crops are produced offline by tools/cut_mot_crops.py into
    <crop_root>/<sequence>/<track_id>/<frame>.jpg

Run:
    torchrun --nproc_per_node=4 05_mot17_appearance_embed.py --crop-root /mnt/shared/mot17_crops
"""
import argparse
import json
import os
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet34, ResNet34_Weights

TRAIN_SEQS = ["MOT17-02", "MOT17-04", "MOT17-05", "MOT17-10", "MOT17-13"]
VAL_SEQS = ["MOT17-09", "MOT17-11"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--crop-root", required=True)
    p.add_argument("--out-dir", default="work_dirs/mot17_embed")
    p.add_argument("--batch", type=int, default=128, help="global P*K")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--min-track-len", type=int, default=8)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--emb-dim", type=int, default=256)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def scan_tracks(crop_root, seqs, min_len):
    """Return {identity_key: [(path, frame), ...]} for tracks with enough crops."""
    tracks = {}
    for seq in seqs:
        for tdir in sorted(Path(crop_root, seq).iterdir()):
            frames = sorted(tdir.glob("*.jpg"))
            if len(frames) < min_len:
                continue
            tracks[f"{seq}_{tdir.name}"] = [(str(f), int(f.stem)) for f in frames]
    return tracks


class TrackCrops(Dataset):
    def __init__(self, tracks, transform):
        identities = list({key for key in tracks})
        self.label_of = {key: i for i, key in enumerate(identities)}
        self.samples = []
        for key, crops in tracks.items():
            for path, frame in crops:
                self.samples.append((path, self.label_of[key], frame))
        self.transform = transform

    @property
    def num_ids(self):
        return len(self.label_of)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label, frame = self.samples[i]
        return self.transform(Image.open(path).convert("RGB")), label, frame


class DistPKSampler(Sampler):
    def __init__(self, labels, global_batch, k, rank, world, seed=0):
        self.k, self.rank, self.world, self.seed = k, rank, world, seed
        self.global_batch, self.local = global_batch, global_batch // world
        self.P = global_batch // k
        self.epoch = 0
        self.by_label = defaultdict(list)
        for i, y in enumerate(labels):
            self.by_label[y].append(i)
        self.labels = sorted(self.by_label)
        self.n_batches = sum(len(v) // k for v in self.by_label.values()) // self.P

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.n_batches * self.local

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        bags = {}
        for y in self.labels:
            idx = self.by_label[y][:]
            rng.shuffle(idx)
            bags[y] = [idx[j:j + self.k] for j in range(0, len(idx) // self.k * self.k, self.k)]
        live = [y for y in self.labels if bags[y]]
        seq = []
        for _ in range(self.n_batches):
            if len(live) < self.P:
                break
            for y in rng.sample(live, self.P):
                seq += bags[y].pop()
                if not bags[y]:
                    live.remove(y)
        for b in range(len(seq) // self.global_batch):
            off = b * self.global_batch + self.rank * self.local
            yield from seq[off:off + self.local]


class EmbedNet(nn.Module):
    def __init__(self, num_ids, dim):
        super().__init__()
        r = resnet34(weights=ResNet34_Weights.DEFAULT)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        self.proj = nn.Linear(512, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.bn.bias.requires_grad_(False)
        self.cls = nn.Linear(dim, num_ids, bias=False)

    def forward(self, x):
        f = self.proj(F.adaptive_avg_pool2d(self.stem(x), 1).flatten(1))
        b = self.bn(f)
        if self.training:
            return self.cls(b), f
        return F.normalize(b, dim=1)


def batch_hard(emb, y, margin=0.3):
    d = torch.cdist(emb, emb)
    same = y[None] == y[:, None]
    ap = d.masked_fill(~same, -1).max(1).values
    an = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def track_retrieval(model, val_tracks, tf, device, gap=60):
    """Query: first crop of every val track; gallery: all crops at least `gap` frames away."""
    model.eval()
    keys = sorted(val_tracks)
    paths, ids, frames = [], [], []
    for n, key in enumerate(keys):
        for path, frame in val_tracks[key]:
            paths.append(path)
            ids.append(n)
            frames.append(frame)
    feats = []
    for s in range(0, len(paths), 256):
        x = torch.stack([tf(Image.open(p).convert("RGB")) for p in paths[s:s + 256]]).to(device)
        feats.append(model(x))
    feats = torch.cat(feats)
    ids, frames = torch.tensor(ids, device=device), torch.tensor(frames, device=device)
    first = torch.tensor([ids.tolist().index(n) for n in range(len(keys))], device=device)
    sim = feats[first] @ feats.t()
    aps, top1 = [], []
    for qi, q in enumerate(first.tolist()):
        valid = (frames - frames[q]).abs() >= gap
        valid |= ids != ids[q]
        valid[q] = False
        s, g = sim[qi][valid], (ids[valid] == ids[q]).float()
        if g.sum() == 0:
            continue
        order = s.argsort(descending=True)
        g = g[order]
        prec = g.cumsum(0) / torch.arange(1, len(g) + 1, device=device)
        aps.append(((prec * g).sum() / g.sum()).item())
        top1.append(g[0].item())
    return float(np.mean(aps)), float(np.mean(top1))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tf_train = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3, 0.2),
                          T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                          T.RandomErasing(p=0.3)])
    tf_test = T.Compose([T.Resize((256, 128)), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    train_tracks = scan_tracks(args.crop_root, TRAIN_SEQS, args.min_track_len)
    val_tracks = scan_tracks(args.crop_root, VAL_SEQS, args.min_track_len)
    train_set = TrackCrops(train_tracks, tf_train)
    sampler = DistPKSampler([s[1] for s in train_set.samples], args.batch, args.k, rank, world)
    loader = DataLoader(train_set, batch_size=args.batch // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(EmbedNet(train_set.num_ids, args.emb_dim)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                          momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.1)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{train_set.num_ids} train tracks, {len(train_set)} crops; {len(val_tracks)} val tracks")

    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, emb = model(x)
            loss = ce(logits, y) + batch_hard(emb, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            entry = {"epoch": epoch + 1, "loss": (tot[0] / tot[1]).item(), "sec": time.time() - t0}
            if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
                entry["mAP"], entry["top1"] = track_retrieval(net, val_tracks, tf_test, device)
                torch.save({"model": net.state_dict(), "epoch": epoch + 1, "emb_dim": args.emb_dim},
                           os.path.join(args.out_dir, f"embed_ep{epoch + 1}.pth"))
            history.append(entry)
            print(json.dumps(entry), flush=True)
            with open(os.path.join(args.out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
