"""Page-type classifier (invoice / contract / form / letter / ...) on rendered PDF pages.

Pages are pre-rendered at 150 dpi into <root>/<class>/<doc_id>_p<page>.png.
We split by document so that pages of one PDF never end up in both train and val.

    torchrun --standalone --nproc_per_node=8 03_dit_pdf_page_classifier.py --root /mnt/pages --epochs 20
"""
import argparse
import collections
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModelForImageClassification, get_cosine_schedule_with_warmup

IMAGENET_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STD = (0.5, 0.5, 0.5)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="microsoft/dit-base-finetuned-rvlcdip")
    ap.add_argument("--out", default="checkpoints/dit_pages")
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup_epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def index_pages(root):
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    by_doc = collections.defaultdict(list)
    for ci, cls in enumerate(classes):
        for fname in os.listdir(os.path.join(root, cls)):
            if not fname.endswith(".png"):
                continue
            doc_id = fname.rsplit("_p", 1)[0]
            by_doc[(cls, doc_id)].append((os.path.join(root, cls, fname), ci))
    return classes, by_doc


def split_by_document(by_doc, val_frac):
    docs = sorted(by_doc.keys())
    random.shuffle(docs)
    n_val = int(len(docs) * val_frac)
    val_docs, train_docs = docs[:n_val], docs[n_val:]
    train = [p for d in train_docs for p in by_doc[d]]
    val = [p for d in val_docs for p in by_doc[d]]
    return train, val


class PageDataset(Dataset):
    def __init__(self, items, tfm):
        self.items = items
        self.tfm = tfm

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = Image.open(path).convert("RGB")
        return self.tfm(img), label


def build_transforms(size):
    train_tfm = transforms.Compose([
        transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomApply([transforms.RandomRotation(2, fill=255)], p=0.3),
        transforms.ColorJitter(brightness=0.2, contrast=0.2),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    val_tfm = transforms.Compose([
        transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    return train_tfm, val_tfm


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    conf = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    loss_sum = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(pixel_values=x).logits
        loss_sum[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        loss_sum[1] += y.numel()
        pred = logits.argmax(1)
        conf.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    dist.all_reduce(conf)
    dist.all_reduce(loss_sum)
    model.train()
    acc = conf.diag().sum().item() / max(conf.sum().item(), 1)
    per_class = conf.diag().float() / conf.sum(1).clamp(min=1).float()
    return acc, per_class.mean().item(), (loss_sum[0] / loss_sum[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation stream on every GPU
    seed_everything(args.seed + rank)

    classes, by_doc = index_pages(args.root)
    train_items, val_items = split_by_document(by_doc, args.val_frac)
    if rank == 0:
        print(f"{len(classes)} classes, {len(by_doc)} documents, "
              f"{len(train_items)} train pages, {len(val_items)} val pages", flush=True)

    train_tfm, val_tfm = build_transforms(args.img)
    train_ds, val_ds = PageDataset(train_items, train_tfm), PageDataset(val_items, val_tfm)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = AutoModelForImageClassification.from_pretrained(
        args.model,
        num_labels=len(classes),
        id2label=dict(enumerate(classes)),
        label2id={c: i for i, c in enumerate(classes)},
        ignore_mismatched_sizes=True,
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(".bias") else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    steps_per_epoch = len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
    )

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0, seen, running = time.time(), 0, 0.0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(pixel_values=x).logits
                loss = F.cross_entropy(logits, y, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item()
            seen += 1
        acc, macc, vloss = validate(model, val_loader, device, len(classes))
        if rank == 0:
            ips = seen * args.bs * world / (time.time() - t0)
            print(f"epoch {epoch}: train_loss {running / max(seen, 1):.4f} val_loss {vloss:.4f} "
                  f"acc {acc:.4f} mean_cls_acc {macc:.4f} ({ips:.0f} img/s)", flush=True)
            if acc > best:
                best = acc
                model.module.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best", "val.json"), "w") as f:
                    json.dump({"epoch": epoch, "acc": acc, "mean_class_acc": macc}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
