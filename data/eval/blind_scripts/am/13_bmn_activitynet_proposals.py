"""Boundary-matching proposal network (BMN-style) on ActivityNet-1.3 TSN features.

Every video's feature sequence is rescaled to 100 snippets; the model predicts start / end
probabilities and a (duration x start) confidence map. At test time each rank generates a
variable number of proposals per video; they are collected with all_gather_object and
AR@AN / AUC is computed on rank 0. Rank 0 also decides early stopping and broadcasts it.

    torchrun --nproc_per_node=4 13_bmn_activitynet_proposals.py --feature-dir anet/tsn_100 \
        --anno anet/activity_net_1_3.json --out runs/bmn_anet
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

T = 100  # temporal scale


class AnetFeatures(Dataset):
    def __init__(self, feature_dir, anno_file, subset):
        with open(anno_file) as f:
            db = json.load(f)["database"]
        self.feature_dir = feature_dir
        self.videos = sorted(v for v, d in db.items() if d["subset"] == subset
                             and os.path.exists(os.path.join(feature_dir, v + ".npy")))
        self.gt = {}
        for v in self.videos:
            dur = db[v]["duration"]
            self.gt[v] = np.array([[a["segment"][0] / dur, a["segment"][1] / dur]
                                   for a in db[v]["annotations"]], dtype=np.float32).reshape(-1, 2).clip(0, 1)
        self.duration = {v: db[v]["duration"] for v in self.videos}

    def __len__(self):
        return len(self.videos)

    def _targets(self, gt):
        anchors = (np.arange(T) + 0.5) / T
        w = 3.0 / T
        def match(points):
            lo, hi = points - w / 2, points + w / 2
            ov = (np.minimum(hi[None], anchors[:, None] + 0.5 / T) - np.maximum(lo[None], anchors[:, None] - 0.5 / T))
            return (ov.clip(0) / (1.0 / T)).max(1) if len(points) else np.zeros(T)
        start, end = match(gt[:, 0]), match(gt[:, 1])
        conf = np.zeros((T, T), np.float32)
        for d in range(T):
            s = np.arange(T) / T
            e = s + (d + 1) / T
            inter = np.minimum(e[:, None], gt[None, :, 1]) - np.maximum(s[:, None], gt[None, :, 0])
            union = (e - s)[:, None] + (gt[:, 1] - gt[:, 0])[None] - inter.clip(0)
            conf[d] = (inter.clip(0) / union).max(1) if len(gt) else 0.0
        return torch.from_numpy(start).float(), torch.from_numpy(end).float(), torch.from_numpy(conf)

    def __getitem__(self, i):
        v = self.videos[i]
        feats = torch.from_numpy(np.load(os.path.join(self.feature_dir, v + ".npy"))).float().t()  # C x T
        return (i, feats) + self._targets(self.gt[v])


class BMNLite(nn.Module):
    def __init__(self, in_dim=400, hid=256, num_sample=16):
        super().__init__()
        self.base = nn.Sequential(nn.Conv1d(in_dim, hid, 3, padding=1, groups=4), nn.ReLU(),
                                  nn.Conv1d(hid, hid, 3, padding=1, groups=4), nn.ReLU())
        self.start = nn.Sequential(nn.Conv1d(hid, hid, 3, padding=1, groups=4), nn.ReLU(), nn.Conv1d(hid, 1, 1))
        self.end = nn.Sequential(nn.Conv1d(hid, hid, 3, padding=1, groups=4), nn.ReLU(), nn.Conv1d(hid, 1, 1))
        self.proposal = nn.Conv1d(hid, hid, 3, padding=1)
        self.map_net = nn.Sequential(nn.Conv2d(hid, 128, 1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1),
                                     nn.ReLU(), nn.Conv2d(128, 2, 1))
        # (duration, start) -> average of features between start and start + duration
        mask = torch.zeros(T, T, T)
        for d in range(T):
            for s in range(T):
                e = min(s + d + 1, T)
                mask[d, s, s:e] = 1.0 / (e - s)
        self.register_buffer("pool", mask.view(T * T, T), persistent=False)

    def forward(self, x):
        h = self.base(x)
        start = torch.sigmoid(self.start(h)).squeeze(1)
        end = torch.sigmoid(self.end(h)).squeeze(1)
        p = self.proposal(h)                                      # B C T
        bm = (p @ self.pool.t()).view(p.shape[0], p.shape[1], T, T)
        conf = torch.sigmoid(self.map_net(bm))                    # B 2 D S
        return conf, start, end


def bi_loss(pred, gt, thr=0.5):
    pos = (gt > thr).float()
    n_pos = pos.sum().clamp(min=1)
    ratio = pos.numel() / n_pos
    coef_p, coef_n = 0.5 * ratio, 0.5 * ratio / (ratio - 1).clamp(min=1e-6)
    return -(coef_p * pos * torch.log(pred + 1e-6) + coef_n * (1 - pos) * torch.log(1 - pred + 1e-6)).mean()


def bmn_loss(conf, start, end, gt_conf, gt_start, gt_end):
    d = torch.arange(T, device=conf.device)
    valid = ((d[:, None] + d[None, :] + 1) <= T).float()          # [duration, start]: start + dur <= T
    l_reg = F.mse_loss(conf[:, 0] * valid, gt_conf * valid)
    l_cls = bi_loss(conf[:, 1][valid.bool().expand_as(gt_conf)], gt_conf[valid.bool().expand_as(gt_conf)], 0.9)
    return bi_loss(start, gt_start) + bi_loss(end, gt_end) + 10 * l_reg + l_cls


@torch.no_grad()
def generate_proposals(model, loader, dataset, device, top_n=100):
    model.eval()
    out = {}
    for idx, feats, *_ in loader:
        conf, start, end = model(feats.to(device))
        for b in range(feats.shape[0]):
            c = (conf[b, 0] * conf[b, 1]).cpu().numpy()
            s, e = start[b].cpu().numpy(), end[b].cpu().numpy()
            props = []
            for d in range(T):
                for st in range(T - d - 1):
                    en = st + d + 1
                    if s[st] > 0.5 * s.max() or e[min(en, T - 1)] > 0.5 * e.max():
                        props.append((st / T, en / T, float(s[st] * e[min(en, T - 1)] * c[d, st])))
            props.sort(key=lambda p: -p[2])
            out[dataset.videos[int(idx[b])]] = props[:top_n]          # length differs per video
    return out


def average_recall(proposals, dataset, tious=np.linspace(0.5, 0.95, 10), ans=(1, 5, 10, 100)):
    recalls = {an: [] for an in ans}
    for v, props in proposals.items():
        gt = dataset.gt[v]
        p = np.array([x[:2] for x in props]).reshape(-1, 2)
        inter = np.minimum(p[:, None, 1], gt[None, :, 1]) - np.maximum(p[:, None, 0], gt[None, :, 0])
        union = (p[:, 1] - p[:, 0])[:, None] + (gt[:, 1] - gt[:, 0])[None] - inter.clip(0)
        iou = inter.clip(0) / np.maximum(union, 1e-8)
        for an in ans:
            best = iou[:an].max(0) if len(p) else np.zeros(len(gt))
            recalls[an].append(np.mean([(best >= t).mean() for t in tious]))
    return {f"AR@{an}": float(np.mean(r)) for an, r in recalls.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feature-dir", required=True)
    ap.add_argument("--anno", required=True)
    ap.add_argument("--out", default="runs/bmn_anet")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = AnetFeatures(args.feature_dir, args.anno, "training")
    val_set = AnetFeatures(args.feature_dir, args.anno, "validation")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=6, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 8, num_workers=6)

    model = DDP(BMNLite().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.1)
    best, bad_epochs = -1.0, 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (_, feats, gs, ge, gc) in enumerate(train_loader):
            conf, start, end = model(feats.to(device))
            loss = bmn_loss(conf, start, end, gc.to(device), gs.to(device), ge.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        sched.step()

        local_props = generate_proposals(model.module, val_loader, val_set, device)
        all_props = [None] * world
        dist.all_gather_object(all_props, local_props)
        stop = [False]
        if rank == 0:
            merged = {k: v for part in all_props for k, v in part.items()}
            assert len(merged) == len(val_set), (len(merged), len(val_set))
            metrics = average_recall(merged, val_set)
            score = metrics["AR@100"]
            print(f"epoch {epoch}: " + " ".join(f"{k} {v * 100:.2f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.out, "last.pth"))
            if score > best:
                best, bad_epochs = score, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
                with open(os.path.join(args.out, "val_proposals.json"), "w") as f:
                    json.dump(merged, f)
            else:
                bad_epochs += 1
            stop = [bad_epochs >= args.patience]
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            if rank == 0:
                print(f"no improvement for {args.patience} epochs, stopping", flush=True)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
