"""iNaturalist 2019 with class-balanced softmax cross-entropy (Cui et al. 2019).

The annotation json is large and a fraction of the images are corrupt/truncated on
our storage, so the parsed + verified index is cached next to the data.

Usage:
    torchrun --nproc_per_node=8 inat_cb_softmax.py --root /mnt/datasets/inat2019 --cache-dir /mnt/datasets/inat2019/cache
"""
import argparse
import json
import os
import pickle
import time
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--cache-dir", type=str, required=True)
    parser.add_argument("--model", type=str, default="resnet50")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="reference lr at batch 256")
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.999)
    parser.add_argument("--num-workers", type=int, default=12)
    parser.add_argument("--save-dir", type=str, default="checkpoints/inat19_cb")
    parser.add_argument("--save-every", type=int, default=5)
    return parser


def _is_valid_image(path):
    try:
        with Image.open(path) as im:
            im.verify()
        return True
    except Exception:
        return False


def load_or_build_index(root, split, cache_dir):
    cache = os.path.join(cache_dir, f"inat2019_{split}_index.pkl")
    if os.path.isfile(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)

    with open(os.path.join(root, f"{split}2019.json")) as f:
        ann = json.load(f)
    label_of = {a["image_id"]: a["category_id"] for a in ann["annotations"]}
    samples, dropped = [], 0
    for im in ann["images"]:
        path = os.path.join(root, im["file_name"])
        if _is_valid_image(path):
            samples.append((im["file_name"], label_of[im["id"]]))
        else:
            dropped += 1
    index = {"samples": samples, "num_classes": len(ann["categories"]), "dropped": dropped}
    os.makedirs(cache_dir, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
    return index


class INat2019(Dataset):
    def __init__(self, root, index, transform):
        self.root = root
        self.samples = index["samples"]
        self.num_classes = index["num_classes"]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fn, y = self.samples[i]
        img = Image.open(os.path.join(self.root, fn)).convert("RGB")
        return self.transform(img), y

    @property
    def targets(self):
        return np.array([y for _, y in self.samples])


class CBSoftmaxLoss(nn.Module):
    def __init__(self, counts, beta):
        super().__init__()
        eff = 1.0 - np.power(beta, counts)
        w = (1.0 - beta) / eff
        w = w / w.sum() * len(counts)
        self.register_buffer("weight", torch.tensor(w, dtype=torch.float32))

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, weight=self.weight)


@torch.no_grad()
def validate(model, loader, counts, device):
    model.eval()
    C = len(counts)
    stats = torch.zeros(2, C, device=device)  # [correct, total]
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            out = model(x)
        pred = out.argmax(-1)
        stats[1].scatter_add_(0, y, torch.ones_like(y, dtype=stats.dtype))
        stats[0].scatter_add_(0, y, (pred == y).to(stats.dtype))
    dist.all_reduce(stats)
    acc = stats[0] / stats[1].clamp(min=1)
    counts_t = torch.as_tensor(counts, device=device)
    groups = {"many": counts_t > 100, "medium": (counts_t >= 20) & (counts_t <= 100), "few": counts_t < 20}
    out = {"top1": (stats[0].sum() / stats[1].sum()).item()}
    for k, m in groups.items():
        out[k] = acc[m].mean().item()
    return out


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_index = load_or_build_index(args.root, "train", args.cache_dir)
    val_index = load_or_build_index(args.root, "val", args.cache_dir)

    train_set = INat2019(args.root, train_index, create_transform(args.img_size, is_training=True,
                                                                  auto_augment="rand-m9-mstd0.5"))
    val_set = INat2019(args.root, val_index, create_transform(args.img_size, is_training=False))
    counts = np.bincount(train_set.targets, minlength=train_set.num_classes)
    if rank == 0:
        print(f"train {len(train_set)} (dropped {train_index['dropped']}), val {len(val_set)}, "
              f"{train_set.num_classes} classes, imbalance {counts.max() / max(counts.min(), 1):.0f}")

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    # val: 3 images per class; contiguous shards without padding
    n = len(val_set)
    shard = torch.tensor_split(torch.arange(n), world)[rank].tolist()
    val_loader = DataLoader(torch.utils.data.Subset(val_set, shard), batch_size=256,
                            num_workers=args.num_workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=False, num_classes=train_set.num_classes)
    model = model.to(device, memory_format=torch.channels_last)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    criterion = CBSoftmaxLoss(counts, args.beta).to(device)
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 80], gamma=0.1)

    writer = SummaryWriter(os.path.join(args.save_dir, "tb")) if rank == 0 else None
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            if writer is not None and global_step % 100 == 0:
                writer.add_scalar("loss", loss.item(), global_step)
        sched.step()

        metrics = validate(model.module, val_loader, counts, device)
        if rank == 0:
            print(f"epoch {epoch:3d} ({time.time() - t0:.0f}s) " +
                  " ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items()), flush=True)
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, epoch)
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "sched": sched.state_dict()},
                           os.path.join(args.save_dir, f"ep{epoch + 1:03d}.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
