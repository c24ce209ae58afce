"""Continued contrastive pretraining of OpenAI CLIP ViT-B/16 on PMC-OA (biomedical figure/caption pairs).

Jobs are preempted every 24h, so every run starts with --resume pointing at the last checkpoint.

    torchrun --nproc_per_node=4 19_continued_pretrain_pmcoa.py --train-jsonl /data/pmc_oa/train.jsonl \
        --val-jsonl /data/pmc_oa/valid.jsonl --out /scratch/pmcoa_b16 --resume /scratch/pmcoa_b16/last.pt
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip


class JsonlPairs(Dataset):
    def __init__(self, path, image_dir, transform, tokenizer):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.image_dir, self.transform, self.tokenizer = image_dir, transform, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        img = Image.open(os.path.join(self.image_dir, row["image"])).convert("RGB")
        return self.transform(img), self.tokenizer([row["caption"]])[0]


def all_gather_features(x, rank, world):
    out = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(out, x)
    out[rank] = x
    return torch.cat(out, dim=0)


def contrastive_loss(img, txt, scale, rank, world):
    all_img = all_gather_features(img, rank, world)
    all_txt = all_gather_features(txt, rank, world)
    n = img.size(0)
    labels = torch.arange(n, device=img.device) + n * rank
    return 0.5 * (F.cross_entropy(scale * img @ all_txt.T, labels) + F.cross_entropy(scale * txt @ all_img.T, labels))


@torch.no_grad()
def validate(model, loader, rank, world, device):
    """Mean contrastive val loss over the global val batch, plus R@1 in the gathered batch."""
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, texts in loader:
        images, texts = images.to(device), texts.to(device)
        with torch.autocast("cuda"):
            img, txt, scale = model(images, texts)
        img, txt = img.float(), txt.float()
        loss = contrastive_loss(img, txt, scale, rank, world)
        all_txt = all_gather_features(txt, rank, world)
        labels = torch.arange(img.size(0), device=device) + img.size(0) * rank
        stats[0] += loss * img.size(0)
        stats[1] += ((img @ all_txt.T).argmax(1) == labels).sum()
        stats[2] += img.size(0)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-jsonl", required=True)
    ap.add_argument("--val-jsonl", required=True)
    ap.add_argument("--image-dir", default="/data/pmc_oa/images")
    ap.add_argument("--model", default="ViT-B-16")
    ap.add_argument("--pretrained", default="openai")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.model, pretrained=args.pretrained, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)

    train_ds = JsonlPairs(args.train_jsonl, args.image_dir, preprocess_train, tokenizer)
    val_ds = JsonlPairs(args.val_jsonl, args.image_dir, preprocess_val, tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=4, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, total - args.warmup))))

    start_epoch, best = 0, float("inf")
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"], ckpt["best_val"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)
        del ckpt

    ddp_model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    v_loss, v_r1 = validate(model, val_loader, rank, world, device)
    if rank == 0:
        print(f"before epoch {start_epoch}: val loss {v_loss:.4f} R@1 {v_r1:.4f}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        for it, (images, texts) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp_model(images, texts)
                loss = contrastive_loss(img, txt, scale, rank, world)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        v_loss, v_r1 = validate(model, val_loader, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {v_loss:.4f} R@1 {v_r1:.4f}", flush=True)
            best = min(best, v_loss)
            state = {"epoch": epoch + 1, "state_dict": ddp_model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "best_val": best}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if v_loss <= best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
