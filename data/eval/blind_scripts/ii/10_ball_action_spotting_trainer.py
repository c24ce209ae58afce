"""Ball action spotting (PASS / DRIVE / HEADER / HIGH PASS / OUT / CROSS / THROW IN /
SHOT / BALL PLAYER BLOCK / PLAYER SUCCESSFUL TACKLE / FREE KICK / GOAL) at 25 fps.

Frame embeddings come from a frozen VideoMAE-B encoder (tools/dump_videomae.py,
one .npy per half, 25 fps). A temporal U-Net over 4 s windows outputs a per-frame
class heatmap; spotting = peak picking. Metric: mAP@1s over all val games.

    torchrun --nproc_per_node=4 10_ball_action_spotting_trainer.py --feat-root /data/sn-bas/videomae
"""
import argparse
import glob
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["PASS", "DRIVE", "HEADER", "HIGH PASS", "OUT", "CROSS", "THROW IN", "SHOT",
           "BALL PLAYER BLOCK", "PLAYER SUCCESSFUL TACKLE", "FREE KICK", "GOAL"]
FPS = 25


@dataclass
class Half:
    game_id: int
    feats: np.ndarray            # (T, D) memory-mapped
    labels: np.ndarray           # (T, C) gaussian-smoothed targets
    events: list                 # [(frame, class)]


