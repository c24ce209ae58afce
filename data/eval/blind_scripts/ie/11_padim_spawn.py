"""PaDiM fitting on several GPUs of one workstation (no training, only
statistics). Started with mp.spawn because the line PCs run it from the
nightly retrain job, not through torchrun.

For every patch position we need the mean and covariance of a randomly
selected subset of ResNet18 channels. The sums (sum x, sum x x^T, count) are
accumulated per rank and all-reduced, which gives exactly the single-GPU
result.

    python padim_fit.py --data /srv/aoi/data --line blister_pack_4 --gpus 4
"""
import argparse
import os
import pickle
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import models, transforms


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Folder(Dataset):
    def __init__(self, root, split, size=256, crop=224):
        self.items = []
        for d in sorted((Path(root) / split).iterdir()):
            for f in sorted(d.glob("*.png")):
                gt = Path(root) / "ground_truth" / d.name / f"{f.stem}_mask.png"
                self.items.append((f, gt if gt.exists() else None, int(d.name != "good")))
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(crop), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.mtf = transforms.Compose([transforms.Resize(size, transforms.InterpolationMode.NEAREST),
                                       transforms.CenterCrop(crop), transforms.ToTensor()])
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, gt, y = self.items[i]
        m = self.mtf(Image.open(gt).convert("L")) if gt else torch.zeros(1, self.crop, self.crop)
        return self.tf(Image.open(f).convert("RGB")), m, y


class Embedding(torch.nn.Module):
    def __init__(self, idx):
        super().__init__()
        r = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1)
        self.stem = torch.nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.l1, self.l2, self.l3 = r.layer1, r.layer2, r.layer3
        self.register_buffer("idx", idx)

    @torch.no_grad()
    def forward(self, x):
        f1 = self.l1(self.stem(x))
        f2 = self.l2(f1)
        f3 = self.l3(f2)
        size = f1.shape[-2:]
        e = torch.cat([f1, F.interpolate(f2, size, mode="nearest"), F.interpolate(f3, size, mode="nearest")], 1)
        return e[:, self.idx]  # B x d x H x W


def mahalanobis_map(emb, mean, cov_inv):
    # emb: B x d x H x W, mean: d x HW, cov_inv: HW x d x d
    b, d, h, w = emb.shape
    delta = emb.reshape(b, d, h * w) - mean.unsqueeze(0)
    delta = delta.permute(2, 0, 1)                                 # HW x B x d
    dist_sq = torch.einsum("pbd,pde,pbe->pb", delta, cov_inv, delta)
    return dist_sq.clamp_min(0).sqrt().T.reshape(b, h, w)


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    # the random channel subset must be identical on every rank: fixed generator, not the global RNG
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.randperm(448, generator=g)[: args.dims]
    model = Embedding(idx).to(device).eval()

    line_root = Path(args.data) / args.line
    train = Folder(line_root, "train")
    # strided shards, no padding: duplicated samples would bias the covariance
    shard = Subset(train, list(range(rank, len(train), world_size)))
    loader = DataLoader(shard, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    s1 = s2 = None
    n = torch.zeros(1, dtype=torch.float64, device=device)
    for x, _, _ in loader:
        e = model(x.to(device, non_blocking=True)).double()           # B x d x H x W
        b, d, h, w = e.shape
        e = e.reshape(b, d, h * w)
        if s1 is None:
            s1 = torch.zeros(d, h * w, dtype=torch.float64, device=device)
            s2 = torch.zeros(h * w, d, d, dtype=torch.float64, device=device)
        s1 += e.sum(0)
        s2 += torch.einsum("bdp,bep->pde", e, e)
        n += b
    if s1 is None:  # more ranks than images: still take part in the reductions
        h = w = 56
        s1 = torch.zeros(args.dims, h * w, dtype=torch.float64, device=device)
        s2 = torch.zeros(h * w, args.dims, args.dims, dtype=torch.float64, device=device)
    for t in (s1, s2, n):
        dist.all_reduce(t)

    if rank == 0:
        mean = s1 / n                                               # d x HW
        cov = s2 / n - torch.einsum("dp,ep->pde", mean, mean)       # HW x d x d
        cov = cov * (n / (n - 1)) + 0.01 * torch.eye(args.dims, dtype=cov.dtype, device=device)
        cov_inv = torch.linalg.inv(cov).float()
        mean = mean.float()
        out = Path(args.out) / args.line
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "padim.pkl", "wb") as f:
            pickle.dump({"idx": idx.numpy(), "mean": mean.cpu().numpy(), "cov_inv": cov_inv.cpu().numpy(),
                         "n_train": int(n.item())}, f)
        print(f"[{args.line}] fitted on {int(n.item())} images, d={args.dims}")

        test = Folder(line_root, "test")
        scores, labels, px_s, px_y = [], [], [], []
        for x, m, y in DataLoader(test, batch_size=8, num_workers=4):
            amap = mahalanobis_map(model(x.to(device)), mean, cov_inv)
            amap = F.interpolate(amap.unsqueeze(1), size=x.shape[-1], mode="bilinear", align_corners=False)
            amap = amap[:, 0].cpu().numpy()
            for k in range(len(y)):
                a = gaussian_filter(amap[k], sigma=4)
                scores.append(a.max())
                labels.append(int(y[k]))
                px_s.append(a.ravel())
                px_y.append(m[k, 0].numpy().ravel() > 0.5)
        print(f"[{args.line}] image AUROC {roc_auc_score(labels, scores):.4f} "
              f"pixel AUROC {roc_auc_score(np.concatenate(px_y), np.concatenate(px_s)):.4f}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--line", required=True)
    ap.add_argument("--out", default="/srv/aoi/models/padim")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--dims", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1024)
    args = ap.parse_args()
    mp.spawn(worker, args=(args.gpus, free_port(), args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
