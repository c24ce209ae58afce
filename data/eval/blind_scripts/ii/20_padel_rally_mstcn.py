"""Temporal segmentation of padel broadcast video with a multi-stage TCN (MS-TCN++ style).

Per frame (I3D features, 10 fps) we predict
  * the rally phase: serve / in-play / dead-ball / replay / break
  * the team that hit the ball last (near side / far side / none)  -- team-level head
Whole videos (~90 min) are split into 3-minute chunks for training; evaluation
runs on full videos and reports frame accuracy, segmental edit score and F1@{10,25,50}.

    torchrun --nproc_per_node=4 20_padel_rally_mstcn.py --features /data/padel/i3d --gt /data/padel/gt
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PHASES = ["serve", "in_play", "dead_ball", "replay", "break"]
SIDES = ["none", "near", "far"]
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--features", type=Path, required=True)
    p.add_argument("--gt", type=Path, required=True)
    p.add_argument("--split", type=Path, default=Path("splits/padel_split1.json"))
    p.add_argument("--chunk", type=int, default=1800, help="frames per training chunk (10 fps)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--fmaps", type=int, default=64)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4, help="Adam lr at global batch 32")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--smooth-w", type=float, default=0.15)
    p.add_argument("--out", type=Path, default=Path("models/padel_mstcn"))
    return p.parse_args()


def load_video(feat_dir, gt_dir, vid):
    x = np.load(feat_dir / f"{vid}.npy").astype(np.float32)          # (D, T)
    gt = np.loadtxt(gt_dir / f"{vid}.txt", dtype=str, delimiter=",")   # rows: phase,side
    T = min(x.shape[1], len(gt))
    phase = np.array([PHASES.index(p) for p in gt[:T, 0]], np.int64)
    side = np.array([SIDES.index(s) for s in gt[:T, 1]], np.int64)
    return x[:, :T], phase, side


class Chunks(Dataset):
    def __init__(self, videos, chunk):
        self.videos, self.chunk = videos, chunk
        self.index = [(v, s) for v, (x, _, _) in enumerate(videos) for s in range(0, x.shape[1], chunk // 2)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        v, s = self.index[i]
        x, phase, side = self.videos[v]
        x, phase, side = x[:, s:s + self.chunk], phase[s:s + self.chunk], side[s:s + self.chunk]
        pad = self.chunk - x.shape[1]
        mask = np.ones(self.chunk, np.float32)
        if pad > 0:
            x = np.pad(x, ((0, 0), (0, pad)))
            phase = np.pad(phase, (0, pad), constant_values=-100)
            side = np.pad(side, (0, pad), constant_values=-100)
            mask[-pad:] = 0
        return torch.from_numpy(x), torch.from_numpy(phase), torch.from_numpy(side), torch.from_numpy(mask)


class DilatedResidual(nn.Module):
    def __init__(self, d, ch):
        super().__init__()
        self.conv = nn.Conv1d(ch, ch, 3, padding=d, dilation=d)
        self.out = nn.Conv1d(ch, ch, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, m):
        return (x + self.drop(self.out(F.relu(self.conv(x))))) * m


class Stage(nn.Module):
    def __init__(self, layers, ch, in_dim, n_out):
        super().__init__()
        self.inp = nn.Conv1d(in_dim, ch, 1)
        self.layers = nn.ModuleList([DilatedResidual(2 ** i, ch) for i in range(layers)])
        self.out = nn.Conv1d(ch, n_out, 1)

    def forward(self, x, m):
        h = self.inp(x)
        for l in self.layers:
            h = l(h, m)
        return self.out(h) * m


class MSTCN(nn.Module):
    def __init__(self, stages, layers, ch, in_dim):
        super().__init__()
        n = len(PHASES) + len(SIDES)
        self.first = Stage(layers, ch, in_dim, n)
        self.refine = nn.ModuleList([Stage(layers, ch, n, n) for _ in range(stages - 1)])

    def forward(self, x, m):
        m = m[:, None]
        out = self.first(x, m)
        outs = [out]
        for st in self.refine:
            p = torch.cat([F.softmax(out[:, :len(PHASES)], 1), F.softmax(out[:, len(PHASES):], 1)], 1)
            out = st(p * m, m)
            outs.append(out)
        return outs   # list of (B, P+S, T)


def class_weights(videos, idx, n):
    counts = np.bincount(np.concatenate([v[idx] for v in videos]), minlength=n).astype(np.float32)
    w = counts.sum() / (n * np.maximum(counts, 1))
    return torch.tensor(w, device=DEVICE)


def stage_loss(out, phase, side, mask, w_phase, w_side, smooth_w):
    lp, ls = out[:, :len(PHASES)], out[:, len(PHASES):]
    loss = F.cross_entropy(lp, phase, weight=w_phase, ignore_index=-100)
    loss = loss + F.cross_entropy(ls, side, weight=w_side, ignore_index=-100)
    # truncated MSE on neighbouring log-probs (temporal smoothing)
    for logits in (lp, ls):
        lsm = F.log_softmax(logits, 1)
        tmse = torch.clamp((lsm[:, :, 1:] - lsm.detach()[:, :, :-1]) ** 2, max=16)
        loss = loss + smooth_w * (tmse * mask[:, None, 1:]).mean()
    return loss


def segments(labels):
    change = np.flatnonzero(np.diff(labels)) + 1
    starts, ends = np.r_[0, change], np.r_[change, len(labels)]
    return [(labels[s], s, e) for s, e in zip(starts, ends)]


def f1_counts(pred, gt, thr):
    ps, gs = segments(pred), segments(gt)
    used = np.zeros(len(gs), bool)
    tp = 0
    for c, s, e in ps:
        ious = [(min(e, ge) - max(s, gs_)) / (max(e, ge) - min(s, gs_)) if gc == c and not used[j] else 0.0
                for j, (gc, gs_, ge) in enumerate(gs)]
        j = int(np.argmax(ious)) if ious else -1
        if j >= 0 and ious[j] >= thr:
            tp += 1
            used[j] = True
    return tp, len(ps) - tp, len(gs) - tp


@torch.no_grad()
def evaluate(model, videos, device):
    model.eval()
    acc = torch.zeros(2 + 3 * 3, device=device)   # correct, total, (tp, fp, fn) x 3 thresholds
    for x, phase, _ in videos:
        xt = torch.from_numpy(x)[None].to(device)
        out = model(xt, torch.ones(1, x.shape[1], device=device))[-1]
        pred = out[0, :len(PHASES)].argmax(0).cpu().numpy()
        acc[0] += float((pred == phase).sum())
        acc[1] += len(phase)
        for k, thr in enumerate((0.1, 0.25, 0.5)):
            acc[2 + 3 * k: 5 + 3 * k] += torch.tensor(f1_counts(pred, phase, thr), device=device, dtype=torch.float)
    dist.all_reduce(acc)
    model.train()
    res = {"acc": (acc[0] / acc[1]).item()}
    for k, thr in enumerate((10, 25, 50)):
        tp, fp, fn = acc[2 + 3 * k: 5 + 3 * k].tolist()
        res[f"F1@{thr}"] = 2 * tp / max(2 * tp + fp + fn, 1)
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    split = json.loads(args.split.read_text())
    train_videos = [load_video(args.features, args.gt, v) for v in split["train"]]
    test_videos = [load_video(args.features, args.gt, v) for v in sorted(split["test"])[rank::world]]
    ds = Chunks(train_videos, args.chunk)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True, pin_memory=True)

    w_phase = class_weights(train_videos, 1, len(PHASES))
    w_side = class_weights(train_videos, 2, len(SIDES))

    in_dim = train_videos[0][0].shape[0]
    model = DDP(MSTCN(args.stages, args.layers, args.fmaps, in_dim).to(device), device_ids=[local_rank])
    lr = args.lr * args.bs * world / 32
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"{len(ds)} training chunks, lr {lr:.2e}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tot = torch.zeros(2, device=device)
        for x, phase, side, mask in dl:
            x, phase, side, mask = x.to(device), phase.to(device), side.to(device), mask.to(device)
            outs = model(x, mask)
            loss = sum(stage_loss(o, phase, side, mask, w_phase, w_side, args.smooth_w) for o in outs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            res = evaluate(model.module, test_videos, device)
            sched.step(res["F1@25"])
            if rank == 0:
                print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f} " +
                      " ".join(f"{k} {v:.4f}" for k, v in res.items()), flush=True)
                if res["F1@25"] > best:
                    best = res["F1@25"]
                    torch.save(model.module.state_dict(), args.out / "best.model")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