def load_halves(feat_root, games):
    halves = []
    for gid, g in enumerate(games):
        ann = json.load(open(os.path.join(feat_root, g, "Labels-ball.json")))["annotations"]
        for npy in sorted(glob.glob(os.path.join(feat_root, g, "*_videomae.npy"))):
            half = int(os.path.basename(npy)[0])
            feats = np.load(npy, mmap_mode="r")
            T = feats.shape[0]
            labels = np.zeros((T, len(CLASSES)), np.float32)
            events = []
            for a in ann:
                if int(a["gameTime"][0]) != half or a["label"] not in CLASSES:
                    continue
                f = min(T - 1, int(a["position"]) * FPS // 1000)
                c = CLASSES.index(a["label"])
                events.append((f, c))
                lo, hi = max(0, f - 6), min(T, f + 7)
                labels[lo:hi, c] = np.maximum(labels[lo:hi, c], np.exp(-0.5 * ((np.arange(lo, hi) - f) / 2.0) ** 2))
            halves.append(Half(gid, feats, labels, events))
    return halves


class Windows(Dataset):
    def __init__(self, halves, win, samples_per_half=400):
        self.halves, self.win, self.n = halves, win, samples_per_half

    def __len__(self):
        return len(self.halves) * self.n

    def __getitem__(self, i):
        h = self.halves[i // self.n]
        # half of the windows are centred near an event, half are uniform
        if h.events and np.random.rand() < 0.5:
            f, _ = h.events[np.random.randint(len(h.events))]
            s = f - np.random.randint(0, self.win)
        else:
            s = np.random.randint(0, h.feats.shape[0] - self.win)
        s = int(np.clip(s, 0, h.feats.shape[0] - self.win))
        return torch.from_numpy(np.array(h.feats[s:s + self.win], np.float32)), torch.from_numpy(h.labels[s:s + self.win])


class TemporalUNet(nn.Module):
    def __init__(self, d_in, d=256, n_cls=len(CLASSES)):
        super().__init__()
        self.inp = nn.Sequential(nn.Conv1d(d_in, d, 1), nn.GroupNorm(16, d), nn.GELU())
        self.down = nn.ModuleList([self._blk(d, d) for _ in range(3)])
        self.up = nn.ModuleList([self._blk(2 * d, d) for _ in range(3)])
        self.out = nn.Conv1d(d, n_cls, 1)

    @staticmethod
    def _blk(ci, co):
        return nn.Sequential(nn.Conv1d(ci, co, 5, padding=2), nn.GroupNorm(16, co), nn.GELU(),
                             nn.Conv1d(co, co, 5, padding=2), nn.GroupNorm(16, co), nn.GELU())

    def forward(self, x):                  # (B, T, D) -> (B, T, C)
        h = self.inp(x.transpose(1, 2))
        skips = []
        for blk in self.down:
            h = blk(h)
            skips.append(h)
            h = F.max_pool1d(h, 2)
        for blk in self.up:
            skip = skips.pop()
            h = F.interpolate(h, size=skip.shape[-1], mode="linear", align_corners=False)
            h = blk(torch.cat([h, skip], 1))
        return self.out(h).transpose(1, 2)


def peak_pick(scores, thr=0.1, radius=12):
    """scores (T, C) -> tensor (K, 3): frame, class, score"""
    pooled = F.max_pool1d(scores.T[None], 2 * radius + 1, stride=1, padding=radius)[0].T
    keep = (scores == pooled) & (scores > thr)
    f, c = keep.nonzero(as_tuple=True)
    return torch.stack([f.float(), c.float(), scores[f, c]], 1) if len(f) else torch.zeros(0, 3, device=scores.device)


def ap_at_tolerance(dets, gts, tol):
    """dets (K, 4): half_id, frame, class, score; gts list of (half_id, frame, class)."""
    aps = []
    for c in range(len(CLASSES)):
        g = [(h, f) for h, f, cc in gts if cc == c]
        if not g:
            continue
        d = dets[dets[:, 2] == c]
        d = d[d[:, 3].argsort(descending=True)]
        matched = set()
        tp = np.zeros(len(d))
        for k, (h, f, _, _) in enumerate(d.tolist()):
            cands = [(abs(f - gf), j) for j, (gh, gf) in enumerate(g) if gh == h and j not in matched and abs(f - gf) <= tol]
            if cands:
                matched.add(min(cands)[1])
                tp[k] = 1
        ctp = np.cumsum(tp)
        prec = ctp / np.arange(1, len(tp) + 1)
        aps.append(float((prec * tp).sum() / len(g)))
    return float(np.mean(aps))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        split = json.load(open(os.path.join(args.feat_root, "splits.json")))
        self.train_halves = load_halves(args.feat_root, split["train"])
        all_val = load_halves(args.feat_root, split["valid"])
        for i, h in enumerate(all_val):
            h.game_id = i                               # unique id per half for matching
        self.val_halves = all_val[self.rank::self.world]
        self.val_gts = [(h.game_id, f, c) for h in all_val for f, c in h.events]

        ds = Windows(self.train_halves, args.window * FPS)
        self.sampler = DistributedSampler(ds, shuffle=True)
        self.loader = DataLoader(ds, batch_size=args.batch_size, sampler=self.sampler, num_workers=8,
                                 pin_memory=True, drop_last=True, persistent_workers=True)
        net = TemporalUNet(self.train_halves[0].feats.shape[1]).to(self.device)
        self.model = DDP(net, device_ids=[self.local_rank])
        lr = args.lr * args.batch_size * self.world / 128
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.02)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, args.epochs * len(self.loader))
        os.makedirs(args.out, exist_ok=True)

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        acc = torch.zeros(2, device=self.device)
        for x, y in self.loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            acc += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        win = self.args.window * FPS * 4
        local = []
        for h in self.val_halves:
            T = h.feats.shape[0]
            scores = torch.zeros(T, len(CLASSES), device=self.device)
            for s in range(0, T, win):
                x = torch.from_numpy(np.array(h.feats[s:s + win], np.float32)).to(self.device)
                scores[s:s + x.shape[0]] = net(x[None])[0].sigmoid()
            d = peak_pick(scores)
            local.append(torch.cat([torch.full((len(d), 1), float(h.game_id), device=self.device), d], 1))
        local = torch.cat(local) if local else torch.zeros(0, 4, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        net.train()
        dets = torch.cat(gathered).cpu()
        return ap_at_tolerance(dets, self.val_gts, tol=FPS)

    def run(self):
        best = 0.0
        for epoch in range(self.args.epochs):
            loss = self.train_epoch(epoch)
            m = self.validate()
            if self.rank == 0:
                print(f"epoch {epoch}: loss {loss:.4f}  mAP@1s {100 * m:.2f}", flush=True)
                torch.save(self.model.module.state_dict(), os.path.join(self.args.out, "last.pt"))
                if m > best:
                    best = m
                    torch.save(self.model.module.state_dict(), os.path.join(self.args.out, "best.pt"))
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat-root", required=True)
    ap.add_argument("--window", type=int, default=4, help="seconds")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 128")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", default="ckpt/bas_unet")
    Trainer(ap.parse_args()).run()
