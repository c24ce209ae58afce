"""CLIP RN101 / ViT-B-32 on YFCC15M (csv) with zero-shot ImageNet after every epoch.

torchrun --standalone --nproc_per_node=4 06_clip_yfcc15m_zeroshot.py --model ViT-B-32 \
    --train-csv /data/yfcc15m/yfcc15m.tsv --imagenet-val /data/imagenet/val
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

import open_clip
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES


class TsvCaptions(Dataset):
    def __init__(self, path, root, transform, tokenizer):
        df = pd.read_csv(path, sep="\t", usecols=["key", "caption"])
        self.keys = df["key"].values
        self.caps = df["caption"].values
        self.root = Path(root)
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        key = str(self.keys[i])
        img = Image.open(self.root / key[:3] / f"{key}.jpg").convert("RGB")
        return self.transform(img), self.tokenizer([str(self.caps[i])])[0]


def all_gather_nograd(t, world_size):
    out = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return out


def contrastive_loss(img, txt, scale, rank, world_size):
    imgs = all_gather_nograd(img, world_size)
    txts = all_gather_nograd(txt, world_size)
    imgs[rank], txts[rank] = img, txt
    imgs, txts = torch.cat(imgs), torch.cat(txts)
    logits = scale * imgs @ txts.t()
    y = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


@torch.no_grad()
def zeroshot_classifier(model, tokenizer, device):
    zs = []
    for c in IMAGENET_CLASSNAMES:
        t = tokenizer([tpl(c) for tpl in OPENAI_IMAGENET_TEMPLATES]).to(device)
        e = F.normalize(model.encode_text(t), dim=-1).mean(0)
        zs.append(F.normalize(e, dim=0))
    return torch.stack(zs, 1)


@torch.no_grad()
def evaluate_imagenet(model, tokenizer, loader, device):
    model.eval()
    clf = zeroshot_classifier(model, tokenizer, device)
    correct1 = correct5 = seen = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda"):
            f = F.normalize(model.encode_image(x), dim=-1)
        pred = (f.float() @ clf.float()).topk(5, dim=1).indices
        ok = pred == y[:, None]
        correct1 += ok[:, 0].sum().item()
        correct5 += ok.any(dim=1).sum().item()
        seen += y.numel()
    model.train()
    return correct1 / seen, correct5 / seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--image-root", default="/data/yfcc15m/images")
    ap.add_argument("--imagenet-val", required=True)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default="output/yfcc15m")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, tf_train, tf_val = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_ds = TsvCaptions(args.train_csv, args.image_root, tf_train, tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)

    val_ds = ImageFolder(args.imagenet_val, transform=tf_val)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=8, pin_memory=True)

    no_wd = lambda n, p: p.ndim < 2 or "bias" in n or "ln" in n or "bn" in n or "logit_scale" in n
    optim = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if no_wd(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in model.named_parameters() if not no_wd(n, p)], "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_loader)
    warmup = int(args.warmup_epochs * iters)
    total = args.epochs * iters

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} pairs, {iters} iters/epoch, global batch {args.batch_size * world_size}")

    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for it, (img, txt) in enumerate(train_loader):
            s = epoch * iters + it
            lr = args.lr * (s + 1) / warmup if s < warmup else \
                0.5 * args.lr * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
            for g in optim.param_groups:
                g["lr"] = lr
            img = img.to(device, non_blocking=True)
            txt = txt.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                fi, ft, scale = ddp_model(img, txt)
                loss = contrastive_loss(fi, ft, scale, rank, world_size)
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{iters}] loss {loss.item():.3f} lr {lr:.2e} "
                      f"scale {scale.item():.1f} {(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        top1, top5 = evaluate_imagenet(model, tokenizer, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: imagenet zero-shot top1 {top1 * 100:.2f} top5 {top5 * 100:.2f}", flush=True)
            with open(os.path.join(args.out, "zeroshot.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "top1": top1, "top5": top5}) + "\n")
            state = {"epoch": epoch + 1, "model": model.state_dict(), "optim": optim.state_dict(),
                     "scaler": scaler.state_dict(), "top1": top1}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
