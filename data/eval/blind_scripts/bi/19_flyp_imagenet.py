"""FLYP: fine-tune CLIP on ImageNet with the contrastive pre-training loss.

Each training image is paired with a prompt built from its class name; evaluation uses the
zero-shot head made from the (fine-tuned) text tower, as in the paper.
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

import open_clip

TEMPLATES = [
    "a photo of a {}.", "a bad photo of a {}.", "a photo of many {}.", "a sculpture of a {}.",
    "a rendering of a {}.", "graffiti of a {}.", "a cropped photo of the {}.", "a tattoo of a {}.",
    "a bright photo of a {}.", "a photo of a clean {}.", "a photo of a dirty {}.", "a dark photo of the {}.",
    "a drawing of a {}.", "a photo of my {}.", "the plastic {}.", "a photo of the cool {}.",
    "a close-up photo of a {}.", "a black and white photo of the {}.", "a painting of the {}.",
    "a pixelated photo of the {}.", "a jpeg corrupted photo of a {}.", "a blurry photo of the {}.",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--imagenet", default="/datasets/imagenet")
    p.add_argument("--classnames", default="/datasets/imagenet/classnames.txt")
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="openai")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--save", default="/shared/flyp/vitb16")
    return p.parse_args()


class PromptedImageNet(torch.utils.data.Dataset):
    def __init__(self, root, transform, classnames, tokenizer):
        self.base = ImageFolder(root, transform=transform)
        self.classnames = classnames
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        text = random.choice(TEMPLATES).format(self.classnames[y])
        return img, self.tokenizer([text])[0], y


def gather_cat(x):
    xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs)


def flyp_loss(img, txt, scale):
    all_img, all_txt = gather_cat(img), gather_cat(txt)
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@torch.no_grad()
def zeroshot_head(model, tokenizer, classnames, device):
    heads = []
    for c in classnames:
        toks = tokenizer([t.format(c) for t in TEMPLATES]).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            e = F.normalize(model.encode_text(toks).float(), dim=-1).mean(0)
        heads.append(F.normalize(e, dim=0))
    return torch.stack(heads, 1)


@torch.no_grad()
def evaluate(model, tokenizer, classnames, loader, device):
    model.eval()
    head = zeroshot_head(model, tokenizer, classnames, device)
    correct, total = 0, 0
    for images, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = F.normalize(model.encode_image(images.to(device, non_blocking=True)).float(), dim=-1)
        correct += (f @ head).argmax(1).eq(y.to(device)).sum().item()
        total += y.numel()
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(args.classnames) as f:
        classnames = [l.strip() for l in f if l.strip()]
    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_set = PromptedImageNet(os.path.join(args.imagenet, "train"), train_tf, classnames, tokenizer)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = ImageFolder(os.path.join(args.imagenet, "val"), transform=val_tf)
    # each rank takes every world-th image; no padding, so the summed counts are exact
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=args.workers, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total_steps - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()

    acc = evaluate(model.module, tokenizer, classnames, val_loader, device)
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        print(f"zero-shot top1 before fine-tuning: {acc:.4f}", flush=True)

    best = acc
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, texts, _) in enumerate(train_loader):
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
                loss = flyp_loss(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        acc = evaluate(model.module, tokenizer, classnames, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: ImageNet top1 {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "top1": acc},
                       os.path.join(args.save, f"checkpoint_{epoch}.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
