"""Clip-level appearance embedding for MOT association (MOT20 / DanceTrack style data).

Each training sample is a short clip of T frames from one sequence; person crops of the same
track inside the clip are positives, other tracks in the clip are negatives.

torchrun --nproc_per_node=4 12_mot_clip_embedding.py --root /data/DanceTrack --out runs/clip_emb
"""
import argparse
import os
import os.path as osp
import random
from collections import defaultdict

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/DanceTrack")
    p.add_argument("--out", default="runs/clip_emb")
    p.add_argument("--clip-len", type=int, default=4)
    p.add_argument("--clip-stride", type=int, default=8)
    p.add_argument("--tracks-per-clip", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4, help="clips per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.1)
    return p.parse_args()


def read_gt(seq_dir):
    tracks = defaultdict(dict)
    for row in np.loadtxt(osp.join(seq_dir, "gt", "gt.txt"), delimiter=",", ndmin=2):
        frame, tid, x, y, w, h = row[:6]
        if w > 4 and h > 8:
            tracks[int(frame)][int(tid)] = (x, y, w, h)
    return tracks


class ClipDataset(Dataset):
    def __init__(self, root, split, seqs, clip_len, stride, tracks_per_clip, train=True):
        self.clip_len, self.m, self.train = clip_len, tracks_per_clip, train
        self.clips, self.gt = [], {}
        for seq in seqs:
            seq_dir = osp.join(root, split, seq)
            gt = read_gt(seq_dir)
            self.gt[seq_dir] = gt
            frames = sorted(gt)
            for s in range(0, len(frames) - clip_len * 2, stride):
                self.clips.append((seq_dir, frames[s:s + clip_len * 2]))

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        seq_dir, window = self.clips[i]
        frames = sorted(random.sample(window, self.clip_len)) if self.train else window[::2][:self.clip_len]
        gt = self.gt[seq_dir]
        candidates = sorted(gt[frames[0]])
        chosen = random.sample(candidates, min(self.m, len(candidates))) if self.train else candidates[:self.m]
        crops = torch.zeros(self.clip_len, self.m, 3, 192, 96)
        ids = torch.full((self.clip_len, self.m), -1, dtype=torch.long)
        for t, f in enumerate(frames):
            img = cv2.imread(osp.join(seq_dir, "img1", f"{f:08d}.jpg"))[:, :, ::-1]
            for j, tid in enumerate(chosen):
                if tid not in gt[f]:
                    continue
                x, y, w, h = gt[f][tid]
                x0, y0 = max(int(x), 0), max(int(y), 0)
                patch = img[y0:int(y + h), x0:int(x + w)]
                if patch.size == 0:
                    continue
                patch = cv2.resize(np.ascontiguousarray(patch), (96, 192)).astype(np.float32) / 255.0
                if self.train and random.random() < 0.5:
                    patch = patch[:, ::-1]
                patch = (patch - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
                crops[t, j] = torch.from_numpy(patch.transpose(2, 0, 1).astype(np.float32))
                ids[t, j] = tid
        return crops.flatten(0, 1), ids.flatten()


class CropEmbedder(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Sequential(nn.Linear(2048, 1024), nn.BatchNorm1d(1024), nn.ReLU(inplace=True), nn.Linear(1024, dim))

    def forward(self, x):
        return F.normalize(self.proj(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1)), dim=1)


def sup_con_loss(emb, ids, temperature):
    sim = emb @ emb.t() / temperature
    eye = torch.eye(len(ids), dtype=torch.bool, device=emb.device)
    pos = (ids[:, None] == ids[None]) & ~eye
    sim = sim.masked_fill(eye, -1e4)
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    has_pos = pos.any(1)
    return -((log_prob * pos).sum(1)[has_pos] / pos.sum(1)[has_pos]).mean()


def flatten_batch(crops, ids, clip_offset):
    # make track ids unique across the clips of a batch
    b = ids.size(0)
    ids = torch.where(ids >= 0, ids + clip_offset * torch.arange(b, device=ids.device)[:, None], ids)
    ids, crops = ids.flatten(), crops.flatten(0, 1)
    keep = ids >= 0
    return crops[keep], ids[keep]


@torch.no_grad()
def association_accuracy(model, loader, device):
    model.eval()
    correct = total = 0
    for crops, ids in loader:
        crops, ids = crops.to(device), ids.to(device)
        for c, i in zip(crops, ids):
            valid = i >= 0
            emb, tid = model(c[valid]), i[valid]
            sim = emb @ emb.t()
            sim.fill_diagonal_(-2)
            nn_idx = sim.argmax(1)
            has_pos = ((tid[:, None] == tid[None]).sum(1) > 1)
            correct += (tid[nn_idx] == tid)[has_pos].sum().item()
            total += has_pos.sum().item()
    return correct / max(total, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    train_seqs = sorted(os.listdir(osp.join(args.root, "train")))
    val_seqs = sorted(os.listdir(osp.join(args.root, "val")))[:5]
    # whole sequences stay on one GPU, so decoded frames of a sequence are only read by one process
    my_seqs = train_seqs[rank::world]
    train_set = ClipDataset(args.root, "train", my_seqs, args.clip_len, args.clip_stride, args.tracks_per_clip)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(CropEmbedder()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 4, weight_decay=0.05)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world / 4, total_steps=total_steps)

    val_loader = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        val_set = ClipDataset(args.root, "val", val_seqs, args.clip_len, 50, args.tracks_per_clip, train=False)
        val_loader = DataLoader(val_set, batch_size=2, num_workers=4)
    print(f"[rank {rank}] {len(my_seqs)} sequences, {len(train_set)} clips", flush=True)

    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for step, (crops, ids) in enumerate(train_loader):
            crops, ids = crops.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            crops, ids = flatten_batch(crops, ids, clip_offset=100000)
            loss = sup_con_loss(model(crops), ids, args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            acc = association_accuracy(model.module, val_loader, device)
            print(f"epoch {epoch + 1}: loss {(running[0] / running[1]).item():.4f}  val NN-assoc acc {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch + 1},
                       osp.join(args.out, "clip_emb_last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
