"""Shared-backbone multi-task model for cassava field plots: plant count + disease class.

Two annotation campaigns exist for the same trial fields: plant counts from
the early flights and disease scores (CMD / CBSD / healthy) from the mid-season
flights. They do not overlap in plots, so training alternates between a count
batch and a disease batch, each going through its own head.

    torchrun --nproc_per_node=4 17_multitask_count_disease.py --root /data/cassava_uav
"""
import argparse
import itertools
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

DISEASES = ["healthy", "cmd", "cbsd"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--backbone", default="resnet34")
    p.add_argument("--size", type=int, default=320)
    p.add_argument("--steps-per-epoch", type=int, default=400, help="count+disease step pairs per epoch")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--count-weight", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="runs/cassava_mt")
    return p.parse_args()


class PlotImages(Dataset):
    def __init__(self, df, root, target_col, tf):
        self.files = [os.path.join(root, f) for f in df.file]
        self.targets = df[target_col].values
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), self.targets[i]


class MultiTaskNet(nn.Module):
    def __init__(self, backbone, num_diseases):
        super().__init__()
        self.encoder = timm.create_model(backbone, pretrained=True, num_classes=0)
        d = self.encoder.num_features
        self.count_head = nn.Sequential(nn.Linear(d, 256), nn.ReLU(inplace=True), nn.Linear(256, 1))
        self.disease_head = nn.Sequential(nn.Dropout(0.3), nn.Linear(d, num_diseases))

    def forward(self, x, task):
        f = self.encoder(x)
        if task == "count":
            return F.softplus(self.count_head(f)).squeeze(1)
        return self.disease_head(f)


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch


def make_loader(ds, bs, workers, rank, world, seed):
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=workers, pin_memory=True,
                      drop_last=True, persistent_workers=True), sampler


@torch.no_grad()
def evaluate(net, count_loader, disease_loader, device):
    net.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)  # abs err, n_count, correct, n_disease
    for x, y in count_loader:
        x, y = x.to(device), y.to(device).float()
        s[0] += (net(x, "count") - y).abs().sum()
        s[1] += len(y)
    for x, y in disease_loader:
        x, y = x.to(device), y.to(device)
        s[2] += (net(x, "disease").argmax(1) == y).sum()
        s[3] += len(y)
    dist.all_reduce(s)
    return (s[0] / s[1]).item(), (s[2] / s[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf_train = T.Compose([T.RandomResizedCrop(args.size, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ColorJitter(0.3, 0.3, 0.2, 0.03), T.ToTensor(), norm])
    # counts must not change under augmentation: no crops for the count task
    tf_count = T.Compose([T.Resize((args.size, args.size)), T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
                          T.ColorJitter(0.3, 0.3, 0.2, 0.03), T.ToTensor(), norm])
    tf_val = T.Compose([T.Resize((args.size, args.size)), T.ToTensor(), norm])

    cdf = pd.read_csv(os.path.join(args.root, "counts.csv"))
    ddf = pd.read_csv(os.path.join(args.root, "disease.csv"))
    ddf["y"] = ddf.disease.map({d: i for i, d in enumerate(DISEASES)})
    img_root = os.path.join(args.root, "plots")
    count_train = PlotImages(cdf[cdf.split == "train"], img_root, "count", tf_count)
    dis_train = PlotImages(ddf[ddf.split == "train"], img_root, "y", tf_train)
    count_val = PlotImages(cdf[cdf.split == "val"], img_root, "count", tf_val)
    dis_val = PlotImages(ddf[ddf.split == "val"], img_root, "y", tf_val)

    count_loader, count_sampler = make_loader(count_train, args.batch_size, args.workers, rank, world, 1)
    dis_loader, dis_sampler = make_loader(dis_train, args.batch_size, args.workers, rank, world, 2)
    count_iter = infinite(count_loader, count_sampler)
    dis_iter = infinite(dis_loader, dis_sampler)
    val_c = DataLoader(Subset(count_val, range(rank, len(count_val), world)), batch_size=64, num_workers=2)
    val_d = DataLoader(Subset(dis_val, range(rank, len(dis_val), world)), batch_size=64, num_workers=2)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(MultiTaskNet(args.backbone, len(DISEASES))).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.steps_per_epoch * 2)
    ce = nn.CrossEntropyLoss(label_smoothing=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        meter = torch.zeros(4, device=device)
        for step in range(args.steps_per_epoch):
            for task in ("count", "disease"):
                x, y = next(count_iter) if task == "count" else next(dis_iter)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x, task)
                if task == "count":
                    loss = args.count_weight * F.smooth_l1_loss(out, y.float(), beta=2.0)
                    meter[0] += loss.detach(); meter[1] += 1
                else:
                    loss = ce(out, y)
                    meter[2] += loss.detach(); meter[3] += 1
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        dist.all_reduce(meter)

        mae, acc = evaluate(net, val_c, val_d, device)
        score = acc - mae / 50.0  # model selection: both tasks, count error relative to ~50 plants/plot
        if rank == 0:
            print(f"epoch {epoch} count_loss {(meter[0] / meter[1]).item():.3f} dis_loss "
                  f"{(meter[2] / meter[3]).item():.3f} | val MAE {mae:.2f} acc {acc:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if score > best:
                best = score
                torch.save({"model": net.state_dict(), "epoch": epoch, "mae": mae, "acc": acc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
