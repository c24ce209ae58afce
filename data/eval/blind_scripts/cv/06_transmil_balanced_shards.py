"""TransMIL (Shao et al., NeurIPS 2021) for TCGA-RCC subtyping (KIRC / KIRP / KICH), DDP.

Bag sizes range from ~300 to ~90k patches, so shards are balanced by patch count rather
than slide count: each rank gets a similar amount of compute but not the same number of
slides.  Uneven step counts are handled with DDP's join() context manager.
"""
import argparse
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nystrom_attention import NystromAttention
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler

CLASSES = ["KIRC", "KIRP", "KICH"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--meta", default="meta/tcga_rcc.csv")       # case_id, slide_id, subtype, n_patches
    p.add_argument("--folds", default="meta/tcga_rcc_folds.json")  # {"0": [case ids...], ...}
    p.add_argument("--h5_dir", default="features/ctranspath/h5_files")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=1e-2)
    p.add_argument("--grad_ckpt", action="store_true", help="recompute transformer layers in backward")
    p.add_argument("--out", default="outputs/transmil_rcc")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class TransLayer(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = NystromAttention(dim=dim, dim_head=dim // 8, heads=8, num_landmarks=dim // 2,
                                     pinv_iterations=6, residual=True, dropout=0.1)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class PPEG(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 7, 1, 7 // 2, groups=dim)
        self.proj1 = nn.Conv2d(dim, dim, 5, 1, 5 // 2, groups=dim)
        self.proj2 = nn.Conv2d(dim, dim, 3, 1, 3 // 2, groups=dim)

    def forward(self, x, H, W):
        B, _, C = x.shape
        cls_token, feat_token = x[:, 0], x[:, 1:]
        cnn_feat = feat_token.transpose(1, 2).view(B, C, H, W)
        x = self.proj(cnn_feat) + cnn_feat + self.proj1(cnn_feat) + self.proj2(cnn_feat)
        x = x.flatten(2).transpose(1, 2)
        return torch.cat((cls_token.unsqueeze(1), x), dim=1)


class TransMIL(nn.Module):
    def __init__(self, in_dim=768, n_classes=3, grad_ckpt=False):
        super().__init__()
        self.pos_layer = PPEG(512)
        self._fc1 = nn.Sequential(nn.Linear(in_dim, 512), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, 512))
        self.layer1 = TransLayer(512)
        self.layer2 = TransLayer(512)
        self.norm = nn.LayerNorm(512)
        self._fc2 = nn.Linear(512, n_classes)
        self.grad_ckpt = grad_ckpt

    def _run(self, layer, h):
        if self.grad_ckpt and self.training:
            return checkpoint(layer, h, use_reentrant=False)
        return layer(h)

    def forward(self, x):
        h = self._fc1(x.unsqueeze(0))                       # 1 x N x 512
        H = W = int(np.ceil(np.sqrt(h.shape[1])))
        add_length = H * W - h.shape[1]
        h = torch.cat([h, h[:, :add_length, :]], dim=1)     # pad to a square
        h = torch.cat((self.cls_token.expand(h.shape[0], -1, -1), h), dim=1)
        h = self._run(self.layer1, h)
        h = self.pos_layer(h, H, W)
        h = self._run(self.layer2, h)
        return self._fc2(self.norm(h)[:, 0])


class H5Bags(Dataset):
    def __init__(self, df, h5_dir):
        self.df = df.reset_index(drop=True)
        self.h5_dir = Path(h5_dir)

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        with h5py.File(self.h5_dir / f"{r.slide_id}.h5", "r") as f:
            x = torch.from_numpy(f["features"][:]).float()
        return x, CLASSES.index(r.subtype), r.slide_id


class PatchBalancedSampler(Sampler):
    """Greedy longest-processing-time partition of slides over ranks by patch count.

    Every rank computes the same partition from the same inputs; only the order within
    a shard is shuffled per epoch.
    """

    def __init__(self, n_patches, rank, world, shuffle=True, seed=0):
        order = np.argsort(-np.asarray(n_patches), kind="stable")
        loads = np.zeros(world)
        shards = [[] for _ in range(world)]
        for idx in order:
            r = int(np.argmin(loads))
            shards[r].append(int(idx))
            loads[r] += n_patches[idx]
        self.indices = shards[rank]
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(self.indices)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter([self.indices[j] for j in torch.randperm(len(self.indices), generator=g).tolist()])

    def __len__(self):
        return len(self.indices)


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    rows = []
    for x, y, sid in loader:
        prob = F.softmax(net(x[0].to(device, non_blocking=True)), dim=-1)[0]
        rows.append((sid[0], int(y), prob.cpu().numpy()))
    parts = [None] * world
    dist.all_gather_object(parts, rows)
    rows = [r for part in parts for r in part]
    y = np.array([r[1] for r in rows])
    P = np.stack([r[2] for r in rows])
    auc = roc_auc_score(y, P, multi_class="ovr", average="macro")
    acc = float((P.argmax(1) == y).mean())
    return auc, acc, rows


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    meta = pd.read_csv(args.meta)
    with open(args.folds) as f:
        test_cases = set(json.load(f)[str(args.fold)])
    train_df = meta[~meta.case_id.isin(test_cases)].sort_values("slide_id").reset_index(drop=True)
    test_df = meta[meta.case_id.isin(test_cases)].sort_values("slide_id").reset_index(drop=True)

    train_ds, test_ds = H5Bags(train_df, args.h5_dir), H5Bags(test_df, args.h5_dir)
    train_sampler = PatchBalancedSampler(train_df.n_patches.tolist(), rank, world, shuffle=True, seed=args.seed)
    test_sampler = PatchBalancedSampler(test_df.n_patches.tolist(), rank, world, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=4, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=1, sampler=test_sampler, num_workers=4, pin_memory=True)

    net = TransMIL(in_dim=768, n_classes=len(CLASSES), grad_ckpt=args.grad_ckpt).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.RAdam(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    out = Path(args.out) / f"fold{args.fold}"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum, n = torch.zeros((), device=device), torch.zeros((), device=device)
        with model.join():
            for x, y, _ in train_loader:
                logits = model(x[0].to(device, non_blocking=True))
                loss = F.cross_entropy(logits, y.to(device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_sum += loss.detach()
                n += 1
        sched.step()
        stats = torch.stack([loss_sum, n])
        dist.all_reduce(stats)

        auc, acc, _ = evaluate(net, test_loader, device, world)
        if rank == 0:
            print(f"epoch {epoch:03d}  loss {stats[0].item() / stats[1].item():.4f}  "
                  f"test macro-AUC {auc:.4f}  acc {acc:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict()}, out / "last.pt")
            if auc > best:
                best = auc
                torch.save({"epoch": epoch, "model": net.state_dict()}, out / "best.pt")

    dist.barrier()
    net.load_state_dict(torch.load(out / "best.pt", map_location=device)["model"])
    auc, acc, rows = evaluate(net, test_loader, device, world)
    if rank == 0:
        pd.DataFrame({"slide_id": [r[0] for r in rows], "label": [CLASSES[r[1]] for r in rows],
                      **{f"p_{c}": [r[2][k] for r in rows] for k, c in enumerate(CLASSES)}}
                     ).to_csv(out / "test_predictions.csv", index=False)
        print(f"fold {args.fold}: best test macro-AUC {auc:.4f}, acc {acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
