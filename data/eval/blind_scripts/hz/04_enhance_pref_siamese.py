"""Preference model for photo enhancement outputs.

Raters saw two retouched versions of the same photo and picked the better one.
A shared ResNet-50 scores both versions; P(A > B) = sigmoid(s_A - s_B)
(Bradley-Terry) and the model is trained with BCE on the vote fraction.
The backbone keeps its ImageNet BatchNorm statistics (frozen BN) because a GPU
only sees a handful of high-resolution pairs.

    torchrun --standalone --nproc_per_node=8 04_enhance_pref_siamese.py \
        --root /mnt/datasets/enhance_pref --epochs 15
"""
import argparse
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import kendalltau, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T

logger = logging.getLogger("pref")


class PrefPairs(Dataset):
    """json lines: {"a": path, "b": path, "votes_a": int, "votes_b": int}"""

    def __init__(self, root, split, size, train):
        with open(os.path.join(root, f"{split}_pairs.jsonl")) as f:
            self.rows = [json.loads(l) for l in f]
        self.root = root
        aug = [T.RandomResizedCrop(size, scale=(0.5, 1.0))] if train else [T.Resize(size), T.CenterCrop(size)]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        a = Image.open(os.path.join(self.root, r["a"])).convert("RGB")
        b = Image.open(os.path.join(self.root, r["b"])).convert("RGB")
        if self.train and torch.rand(1).item() < 0.5:
            a, b = a.transpose(Image.FLIP_LEFT_RIGHT), b.transpose(Image.FLIP_LEFT_RIGHT)
        p = r["votes_a"] / max(1, r["votes_a"] + r["votes_b"])
        return self.tf(a), self.tf(b), torch.tensor(p, dtype=torch.float32), i


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        net = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        self.features = nn.Sequential(*list(net.children())[:-2])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(2048, 1))

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1)).squeeze(-1)


def freeze_bn(module):
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)


@torch.no_grad()
def validate(model, loader, device, n_pairs):
    model.eval()
    rows = []
    for a, b, p, idx in loader:
        a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
        s = model(torch.cat([a, b]))
        s_a, s_b = s.chunk(2)
        rows.append(torch.stack([torch.sigmoid(s_a - s_b), p.to(device), idx.to(device).float()], 1))
    local = torch.cat(rows)
    bufs = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, local)
    allr = torch.cat(bufs).cpu().numpy()
    _, keep = np.unique(allr[:, 2].astype(np.int64), return_index=True)
    allr = allr[keep]
    assert len(allr) == n_pairs
    pred, gt = allr[:, 0], allr[:, 1]
    decided = gt != 0.5
    acc = float(((pred[decided] > 0.5) == (gt[decided] > 0.5)).mean())
    return {"acc": acc, "srcc": float(spearmanr(pred, gt)[0]), "ktau": float(kendalltau(pred, gt)[0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="out/enhance_pref")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    train_set = PrefPairs(args.root, "train", args.size, train=True)
    val_set = PrefPairs(args.root, "val", args.size, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1234)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2,
                            sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = Scorer()
    freeze_bn(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[8, 12], gamma=0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        freeze_bn(model.module)
        meter = torch.zeros(2, device=device)
        for it, (a, b, p, _) in enumerate(train_loader):
            a = a.to(device, non_blocking=True)
            b = b.to(device, non_blocking=True)
            p = p.to(device, non_blocking=True)
            s_a = model(a)
            s_b = model(b)
            loss = F.binary_cross_entropy_with_logits(s_a - s_b, p)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach() * a.size(0), torch.tensor(float(a.size(0)), device=device)])
            if it % 200 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())
        scheduler.step()

        dist.all_reduce(meter)
        metrics = validate(model, val_loader, device, len(val_set))
        metrics["train_bce"] = (meter[0] / meter[1]).item()
        logger.info("epoch %d %s", epoch, json.dumps(metrics))
        if rank == 0:
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.out, "last.pth"))
            if metrics["acc"] > best_acc:
                best_acc = metrics["acc"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_scorer.pth"))
        dist.barrier()

    logger.info("best pairwise accuracy %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
