"""AADB aesthetic score + 11 attributes with a rater-aware ranking loss.

Score regression (Euclidean) + attribute regression + pairwise ranking loss on
image pairs that share at least one rater (sampled inside the batch).

    torchrun --nproc_per_node=4 14_aadb_attribute_rank.py --data /data/AADB --epochs 25
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

ATTRIBUTES = ["BalacingElements", "ColorHarmony", "Content", "DoF", "Light", "MotionBlur",
              "Object", "Repetition", "RuleOfThirds", "Symmetry", "VividColor"]


class AADB(Dataset):
    def __init__(self, root, split, train):
        df = pd.read_csv(os.path.join(root, f"imgListFiles_label/{split}.csv"))
        self.root = root
        self.files = df["ImageFile"].tolist()
        self.score = df["score"].values.astype(np.float32)
        self.attrs = df[ATTRIBUTES].values.astype(np.float32)
        self.raters = [set(map(int, str(r).split(";"))) for r in df["workers"]]
        if train:
            self.tf = transforms.Compose([
                transforms.Resize(256), transforms.RandomCrop(227), transforms.RandomHorizontalFlip(),
                transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        else:
            self.tf = transforms.Compose([
                transforms.Resize(256), transforms.CenterCrop(227),
                transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "datasetImages_originalSize", self.files[i])).convert("RGB")
        return self.tf(img), self.score[i], torch.from_numpy(self.attrs[i]), i


class AttrAestheticNet(nn.Module):
    def __init__(self, n_attr):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        r.fc = nn.Identity()
        self.backbone = r
        self.attr = nn.Linear(2048, n_attr)
        self.score = nn.Linear(2048 + n_attr, 1)

    def forward(self, x):
        f = self.backbone(x)
        a = self.attr(f)
        s = self.score(torch.cat([f, torch.tanh(a)], 1))
        return s.squeeze(-1), a


def shared_rater_rank_loss(pred, score, idx, raters, margin=0.05, max_pairs=64):
    ids = idx.tolist()
    pairs = [(a, b) for a in range(len(ids)) for b in range(a + 1, len(ids))
             if raters[ids[a]] & raters[ids[b]] and score[a] != score[b]]
    if len(pairs) > max_pairs:
        pairs = random.sample(pairs, max_pairs)
    if not pairs:
        return pred.sum() * 0.0
    a, b = map(list, zip(*pairs))
    sign = torch.sign(score[a] - score[b])
    return F.relu(margin - sign * (pred[a] - pred[b])).mean()


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    rows = []
    for img, score, attrs, idx in loader:
        s, a = model(img.to(device, non_blocking=True))
        rows.append(torch.cat([s[:, None], score.to(device)[:, None], a, attrs.to(device),
                               idx.to(device).float()[:, None]], 1))
    rows = torch.cat(rows)
    parts = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, rows)
    arr = torch.cat(parts).cpu().numpy()
    _, keep = np.unique(arr[:, -1].astype(np.int64), return_index=True)
    arr = arr[keep]
    assert len(arr) == n
    k = len(ATTRIBUTES)
    out = {"score": spearmanr(arr[:, 0], arr[:, 1])[0]}
    for j, name in enumerate(ATTRIBUTES):
        out[name] = spearmanr(arr[:, 2 + j], arr[:, 2 + k + j])[0]
    model.train()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank-weight", type=float, default=1.0)
    parser.add_argument("--attr-weight", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save-dir", default="snapshots/aadb")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    random.seed(1234 + rank)

    train_set = AADB(args.data, "train", train=True)
    val_set = AADB(args.data, "test", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = AttrAestheticNet(len(ATTRIBUTES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam([
        {"params": model.module.backbone.parameters(), "lr": args.lr * 0.1},
        {"params": list(model.module.attr.parameters()) + list(model.module.score.parameters()), "lr": args.lr},
    ])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(4, device=device)
        for img, score, attrs, idx in train_loader:
            img = img.to(device, non_blocking=True)
            score, attrs = score.to(device), attrs.to(device)
            pred, pred_attr = model(img)
            l_reg = F.mse_loss(pred, score)
            l_attr = F.mse_loss(pred_attr, attrs)
            l_rank = shared_rater_rank_loss(pred, score, idx, train_set.raters)
            loss = l_reg + args.attr_weight * l_attr + args.rank_weight * l_rank
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg += torch.stack([l_reg.detach(), l_attr.detach(), l_rank.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(agg)

        res = evaluate(model, val_loader, device, len(val_set))
        if rank == 0:
            n = agg[3].item()
            print(f"epoch {epoch}: reg {agg[0].item() / n:.4f} attr {agg[1].item() / n:.4f} "
                  f"rank {agg[2].item() / n:.4f} | val SRCC {res['score']:.4f}", flush=True)
            print("   " + " ".join(f"{k}:{v:.3f}" for k, v in res.items() if k != "score"))
            torch.save({"epoch": epoch, "model": model.module.state_dict()},
                       os.path.join(args.save_dir, "latest.pth"))
            if res["score"] > best:
                best = res["score"]
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val": res},
                           os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
