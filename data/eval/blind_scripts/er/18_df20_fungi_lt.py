"""Danish Fungi 2020 (DF20, long-tailed, 1604 species) with timm, baseline recipe:
logit-adjusted CE, EfficientNet-B3, 8 GPUs.

metadata csv columns used: image_path, scientificName

    torchrun --nproc_per_node=8 df20_fungi_lt.py --train-csv DF20-train_metadata.csv \
        --test-csv DF20-public_test_metadata.csv --img-dir /data/DF20 --output runs/df20_b3_la
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from timm.data import resolve_data_config, create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--test-csv", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--model", default="efficientnet_b3")
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.01, help="at total batch 256")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--output", default="runs/df20")
    return ap.parse_args()


class FungiDataset(Dataset):
    def __init__(self, df, img_dir, class_to_idx, transform):
        self.paths = df["image_path"].tolist()
        self.labels = [class_to_idx[s] for s in df["scientificName"]]
        self.img_dir, self.transform = img_dir, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.paths[i])).convert("RGB")
        return self.transform(img), self.labels[i]


@torch.no_grad()
def evaluate(net, loader, counts, device):
    net.eval()
    C = len(counts)
    conf_diag = torch.zeros(C, device=device)
    support = torch.zeros(C, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = net(x).argmax(1)
        support += torch.bincount(y, minlength=C)
        conf_diag += torch.bincount(y[pred == y], minlength=C)
    dist.all_reduce(conf_diag)
    dist.all_reduce(support)
    has = support > 0
    recall = conf_diag[has] / support[has]
    cnt = torch.as_tensor(counts, device=device)[has]
    return {
        "top1": (conf_diag.sum() / support.sum()).item(),
        "macro_recall": recall.mean().item(),
        "many": recall[cnt > 100].mean().item(),
        "medium": recall[(cnt >= 20) & (cnt <= 100)].mean().item(),
        "few": recall[cnt < 20].mean().item(),
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_df = pd.read_csv(args.train_csv)
    test_df = pd.read_csv(args.test_csv)
    test_df = test_df[test_df["scientificName"].isin(set(train_df["scientificName"]))]
    classes = list(set(train_df["scientificName"]))
    class_to_idx = {c: i for i, c in enumerate(classes)}
    num_classes = len(classes)

    model = timm.create_model(args.model, pretrained=True, num_classes=num_classes)
    data_cfg = resolve_data_config({"input_size": (3, args.img_size, args.img_size)}, model=model)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m7-mstd0.5")
    test_tf = create_transform(**data_cfg, is_training=False)
    train_set = FungiDataset(train_df, args.img_dir, class_to_idx, train_tf)
    test_set = FungiDataset(test_df, args.img_dir, class_to_idx, test_tf)
    counts = np.bincount(train_set.labels, minlength=num_classes)
    log_prior = torch.log(torch.tensor(counts / counts.sum(), dtype=torch.float32, device=device))
    if rank == 0:
        print(f"{len(train_set)} train / {len(test_set)} test images, {num_classes} species, "
              f"head {counts.max()} tail {counts.min()}", flush=True)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_part = torch.utils.data.Subset(test_set, np.array_split(np.arange(len(test_set)), world)[rank].tolist())
    test_loader = DataLoader(test_part, batch_size=64, num_workers=args.workers, pin_memory=True)

    model = DDP(model.to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "class_to_idx.json"), "w") as f:
            json.dump(class_to_idx, f)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = F.cross_entropy(logits.float() + args.tau * log_prior, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        m = evaluate(model.module, test_loader, counts, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " + ", ".join(f"{k}={100 * v:.2f}" for k, v in m.items()),
                  flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "metrics": m, "classes": classes}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if m["macro_recall"] > best:
                best = m["macro_recall"]
                torch.save(state, os.path.join(args.output, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
