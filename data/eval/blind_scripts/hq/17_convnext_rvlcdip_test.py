"""RVL-CDIP document image classification (16 classes) with a ConvNeXt from timm.

Trains on train.txt, keeps the best weights on val.txt, and reports the test accuracy of the
best weights at the end.

    torchrun --nproc_per_node=8 17_convnext_rvlcdip_test.py --root /datasets/rvl-cdip --epochs 12
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.loss import LabelSmoothingCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

NUM_CLASSES = 16


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="contains images/ and labels/{train,val,test}.txt")
    ap.add_argument("--arch", default="convnext_small.fb_in22k")
    ap.add_argument("--img_size", type=int, default=384)
    ap.add_argument("--batch_size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=4e-4, help="for the global batch")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--warmup_epochs", type=int, default=1)
    ap.add_argument("--drop_path", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="runs/convnext_rvl")
    return ap.parse_args()


class RVLCDIP(Dataset):
    def __init__(self, root, split, tfm):
        self.img_root = os.path.join(root, "images")
        with open(os.path.join(root, "labels", f"{split}.txt")) as f:
            self.items = [(p, int(y)) for p, y in (line.split() for line in f if line.strip())]
        self.tfm = tfm

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        # a few RVL-CDIP tifs are multi-page / broken; the first frame is enough
        img = Image.open(os.path.join(self.img_root, path))
        img.seek(0)
        return self.tfm(img.convert("RGB")), label


def loaders(args, seed=0):
    train_tfm = T.Compose([
        T.Resize((args.img_size, args.img_size)),
        T.RandomAffine(degrees=2, translate=(0.02, 0.02), scale=(0.95, 1.05), fill=255),
        T.ToTensor(),
        T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    eval_tfm = T.Compose([
        T.Resize((args.img_size, args.img_size)),
        T.ToTensor(),
        T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    sets = {s: RVLCDIP(args.root, s, train_tfm if s == "train" else eval_tfm) for s in ("train", "val", "test")}
    samplers = {s: DistributedSampler(ds, shuffle=(s == "train"), seed=seed) for s, ds in sets.items()}
    dls = {
        s: DataLoader(ds, batch_size=args.batch_size if s == "train" else 2 * args.batch_size, sampler=samplers[s],
                      num_workers=args.workers, pin_memory=True, drop_last=(s == "train"), persistent_workers=True)
        for s, ds in sets.items()
    }
    return dls, samplers["train"]


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        correct += (pred == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    dls, train_sampler = loaders(args)
    model = timm.create_model(args.arch, pretrained=True, num_classes=NUM_CLASSES, drop_path_rate=args.drop_path)
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    steps_per_epoch = len(dls["train"])
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * steps_per_epoch, lr_min=1e-6,
                                  warmup_t=args.warmup_epochs * steps_per_epoch, warmup_lr_init=1e-6)
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)
    best_path = os.path.join(args.out, "best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_acc, global_step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in dls["train"]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            scheduler.step_update(global_step)
            if rank == 0 and global_step % 200 == 0:
                print(f"ep {epoch} step {global_step} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        val_acc = accuracy(model, dls["val"], device)
        if rank == 0:
            print(f"epoch {epoch}: val acc {val_acc:.4f} ({time.time() - t0:.0f}s, "
                  f"{steps_per_epoch * args.batch_size * world / (time.time() - t0):.0f} img/s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    # final test with the best weights, on a fresh model
    test_model = timm.create_model(args.arch, pretrained=False, num_classes=NUM_CLASSES).to(device)
    test_model.load_state_dict(torch.load(best_path, map_location=device))
    test_acc = accuracy(test_model, dls["test"], device)
    if rank == 0:
        print(f"best val acc {best_acc:.4f} -> test acc {test_acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
