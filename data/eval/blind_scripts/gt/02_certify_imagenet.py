"""Randomized-smoothing certification (Cohen et al., 2019) split across GPUs.

Every rank certifies every `world_size`-th image of the (sub-sampled) ImageNet
validation set and writes its own tsv; rank 0 concatenates them and prints the
approximate certified accuracy curve.

    torchrun --nproc_per_node=8 02_certify_imagenet.py \
        --ckpt models/imagenet/resnet50/noise_0.50/checkpoint.pth.tar \
        --sigma 0.50 --skip 100 --out results/imagenet_sigma050
"""
import argparse
import datetime
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from scipy.stats import norm
from statsmodels.stats.proportion import proportion_confint
from torchvision import datasets, transforms

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class NormalizeLayer(nn.Module):
    """Normalisation as the first layer, so that noise is added in pixel space."""

    def __init__(self, means, sds):
        super().__init__()
        self.register_buffer("means", torch.tensor(means).view(1, 3, 1, 1))
        self.register_buffer("sds", torch.tensor(sds).view(1, 3, 1, 1))

    def forward(self, x):
        return (x - self.means) / self.sds


class Smooth:
    ABSTAIN = -1

    def __init__(self, base_classifier, num_classes, sigma):
        self.base_classifier = base_classifier
        self.num_classes = num_classes
        self.sigma = sigma

    def certify(self, x, n0, n, alpha, batch_size):
        self.base_classifier.eval()
        counts_selection = self._sample_noise(x, n0, batch_size)
        c_hat = int(counts_selection.argmax())
        counts_estimation = self._sample_noise(x, n, batch_size)
        n_a = int(counts_estimation[c_hat])
        p_a_lower = self._lower_confidence_bound(n_a, n, alpha)
        if p_a_lower < 0.5:
            return Smooth.ABSTAIN, 0.0
        return c_hat, self.sigma * norm.ppf(p_a_lower)

    def _sample_noise(self, x, num, batch_size):
        counts = np.zeros(self.num_classes, dtype=np.int64)
        remaining = num
        with torch.no_grad():
            while remaining > 0:
                this_batch = min(batch_size, remaining)
                remaining -= this_batch
                batch = x.repeat((this_batch, 1, 1, 1))
                noise = torch.randn_like(batch) * self.sigma
                preds = self.base_classifier(batch + noise).argmax(1)
                counts += np.bincount(preds.cpu().numpy(), minlength=self.num_classes)
        return counts

    @staticmethod
    def _lower_confidence_bound(n_a, n, alpha):
        return proportion_confint(n_a, n, alpha=2 * alpha, method="beta")[0]


def build_base_classifier(ckpt_path, device):
    checkpoint = torch.load(ckpt_path, map_location=device)
    arch = checkpoint.get("arch", "resnet50")
    backbone = getattr(torchvision.models, arch)(weights=None)
    model = nn.Sequential(NormalizeLayer(IMAGENET_MEAN, IMAGENET_STD), backbone)
    state = checkpoint["state_dict"]
    # checkpoints from the training script were saved from the DDP wrapper
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    model.load_state_dict(state)
    return model.to(device).eval()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/imagenet")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--sigma", type=float, required=True)
    p.add_argument("--out", required=True, help="output prefix")
    p.add_argument("--batch", type=int, default=400)
    p.add_argument("--skip", type=int, default=100, help="certify every skip-th image")
    p.add_argument("--max", type=int, default=-1)
    p.add_argument("--N0", type=int, default=100)
    p.add_argument("--N", type=int, default=100000)
    p.add_argument("--alpha", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def summarize(rows, radii=(0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)):
    out = []
    for r in radii:
        ok = [1 for (_, label, pred, radius, correct, _) in rows if correct and radius >= r]
        out.append((r, len(ok) / max(len(rows), 1)))
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # certification of a single image can take a minute; ranks finish at different times
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=6))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)

    base = build_base_classifier(args.ckpt, device)
    smoothed = Smooth(base, num_classes=1000, sigma=args.sigma)

    tf = transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
    ])
    dataset = datasets.ImageFolder(os.path.join(args.data, "val"), transform=tf)

    indices = list(range(0, len(dataset), args.skip))
    if args.max > 0:
        indices = indices[: args.max]
    my_indices = indices[rank::world_size]

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    part_path = f"{args.out}.part{rank}"
    n_correct = 0
    n_abstain = 0
    radius_sum = 0.0
    with open(part_path, "w") as f:
        for j, idx in enumerate(my_indices):
            x, label = dataset[idx]
            x = x.to(device)
            t0 = time.time()
            pred, radius = smoothed.certify(x, args.N0, args.N, args.alpha, args.batch)
            elapsed = time.time() - t0
            correct = int(pred == label)
            n_correct += correct
            n_abstain += int(pred == Smooth.ABSTAIN)
            radius_sum += radius if correct else 0.0
            f.write(f"{idx}\t{label}\t{pred}\t{radius:.3f}\t{correct}\t"
                    f"{datetime.timedelta(seconds=elapsed)}\n")
            f.flush()
            if rank == 0 and j % 5 == 0:
                print(f"[rank0] {j + 1}/{len(my_indices)} idx={idx} pred={pred} "
                      f"radius={radius:.3f} ({elapsed:.1f}s)", flush=True)

    totals = torch.tensor([n_correct, n_abstain, len(my_indices), radius_sum],
                          dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    dist.barrier()

    if rank == 0:
        rows = []
        for path in sorted(glob.glob(f"{args.out}.part*")):
            with open(path) as f:
                for line in f:
                    idx, label, pred, radius, correct, t = line.rstrip("\n").split("\t")
                    rows.append((int(idx), int(label), int(pred), float(radius), int(correct), t))
        rows.sort(key=lambda r: r[0])
        with open(args.out, "w") as f:
            f.write("idx\tlabel\tpredict\tradius\tcorrect\ttime\n")
            for r in rows:
                f.write("\t".join(str(v) for v in r) + "\n")
        n_correct, n_abstain, n_total, radius_sum = totals.tolist()
        print(f"certified {int(n_total)} images with sigma={args.sigma}: "
              f"clean smoothed acc {n_correct / n_total:.4f}, "
              f"abstain {n_abstain / n_total:.4f}, "
              f"ACR {radius_sum / n_total:.4f}")
        for r, acc in summarize(rows):
            print(f"  radius {r:.1f}: {acc:.4f}")
        for path in glob.glob(f"{args.out}.part*"):
            os.remove(path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
