# EfficientNetV2-S fine-tuning on an ImageFolder dataset (defect classification),
# DDP + torch.compile + bf16.
#
#   torchrun --standalone --nproc_per_node=8 07_compile_effnet_imagefolder.py \
#       --data /datasets/pcb_defects --epochs 30 --out runs/effv2s_pcb
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--img", type=int, default=384)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/effnet")
    return ap.parse_args()


def build_model(num_classes, pretrained=False):
    weights = models.EfficientNet_V2_S_Weights.IMAGENET1K_V1 if pretrained else None
    m = models.efficientnet_v2_s(weights=weights)
    m.classifier[1] = nn.Linear(m.classifier[1].in_features, num_classes)
    return m


def loaders(args):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    eval_tf = transforms.Compose([
        transforms.Resize(int(args.img * 1.14)),
        transforms.CenterCrop(args.img),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val = datasets.ImageFolder(os.path.join(args.data, "val"), eval_tf)
    test = datasets.ImageFolder(os.path.join(args.data, "test"), eval_tf)
    tr_s = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=tr_s, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    return train_dl, val, test, tr_s, len(train.classes)


def shard_loader(ds, bs, workers):
    # every rank takes a strided slice, no padding, each image counted once
    rank, world = dist.get_rank(), dist.get_world_size()
    return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=bs,
                      num_workers=workers, pin_memory=True)


@torch.no_grad()
def evaluate(model, loader, device):
    # called with the plain module (no DDP wrapper): shards may differ by one batch
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        stats[0] += (logits.argmax(1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_dl, val_ds, test_ds, train_sampler, num_classes = loaders(args)
    val_dl = shard_loader(val_ds, args.bs * 2, 4)
    test_dl = shard_loader(test_ds, args.bs * 2, 4)

    model = build_model(num_classes, pretrained=True).to(device, memory_format=torch.channels_last)
    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr,
                                                total_steps=args.epochs * len(train_dl),
                                                pct_start=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    best = 0.0
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}][{i}/{len(train_dl)}] loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        acc = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), best_path)
        dist.barrier()

    # reload the best weights into a fresh model for the final test number
    final = build_model(num_classes).to(device, memory_format=torch.channels_last)
    final.load_state_dict(torch.load(best_path, map_location="cpu"))
    test_acc = evaluate(final, test_dl, device)
    if rank == 0:
        print(f"best val {best:.4f}  test {test_acc:.4f}", flush=True)
        torch.save(final.state_dict(), os.path.join(args.out, "final_weights.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
