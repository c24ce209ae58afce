"""TalkNet-style audio-visual active speaker detection on AVA-ActiveSpeaker.

Face tracks (grayscale 112x112 crops, 25 fps) of varying length paired with the
MFCC of the same time span; per-frame speaking / not-speaking prediction.
Evaluation: frame-level mAP over the whole validation set.

    torchrun --nproc_per_node=4 16_ava_active_speaker.py --data /data/ava_asd --save /nfs/exp/talknet_ava
"""
import argparse
import os
import shutil
import time

import numpy as np
import python_speech_features
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.io import wavfile
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--max-frames", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-decay", type=float, default=0.95)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ASDTracks(Dataset):
    """tracks_<split>.csv: track_id, n_frames, label string like '0010111...'"""

    def __init__(self, root, split, max_frames, train):
        self.root, self.split, self.train, self.max_frames = root, split, train, max_frames
        self.tracks = []
        for line in open(os.path.join(root, f"tracks_{split}.csv")):
            tid, n, lab = line.strip().split(",")
            self.tracks.append((tid, int(n), lab))

    def __len__(self):
        return len(self.tracks)

    def __getitem__(self, i):
        tid, n, lab = self.tracks[i]
        faces = np.load(os.path.join(self.root, "faces", self.split, tid + ".npy"))  # n x 112 x 112 uint8
        sr, wav = wavfile.read(os.path.join(self.root, "audio", self.split, tid + ".wav"))
        mfcc = python_speech_features.mfcc(wav, sr, numcep=13, winlen=0.025, winstep=0.010)  # 100 fps
        labels = np.array([int(c) for c in lab], dtype=np.int64)
        start = 0
        if self.train and n > self.max_frames:
            start = np.random.randint(0, n - self.max_frames + 1)
        if self.train:
            n = min(n, self.max_frames)
        faces = faces[start:start + n]
        mfcc = mfcc[4 * start: 4 * (start + n)]
        if mfcc.shape[0] < 4 * n:
            mfcc = np.pad(mfcc, ((0, 4 * n - mfcc.shape[0]), (0, 0)), mode="wrap")
        labels = labels[start:start + n]
        if self.train and np.random.rand() < 0.5:
            faces = faces[:, :, ::-1]
        v = torch.from_numpy(np.ascontiguousarray(faces)).float() / 255.0
        return v, torch.from_numpy(mfcc).float(), torch.from_numpy(labels)


def pad_collate(batch):
    T = max(b[0].size(0) for b in batch)
    B = len(batch)
    v = torch.zeros(B, T, 112, 112)
    a = torch.zeros(B, 4 * T, 13)
    y = torch.full((B, T), -100, dtype=torch.long)
    for i, (vi, ai, yi) in enumerate(batch):
        n = vi.size(0)
        v[i, :n], a[i, : 4 * n], y[i, :n] = vi, ai, yi
    return v, a, y


class VisualFrontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.c3d = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64),
                                 nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        chans = [64, 64, 128, 256, 512]
        layers = []
        for ci, co in zip(chans[:-1], chans[1:]):
            s = 1 if ci == co else 2
            layers += [nn.Conv2d(ci, co, 3, s, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(True),
                       nn.Conv2d(co, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(True)]
        self.c2d = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.tcn = nn.Sequential(nn.Conv1d(512, 128, 5, padding=2), nn.BatchNorm1d(128), nn.ReLU(True))

    def forward(self, v):
        b, t = v.shape[:2]
        x = self.c3d(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        x = self.c2d(x).view(b, t, 512).transpose(1, 2)
        return self.tcn(x).transpose(1, 2)  # b, t, 128


class AudioFrontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(True), nn.MaxPool2d((2, 1)),
            nn.Conv2d(32, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(True), nn.MaxPool2d((2, 1)),
            nn.Conv2d(64, 128, 3, 1, 1), nn.BatchNorm2d(128), nn.ReLU(True))

    def forward(self, a):  # b, 4t, 13
        x = self.net(a.unsqueeze(1))  # b, 128, t, 13
        return x.mean(-1).transpose(1, 2)


class TalkNet(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.vis = VisualFrontend()
        self.aud = AudioFrontend()
        self.cross_av = nn.MultiheadAttention(d, 8, batch_first=True)
        self.cross_va = nn.MultiheadAttention(d, 8, batch_first=True)
        self.self_att = nn.TransformerEncoder(nn.TransformerEncoderLayer(2 * d, 8, 4 * d, 0.1, batch_first=True), 1)
        self.fc_av = nn.Linear(2 * d, 2)
        self.fc_a = nn.Linear(d, 2)
        self.fc_v = nn.Linear(d, 2)

    def forward(self, v, a):
        fv, fa = self.vis(v), self.aud(a)
        t = min(fv.size(1), fa.size(1))
        fv, fa = fv[:, :t], fa[:, :t]
        av = self.cross_av(fa, fv, fv, need_weights=False)[0]
        va = self.cross_va(fv, fa, fa, need_weights=False)[0]
        x = self.self_att(torch.cat([av, va], -1))
        return self.fc_av(x), self.fc_a(fa), self.fc_v(fv)


def save_checkpoint(state, is_best, out_dir):
    path = os.path.join(out_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth.tar"))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    scores, labels = [], []
    for v, a, y in loader:
        logits, _, _ = net(v.to(device), a.to(device))
        p = logits.float().softmax(-1)[..., 1].cpu()
        m = y != -100
        scores.append(p[m].numpy())
        labels.append(y[m].numpy())
    local = (np.concatenate(scores), np.concatenate(labels))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    s = np.concatenate([g[0] for g in gathered])
    l = np.concatenate([g[1] for g in gathered])
    net.train()
    return average_precision_score(l, s)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(rank)
    torch.manual_seed(0)

    train_set = ASDTracks(args.data, "train", args.max_frames, train=True)
    val_set = ASDTracks(args.data, "val", args.max_frames, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=pad_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=1,
                            num_workers=args.workers, collate_fn=pad_collate)

    model = TalkNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.lr_decay)

    os.makedirs(args.save, exist_ok=True)
    best_map = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, tot, n = time.time(), 0.0, 0
        for it, (v, a, y) in enumerate(train_loader):
            v, a, y = v.to(device, non_blocking=True), a.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_av, out_a, out_v = model(v, a)
            t = out_av.size(1)
            yy = y[:, :t].reshape(-1)
            loss = F.cross_entropy(out_av.float().reshape(-1, 2), yy) \
                + 0.4 * F.cross_entropy(out_a.float().reshape(-1, 2), yy) \
                + 0.4 * F.cross_entropy(out_v.float().reshape(-1, 2), yy)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tot += loss.item()
            n += 1
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {tot / n:.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)
        scheduler.step()

        mAP = evaluate(model.module, val_loader, device)
        is_best = mAP > best_map
        best_map = max(best_map, mAP)
        if rank == 0:
            print(f"epoch {epoch} val mAP {100 * mAP:.2f} (best {100 * best_map:.2f}) {time.time() - t0:.0f}s", flush=True)
        save_checkpoint({"epoch": epoch, "state_dict": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "best_map": best_map}, is_best, args.save)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
