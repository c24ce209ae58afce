"""Evaluate a deep ensemble under dataset shift (CIFAR-10-C, Hendrycks & Dietterich).

For every corruption and severity we report accuracy, NLL, Brier and ECE of
the ensemble and of the average single member, as in Ovadia et al. (2019),
"Can you trust your model's uncertainty?". The test images are split across
GPUs, every GPU runs all members on its share.

    torchrun --nproc_per_node=4 06_ensemble_eval_cifar10c.py \
        --ckpt-glob 'runs/deep_ensemble/member_*.pt' --data /data/CIFAR-10-C
"""
import argparse
import csv
import glob
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset, Subset

CORRUPTIONS = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
]
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


class CorruptedCIFAR(Dataset):
    def __init__(self, root, corruption, severity):
        x = np.load(os.path.join(root, f"{corruption}.npy"), mmap_mode="r")
        y = np.load(os.path.join(root, "labels.npy"))
        lo, hi = (severity - 1) * 10000, severity * 10000
        self.x, self.y = x[lo:hi], y[lo:hi]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        img = torch.from_numpy(np.ascontiguousarray(self.x[i])).permute(2, 0, 1).float() / 255.0
        return (img - MEAN) / STD, int(self.y[i])


def cifar_resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def load_members(pattern, device):
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(pattern)
    members = []
    for p in paths:
        m = cifar_resnet18()
        m.load_state_dict(torch.load(p, map_location="cpu")["model"])
        members.append(m.to(device).eval())
    return members, paths


class Accumulator:
    """Sufficient statistics for acc / NLL / Brier / ECE, summed over shards."""

    def __init__(self, n_bins, device):
        self.n_bins = n_bins
        self.device = device
        self.sums = torch.zeros(4, device=device, dtype=torch.float64)  # n, correct, nll, brier
        self.bin_count = np.zeros(n_bins)
        self.bin_conf = np.zeros(n_bins)
        self.bin_acc = np.zeros(n_bins)

    def update(self, probs, y):
        conf, pred = probs.max(1)
        correct = pred.eq(y)
        nll = -probs.gather(1, y[:, None]).squeeze(1).clamp_min(1e-12).log()
        brier = (probs - F.one_hot(y, probs.size(1)).float()).pow(2).sum(1)
        self.sums += torch.stack([torch.tensor(float(y.numel()), device=self.device),
                                  correct.sum().double(), nll.sum().double(), brier.sum().double()])
        c = conf.cpu().numpy()
        a = correct.cpu().numpy().astype(np.float64)
        b = np.minimum((c * self.n_bins).astype(np.int64), self.n_bins - 1)
        np.add.at(self.bin_count, b, 1.0)
        np.add.at(self.bin_conf, b, c)
        np.add.at(self.bin_acc, b, a)

    def reduce(self):
        dist.all_reduce(self.sums)
        bins = torch.from_numpy(np.stack([self.bin_count, self.bin_conf, self.bin_acc]))
        dist.all_reduce(bins)
        n, correct, nll, brier = self.sums.tolist()
        cnt, conf, acc = bins.numpy()
        ece = float(np.abs(conf - acc).sum() / max(cnt.sum(), 1.0))
        return {"acc": correct / n, "nll": nll / n, "brier": brier / n, "ece": ece}


@torch.no_grad()
def evaluate(members, loader, device, n_bins):
    ens = Accumulator(n_bins, device)
    singles = [Accumulator(n_bins, device) for _ in members]
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        probs = torch.stack([F.softmax(m(x).float(), dim=1) for m in members])
        ens.update(probs.mean(0), y)
        for acc, p in zip(singles, probs):
            acc.update(p, y)
    out = {"ensemble": ens.reduce()}
    single = [s.reduce() for s in singles]
    out["single_mean"] = {k: float(np.mean([s[k] for s in single])) for k in single[0]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-glob", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--severities", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--corruptions", nargs="+", default=CORRUPTIONS)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="results/cifar10c_ensemble.csv")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    members, paths = load_members(args.ckpt_glob, device)
    if rank == 0:
        print(f"{len(members)} members: {paths}", flush=True)

    rows = []
    for corruption in args.corruptions:
        for sev in args.severities:
            ds = CorruptedCIFAR(args.data, corruption, sev)
            shard = Subset(ds, range(rank, len(ds), world))
            loader = DataLoader(shard, batch_size=args.batch_size, shuffle=False,
                                num_workers=args.workers, pin_memory=True)
            res = evaluate(members, loader, device, args.n_bins)
            if rank == 0:
                e, s = res["ensemble"], res["single_mean"]
                print(f"{corruption:>18s} s{sev}  ens acc {e['acc']:.4f} nll {e['nll']:.4f} "
                      f"ece {e['ece']:.4f} | single acc {s['acc']:.4f} ece {s['ece']:.4f}", flush=True)
                for kind, r in res.items():
                    rows.append({"corruption": corruption, "severity": sev, "model": kind, **r})

    if rank == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        ens = [r for r in rows if r["model"] == "ensemble"]
        print("mean over all shifts: acc {:.4f} ece {:.4f}".format(
            np.mean([r["acc"] for r in ens]), np.mean([r["ece"] for r in ens])))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
