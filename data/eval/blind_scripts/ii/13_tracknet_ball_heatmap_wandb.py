"""TrackNetV2-style shuttlecock / ball tracking from broadcast badminton and tennis.

Input: 3 consecutive frames stacked on channels (9 x 288 x 512); output: one
heatmap per input frame. Positive pixels are a disc of radius `--radius`
around the labelled ball position; frames where the ball is invisible have an
empty heatmap. Validation reports precision/recall/F1 at a 4 px tolerance.

    torchrun --nproc_per_node=8 13_tracknet_ball_heatmap_wandb.py --data /data/shuttle --wandb-project ball-tracking
"""
import argparse
import csv
import os
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

H, W = 288, 512
SEQ = 3


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--global-batch-size", type=int, default=48, help="split evenly over the GPUs")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta lr")
    p.add_argument("--radius", type=int, default=2)
    p.add_argument("--tol", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=Path("ckpt/tracknet"))
    p.add_argument("--wandb-project", default="ball-tracking")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


class RallyFrames(Dataset):
    """Each rally dir has frames/%05d.jpg and Label.csv (Frame,Visibility,X,Y) in original pixel coords."""

    def __init__(self, root, rallies, radius, train):
        self.samples = []
        self.radius, self.train = radius, train
        for r in rallies:
            with open(root / r / "Label.csv") as f:
                rows = list(csv.DictReader(f))
            for i in range(len(rows) - SEQ + 1):
                self.samples.append((root / r / "frames", rows[i:i + SEQ]))

    def __len__(self):
        return len(self.samples)

    def _heatmap(self, x, y, vis):
        hm = np.zeros((H, W), np.float32)
        if vis:
            cv2.circle(hm, (int(round(x)), int(round(y))), self.radius, 1.0, -1)
        return hm

    def __getitem__(self, i):
        fdir, rows = self.samples[i]
        frames, hms, pts = [], [], []
        flip = self.train and np.random.rand() < 0.5
        for r in rows:
            img = cv2.imread(str(fdir / f"{int(r['Frame']):05d}.jpg"))
            h0, w0 = img.shape[:2]
            img = cv2.resize(img, (W, H))[:, :, ::-1]
            x, y, vis = float(r["X"]) * W / w0, float(r["Y"]) * H / h0, int(r["Visibility"]) > 0
            if flip:
                img = img[:, ::-1]
                x = W - 1 - x
            frames.append(img.transpose(2, 0, 1))
            hms.append(self._heatmap(x, y, vis))
            pts.append((x, y, float(vis)))
        x = torch.from_numpy(np.concatenate(frames).astype(np.float32) / 255.0)
        return x, torch.from_numpy(np.stack(hms)), torch.tensor(pts)


def conv_bn(ci, co):
    return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1, bias=False), nn.BatchNorm2d(co), nn.ReLU(inplace=True))


class TrackNetV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.e1 = nn.Sequential(conv_bn(3 * SEQ, 64), conv_bn(64, 64))
        self.e2 = nn.Sequential(conv_bn(64, 128), conv_bn(128, 128))
        self.e3 = nn.Sequential(conv_bn(128, 256), conv_bn(256, 256), conv_bn(256, 256))
        self.b = nn.Sequential(conv_bn(256, 512), conv_bn(512, 512), conv_bn(512, 512))
        self.d3 = nn.Sequential(conv_bn(768, 256), conv_bn(256, 256), conv_bn(256, 256))
        self.d2 = nn.Sequential(conv_bn(384, 128), conv_bn(128, 128))
        self.d1 = nn.Sequential(conv_bn(192, 64), conv_bn(64, 64))
        self.head = nn.Conv2d(64, SEQ, 1)

    def forward(self, x):
        x1 = self.e1(x)
        x2 = self.e2(F.max_pool2d(x1, 2))
        x3 = self.e3(F.max_pool2d(x2, 2))
        b = self.b(F.max_pool2d(x3, 2))
        y = self.d3(torch.cat([F.interpolate(b, scale_factor=2), x3], 1))
        y = self.d2(torch.cat([F.interpolate(y, scale_factor=2), x2], 1))
        y = self.d1(torch.cat([F.interpolate(y, scale_factor=2), x1], 1))
        return self.head(y)


def weighted_bce(logits, target):
    p = logits.sigmoid()
    loss = -(((1 - p) ** 2) * target * torch.log(p.clamp(min=1e-7))
             + (p ** 2) * (1 - target) * torch.log((1 - p).clamp(min=1e-7)))
    return loss.mean()


@torch.no_grad()
def detection_counts(logits, pts, tol):
    """TP / FP / FN (+TN) with the ball position = centroid of the largest blob above 0.5."""
    c = torch.zeros(4, device=logits.device)
    prob = logits.sigmoid()
    for b in range(prob.shape[0]):
        for t in range(SEQ):
            m = prob[b, t] > 0.5
            gx, gy, vis = pts[b, t].tolist()
            if m.any():
                ys, xs = torch.nonzero(m, as_tuple=True)
                px, py = xs.float().mean().item(), ys.float().mean().item()
                if vis and ((px - gx) ** 2 + (py - gy) ** 2) ** 0.5 <= tol:
                    c[0] += 1
                else:
                    c[1] += 1
            elif vis:
                c[2] += 1
            else:
                c[3] += 1
    return c


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    split = {l.split(",")[0]: l.strip().split(",")[1] for l in open(args.data / "split.csv") if l.strip()}
    train_ds = RallyFrames(args.data, sorted(r for r, s in split.items() if s == "train"), args.radius, True)
    val_ds = RallyFrames(args.data, sorted(r for r, s in split.items() if s == "val"), args.radius, False)
    per_gpu = args.global_batch_size // world
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=per_gpu, num_workers=8)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(TrackNetV2()).to(device)
    model = DDP(model, device_ids=[local_rank])
    # Adadelta as in the TrackNetV2 paper; lr=1.0 is its native scale
    opt = torch.optim.Adadelta(model.parameters(), lr=args.lr)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, hm, _) in enumerate(train_dl):
            x, hm = x.to(device, non_blocking=True), hm.to(device, non_blocking=True)
            loss = weighted_bce(model(x), hm)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 50 == 0:
                wandb.log({"train/loss": loss.item(), "epoch": epoch + it / len(train_dl)})

        model.eval()
        counts = torch.zeros(4, device=device)
        with torch.no_grad():
            for x, hm, pts in val_dl:
                counts += detection_counts(model.module(x.to(device)), pts, args.tol)
        dist.all_reduce(counts)
        tp, fp, fn, tn = counts.tolist()
        prec, rec = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-8)
        if rank == 0:
            wandb.log({"val/precision": prec, "val/recall": rec, "val/f1": f1, "val/acc": (tp + tn) / counts.sum().item(),
                       "epoch": epoch + 1})
            print(f"epoch {epoch}: P {prec:.4f} R {rec:.4f} F1 {f1:.4f}", flush=True)
            torch.save(model.module.state_dict(), args.out / "last.pt")
            if f1 > best_f1:
                best_f1 = f1
                torch.save(model.module.state_dict(), args.out / "best.pt")
                wandb.run.summary["best_f1"] = f1
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
