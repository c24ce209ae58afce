"""RVL-CDIP document image classification (16 classes) with a timm ConvNeXt.

Data layout (official release):
    <root>/images/...tif
    <root>/labels/{train,val,test}.txt      # "<relative path> <label>"

Launch:
    torchrun --standalone --nproc_per_node=8 03_rvlcdip_doc_classifier.py --root /data/rvl-cdip
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image, ImageFile
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

ImageFile.LOAD_TRUNCATED_IMAGES = True

RVL_CLASSES = [
    "letter", "form", "email", "handwritten", "advertisement", "scientific report",
    "scientific publication", "specification", "file folder", "news article", "budget",
    "invoice", "presentation", "questionnaire", "resume", "memo",
]


def parse():
    ap = argparse.ArgumentParser("rvl-cdip")
    ap.add_argument("--root", required=True)
    ap.add_argument("--arch", default="convnext_small.fb_in22k")
    ap.add_argument("--img_size", type=int, default=384)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=48, help="per GPU")
    ap.add_argument("--lr", type=float, default=4e-4, help="peak lr for the global batch")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup_epochs", type=float, default=1.0)
    ap.add_argument("--smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--ckpt_dir", default="checkpoints/rvl")
    ap.add_argument("--log_dir", default="tb/rvl")
    return ap.parse_args()


class RVLCDIP(Dataset):
    def __init__(self, root, split, tfm):
        self.root = root
        self.tfm = tfm
        with open(os.path.join(root, "labels", f"{split}.txt")) as f:
            rows = [ln.split() for ln in f if ln.strip()]
        self.items = [(r[0], int(r[1])) for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel, y = self.items[i]
        img = Image.open(os.path.join(self.root, "images", rel)).convert("L").convert("RGB")
        return self.tfm(img), y


def build_transforms(size):
    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train = transforms.Compose([
        transforms.Resize((size, size), antialias=True),
        transforms.RandomAffine(degrees=2, translate=(0.02, 0.02), scale=(0.95, 1.05), fill=255),
        transforms.ToTensor(),
        norm,
    ])
    val = transforms.Compose([
        transforms.Resize((size, size), antialias=True),
        transforms.ToTensor(),
        norm,
    ])
    return train, val


def cosine_lr(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * prog))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    loss_sum = torch.zeros(1, device=device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss_sum += crit(logits.float(), y)
        correct += (logits.argmax(1) == y).sum()
        seen += y.numel()
    for t in (correct, seen, loss_sum):
        dist.all_reduce(t)
    model.train()
    return (correct / seen).item(), (loss_sum / seen).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    tf_train, tf_val = build_transforms(args.img_size)
    train_ds = RVLCDIP(args.root, "train", tf_train)
    val_ds = RVLCDIP(args.root, "val", tf_val)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.batch * 2,
                        num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=True, num_classes=len(RVL_CLASSES),
                              drop_path_rate=0.2).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.999))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    steps_per_epoch = len(train_dl)
    total_steps = steps_per_epoch * args.epochs
    warmup = int(args.warmup_epochs * steps_per_epoch)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val docs, {world} GPUs, "
              f"global batch {args.batch * world}, {total_steps} steps", flush=True)

    step = 0
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for x, y in train_dl:
            lr = cosine_lr(step, total_steps, warmup, args.lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", lr, step)

        acc, vloss = validate(model.module, val_dl, device)
        if rank == 0:
            dt = time.time() - tic
            print(f"epoch {epoch:02d} val_acc {acc:.4f} val_loss {vloss:.4f} ({dt / 60:.1f} min)", flush=True)
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("val/loss", vloss, epoch)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "step": step, "acc": acc, "args": vars(args)}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.ckpt_dir, "best.pth"))

    if rank == 0:
        writer.close()
        print(f"best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
