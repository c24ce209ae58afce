"""Post-hoc last-layer Laplace approximation (KFAC) for a trained classifier.

Following Daxberger et al. (2021), "Laplace Redux": keep the MAP feature
extractor, put a Gaussian posterior on the last linear layer with a Kronecker
factored GGN, tune the prior precision on validation NLL, and predict with
the probit approximation. Data passes are split over the GPUs and the
Kronecker factors / NLL sums are all-reduced.

    torchrun --nproc_per_node=4 16_last_layer_laplace.py --ckpt runs/resnet50_c100/best.pt --data /data/cifar100
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Subset
from torchvision import transforms as T

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def build_backbone(num_classes):
    m = torchvision.models.resnet50(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def features_and_logits(model, x):
    fc = model.fc
    model.fc = nn.Identity()
    phi = model(x)
    model.fc = fc
    return phi, fc(phi)


class KronLastLayer:
    def __init__(self, fc: nn.Linear):
        self.W = torch.cat([fc.weight, fc.bias[:, None]], dim=1).detach()  # [C, d+1]
        C, d1 = self.W.shape
        self.A = torch.zeros(d1, d1, device=DEVICE, dtype=torch.float64)
        self.G = torch.zeros(C, C, device=DEVICE, dtype=torch.float64)
        self.n = torch.zeros((), device=DEVICE, dtype=torch.float64)

    @staticmethod
    def augment(phi):
        return torch.cat([phi, torch.ones_like(phi[:, :1])], dim=1)

    def accumulate(self, phi, logits):
        a = self.augment(phi).double()
        p = logits.double().softmax(-1)
        self.A += a.T @ a
        self.G += torch.diag(p.sum(0)) - p.T @ p
        self.n += phi.size(0)

    def all_reduce(self):
        for t in (self.A, self.G, self.n):
            dist.all_reduce(t)

    def finalize(self):
        # H ~= G (x) A / N  (expectation over data in A, sum in G)
        self.A_mean = self.A / self.n
        self.sa, self.Ua = torch.linalg.eigh(self.A_mean)
        self.sg, self.Ug = torch.linalg.eigh(self.G)
        self.sa.clamp_(min=0)
        self.sg.clamp_(min=0)

    def predictive(self, phi, prior_prec):
        a = self.augment(phi).double()
        f = a @ self.W.double().T  # [B, C]
        ap = a @ self.Ua  # [B, d+1]
        denom = self.sg[:, None] * self.sa[None, :] + prior_prec  # [C, d+1]
        inner = (ap ** 2) @ (1.0 / denom).T  # [B, C] in G-eigenbasis
        var = inner @ (self.Ug ** 2).T  # diag of Ug diag(inner) Ug^T
        kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * var)
        return F.softmax(kappa * f, dim=-1)


def shard_loader(ds, rank, world, bs=500):
    return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=bs, num_workers=4, pin_memory=True)


@torch.no_grad()
def collect(model, loader):
    phis, logits, ys = [], [], []
    for x, y in loader:
        phi, f = features_and_logits(model, x.to(DEVICE, non_blocking=True))
        phis.append(phi.float()); logits.append(f.float()); ys.append(y.to(DEVICE))
    return torch.cat(phis), torch.cat(logits), torch.cat(ys)


def reduced_metrics(probs, y):
    s = torch.stack([
        F.nll_loss(probs.clamp_min(1e-12).log(), y, reduction="sum"),
        probs.argmax(1).eq(y).sum().double(),
        torch.tensor(float(y.numel()), device=y.device, dtype=torch.float64),
    ]).double()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-classes", type=int, default=100)
    ap.add_argument("--val-size", type=int, default=5000)
    ap.add_argument("--prior-grid", type=float, nargs="+",
                    default=[1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0])
    ap.add_argument("--out", default="laplace_results.json")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    norm = T.Normalize((0.507, 0.487, 0.441), (0.267, 0.256, 0.276))
    tf = T.Compose([T.ToTensor(), norm])
    full_train = torchvision.datasets.CIFAR100(args.data, True, tf)
    test = torchvision.datasets.CIFAR100(args.data, False, tf)
    perm = torch.randperm(len(full_train), generator=torch.Generator().manual_seed(0)).tolist()
    val, fit = Subset(full_train, perm[:args.val_size]), Subset(full_train, perm[args.val_size:])

    model = build_backbone(args.num_classes)
    sd = torch.load(args.ckpt, map_location="cpu")
    model.load_state_dict(sd["model"] if "model" in sd else sd)
    model.to(DEVICE).eval()

    # 1) Kronecker factors of the last-layer GGN over the fit split
    lap = KronLastLayer(model.fc)
    with torch.no_grad():
        for x, _ in shard_loader(fit, rank, world):
            phi, f = features_and_logits(model, x.to(DEVICE, non_blocking=True))
            lap.accumulate(phi, f)
    lap.all_reduce()
    lap.finalize()
    if rank == 0:
        print(f"fitted KFAC factors on {int(lap.n.item())} points", flush=True)

    # 2) prior precision by validation NLL
    phi_v, f_v, y_v = collect(model, shard_loader(val, rank, world))
    map_nll, _ = reduced_metrics(F.softmax(f_v.double(), -1), y_v)
    grid = {}
    for lam in args.prior_grid:
        nll, _ = reduced_metrics(lap.predictive(phi_v, lam), y_v)
        grid[lam] = nll
    best_lam = min(grid, key=grid.get)

    # 3) test
    phi_t, f_t, y_t = collect(model, shard_loader(test, rank, world))
    map_test = reduced_metrics(F.softmax(f_t.double(), -1), y_t)
    la_test = reduced_metrics(lap.predictive(phi_t, best_lam), y_t)

    if rank == 0:
        res = {"val_nll_map": map_nll, "val_nll_grid": grid, "prior_precision": best_lam,
               "test_map": {"nll": map_test[0], "acc": map_test[1]},
               "test_laplace": {"nll": la_test[0], "acc": la_test[1]}}
        print(json.dumps(res, indent=2))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
