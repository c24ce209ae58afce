"""TSM-ResNet50 on Something-Something-v2, frames pre-extracted into LMDB
(key = b"{video_id}/{frame:05d}", value = jpeg bytes).

Frame counts per video are needed for segment sampling; scanning the LMDB keys
takes ~15 min on SSv2 so it is cached next to the database.
"""
import argparse
import io
import os
import pickle
import time
from collections import defaultdict

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--lmdb", default="/data/ssv2/frames.lmdb")
parser.add_argument("--ann", default="/data/ssv2/annotations")
parser.add_argument("--num-segments", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--epochs", type=int, default=50)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--out", default="work_dirs/tsm_ssv2")


def build_frame_index(lmdb_path):
    env = lmdb.open(lmdb_path, readonly=True, lock=False, readahead=False, meminit=False)
    counts = defaultdict(int)
    with env.begin() as txn:
        for key in txn.cursor().iternext(keys=True, values=False):
            vid = key.decode().split("/")[0]
            counts[vid] += 1
    env.close()
    return dict(counts)


def load_frame_index(lmdb_path, rank):
    cache = os.path.join(os.path.dirname(lmdb_path), "frame_index.pkl")
    if not os.path.exists(cache):
        if rank == 0:
            index = build_frame_index(lmdb_path)
            with open(cache, "wb") as f:
                pickle.dump(index, f)
            return index
        while not os.path.exists(cache):
            time.sleep(10)
    with open(cache, "rb") as f:
        return pickle.load(f)


class SSv2Lmdb(Dataset):
    def __init__(self, lmdb_path, ann_file, frame_index, num_segments, train):
        self.lmdb_path = lmdb_path
        self.env = None  # opened lazily in each worker
        self.num_segments = num_segments
        self.train = train
        self.samples = []
        with open(ann_file) as f:
            for line in f:
                vid, label = line.split()
                if frame_index.get(vid, 0) > 0:
                    self.samples.append((vid, frame_index[vid], int(label)))
        norm = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            self.tf = torchvision.transforms.Compose([
                torchvision.transforms.RandomResizedCrop(224, scale=(0.25, 1.0)),
                torchvision.transforms.ToTensor(), norm])
        else:
            self.tf = torchvision.transforms.Compose([
                torchvision.transforms.Resize(256), torchvision.transforms.CenterCrop(224),
                torchvision.transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.samples)

    def _segment_indices(self, n):
        seg = n / self.num_segments
        if self.train:
            return [int(seg * i + np.random.uniform(0, seg)) for i in range(self.num_segments)]
        return [int(seg * i + seg / 2) for i in range(self.num_segments)]

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.lmdb_path, readonly=True, lock=False, readahead=False, meminit=False)
        vid, n, label = self.samples[i]
        frames = []
        state = torch.get_rng_state()
        with self.env.begin() as txn:
            for fi in self._segment_indices(n):
                buf = txn.get(f"{vid}/{min(fi, n - 1):05d}".encode())
                img = Image.open(io.BytesIO(buf)).convert("RGB")
                torch.set_rng_state(state)  # same crop for every frame of the clip
                frames.append(self.tf(img))
        return torch.stack(frames), label  # T C H W


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, fold_div=8):
        super().__init__()
        self.net, self.n_segment, self.fold_div = net, n_segment, fold_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSM(nn.Module):
    def __init__(self, num_classes, num_segments):
        super().__init__()
        self.num_segments = num_segments
        base = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        for layer in [base.layer1, base.layer2, base.layer3, base.layer4]:
            for b in layer:
                b.conv1 = TemporalShift(b.conv1, num_segments)
        base.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, num_classes))
        self.base = base

    def forward(self, x):
        b, t = x.shape[:2]
        logits = self.base(x.flatten(0, 1))
        return logits.view(b, t, -1).mean(1)


def run_epoch(model, loader, opt, device, train):
    model.train(train)
    totals = torch.zeros(3, device=device)
    with torch.set_grad_enabled(train):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if train:
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 20)
                opt.step()
            totals += torch.stack([loss.detach() * y.numel(), (logits.argmax(1) == y).sum().float(),
                                   torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    frame_index = load_frame_index(args.lmdb, rank)
    train_ds = SSv2Lmdb(args.lmdb, os.path.join(args.ann, "train.txt"), frame_index, args.num_segments, True)
    val_ds = SSv2Lmdb(args.lmdb, os.path.join(args.ann, "val.txt"), frame_index, args.num_segments, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_shard = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = TSM(174, args.num_segments)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.batch_size / 64, momentum=0.9,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 40], gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val videos, world {world}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_acc = run_epoch(model, train_loader, opt, device, train=True)
        va_loss, va_acc = run_epoch(model.module, val_loader, opt, device, train=False)
        sched.step()
        if rank == 0:
            print(f"[{epoch}] train {tr_loss:.3f}/{tr_acc:.3f} val {va_loss:.3f}/{va_acc:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "latest.pth"))
            if va_acc > best:
                best = va_acc
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
