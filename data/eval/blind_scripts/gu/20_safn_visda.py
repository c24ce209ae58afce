"""Stepwise Adaptive Feature Norm (SAFN, Xu et al., ICCV'19) on VisDA-2017 with DDP.

Progressively enlarges the feature norms of both domains (Delta r per step),
which makes the task-specific features of the target more transferable.

    torchrun --nproc_per_node=8 20_safn_visda.py --data /data/visda-2017 --epochs 10
"""
import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

CLASSES = ("aeroplane", "bicycle", "bus", "car", "horse", "knife", "motorcycle", "person",
           "plant", "skateboard", "train", "truck")


def get_config():
    p = argparse.ArgumentParser(description="SAFN on VisDA-2017")
    p.add_argument("--data", default="/data/visda-2017")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-L2norm", type=float, default=0.05)
    p.add_argument("--delta-r", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--snapshot", default="snapshots/safn_visda")
    return p.parse_args()


class VisDA(Dataset):
    def __init__(self, root, split, transform):
        self.dir = os.path.join(root, split)
        with open(os.path.join(self.dir, "image_list.txt")) as f:
            self.items = [(p, int(y)) for p, y in (l.strip().split(" ") for l in f if l.strip())]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        p, y = self.items[idx]
        return self.transform(Image.open(os.path.join(self.dir, p)).convert("RGB")), y


class ResBase(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet101(weights=models.ResNet101_Weights.IMAGENET1K_V1)
        self.body = nn.Sequential(*list(r.children())[:-1])

    def forward(self, x):
        return self.body(x).flatten(1)


class ResClassifier(nn.Module):
    def __init__(self, num_classes=12, extract_dim=1000, dropout=0.5):
        super().__init__()
        self.fc1 = nn.Sequential(nn.Linear(2048, extract_dim), nn.BatchNorm1d(extract_dim, affine=True),
                                 nn.ReLU(inplace=True), nn.Dropout(p=dropout))
        self.fc2 = nn.Linear(extract_dim, num_classes)

    def forward(self, x):
        f = self.fc1(x)
        # SAFN scales dropout's output back so the feature norm is comparable at test time
        if self.training:
            f = f * (1 - self.fc1[3].p) ** 0.5
        return self.fc2(f), f


class SAFNNet(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.G = ResBase()
        self.F = ResClassifier(dropout=dropout)

    def forward(self, x):
        return self.F(self.G(x))


def stepwise_afn(f, delta_r, weight):
    radius = f.norm(p=2, dim=1).detach()
    radius = radius + delta_r
    return weight * ((f.norm(p=2, dim=1) - radius) ** 2).mean()


def setup_logging(rank):
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s | %(message)s")
    return logging.getLogger("safn")


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    n = len(CLASSES)
    conf = torch.zeros(n, n, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, _ = model(x)
        conf.index_put_((y, logits.argmax(1)), torch.ones_like(y, dtype=torch.float), accumulate=True)
    dist.all_reduce(conf)
    model.train()
    per_class = conf.diag() / conf.sum(1).clamp(min=1)
    return per_class.mean().item() * 100, per_class


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    log = setup_logging(rank)
    torch.manual_seed(0)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize(256), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    source = VisDA(cfg.data, "train", train_tf)
    target = VisDA(cfg.data, "validation", train_tf)
    target_test = VisDA(cfg.data, "validation", test_tf)

    source_sampler = DistributedSampler(source, shuffle=True, drop_last=True)
    target_sampler = DistributedSampler(target, shuffle=True, drop_last=True)
    source_loader = DataLoader(source, cfg.batch_size, sampler=source_sampler, num_workers=cfg.workers,
                               pin_memory=True, drop_last=True)
    target_loader = DataLoader(target, cfg.batch_size, sampler=target_sampler, num_workers=cfg.workers,
                               pin_memory=True, drop_last=True)
    test_loader = DataLoader(target_test, 100, sampler=DistributedSampler(target_test, shuffle=False),
                             num_workers=cfg.workers, pin_memory=True)

    model = SAFNNet(cfg.dropout).to(device)
    opt = torch.optim.SGD([
        {"params": model.G.parameters(), "lr": cfg.lr},
        {"params": model.F.parameters(), "lr": cfg.lr},
    ], momentum=0.9, weight_decay=5e-4)
    model = DDP(model, device_ids=[local_rank])
    log.info("world size %d, %d source / %d target images", world_size, len(source), len(target))

    if rank == 0:
        os.makedirs(cfg.snapshot, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        source_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        stats = torch.zeros(3, device=device)
        for i, ((xs, ys), (xt, _)) in enumerate(zip(source_loader, target_loader)):
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            xt = xt.to(device, non_blocking=True)
            logits, feats = model(torch.cat([xs, xt]))
            n = xs.size(0)
            cls_loss = F.cross_entropy(logits[:n], ys)
            norm_loss = (stepwise_afn(feats[:n], cfg.delta_r, cfg.weight_L2norm)
                         + stepwise_afn(feats[n:], cfg.delta_r, cfg.weight_L2norm))
            loss = cls_loss + norm_loss

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

            stats += torch.stack([cls_loss.detach(), norm_loss.detach(), torch.ones((), device=device)])
            if i % 100 == 0:
                s = stats.clone()
                dist.all_reduce(s)
                log.info("epoch %d iter %d: cls %.4f afn %.4f feat-norm(t) %.2f", epoch, i,
                         (s[0] / s[2]).item(), (s[1] / s[2]).item(), feats[n:].norm(dim=1).mean().item())

        mean_acc, per_class = evaluate(model, test_loader, device)
        log.info("epoch %d (%.0fs): mean-class acc %.2f | %s", epoch, time.time() - tic, mean_acc,
                 " ".join(f"{c}={100 * a:.1f}" for c, a in zip(CLASSES, per_class.tolist())))
        if rank == 0:
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "acc": mean_acc}, os.path.join(cfg.snapshot, "last.pth"))
            if mean_acc > best:
                best = mean_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "acc": mean_acc},
                           os.path.join(cfg.snapshot, "best.pth"))
        dist.barrier()

    log.info("best mean-class acc %.2f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
