"""RN50 CLIP on CC3M (csv of image paths + captions).

    torchrun --nproc_per_node 8 02_rn50_csv_syncbn.py --train-csv /data/cc3m/train.csv \
        --imagenet-val /data/imagenet/val
"""
import argparse
import logging
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

import open_clip
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, SIMPLE_IMAGENET_TEMPLATES


class CsvDataset(Dataset):
    def __init__(self, path, transform, tokenizer, img_key="filepath", caption_key="title", sep="\t"):
        df = pd.read_csv(path, sep=sep)
        self.images = df[img_key].tolist()
        self.captions = df[caption_key].tolist()
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, idx):
        image = self.transform(Image.open(str(self.images[idx])).convert("RGB"))
        text = self.tokenizer([str(self.captions[idx])])[0]
        return image, text


def gather_features(image_features, text_features, rank, world_size):
    gathered_img = [torch.zeros_like(image_features) for _ in range(world_size)]
    gathered_txt = [torch.zeros_like(text_features) for _ in range(world_size)]
    dist.all_gather(gathered_img, image_features)
    dist.all_gather(gathered_txt, text_features)
    gathered_img[rank] = image_features
    gathered_txt[rank] = text_features
    return torch.cat(gathered_img), torch.cat(gathered_txt)


def clip_loss(image_features, text_features, logit_scale, rank, world_size):
    all_img, all_txt = gather_features(image_features, text_features, rank, world_size)
    # local loss: each rank only computes the rows of its own samples
    logits_per_image = logit_scale * image_features @ all_txt.t()
    logits_per_text = logit_scale * text_features @ all_img.t()
    n = image_features.shape[0]
    labels = torch.arange(n, device=image_features.device) + n * rank
    return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels))


@torch.no_grad()
def zero_shot(model, tokenizer, val_set, rank, world_size, device, batch_size=128, workers=8):
    """Each rank scores a disjoint slice of ImageNet val; counts are summed at the end."""
    model.eval()
    weights = []
    for c in IMAGENET_CLASSNAMES:
        tok = tokenizer([t(c) for t in SIMPLE_IMAGENET_TEMPLATES]).to(device)
        e = F.normalize(model.encode_text(tok), dim=-1).mean(0)
        weights.append(e / e.norm())
    classifier = torch.stack(weights, 1)

    shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=workers, pin_memory=True)
    counts = torch.zeros(3, device=device)
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        f = F.normalize(model.encode_image(images), dim=-1)
        top5 = (f @ classifier).topk(5, 1).indices
        hit = top5.eq(target[:, None])
        counts[0] += hit[:, 0].sum()
        counts[1] += hit.any(1).sum()
        counts[2] += images.shape[0]
    dist.all_reduce(counts)
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--imagenet-val", default=None)
    parser.add_argument("--model", default="RN50")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--wd", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--out", default="runs/rn50_cc3m")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    master = rank == 0
    logging.basicConfig(level=logging.INFO if master else logging.ERROR, format="[%(asctime)s] %(message)s")
    log = logging.getLogger(__name__)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)
    # the modified ResNet tower has BatchNorm; with 128 images per GPU sync the stats
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    raw = model.module

    train_set = CsvDataset(args.train_csv, preprocess_train, tokenizer)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = ImageFolder(args.imagenet_val, transform=preprocess_val) if args.imagenet_val else None

    gain_or_bias = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    params = [
        {"params": [p for n, p in raw.named_parameters() if gain_or_bias(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in raw.named_parameters() if not gain_or_bias(n, p)], "weight_decay": args.wd},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    total_steps = len(loader) * args.epochs

    def lr_at(step):
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * args.lr * (1 + math.cos(math.pi * progress))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        raw.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        log.info("resumed from %s (epoch %d)", args.resume, start_epoch)

    if master:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for it, (images, texts) in enumerate(loader):
            step = epoch * len(loader) + it
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)

            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = model(images, texts)
                loss = clip_loss(img_f, txt_f, scale, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                raw.logit_scale.clamp_(0, math.log(100))

            if it % 50 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                log.info("epoch %d [%d/%d] loss %.4f (mean over ranks) scale %.1f %.3fs/it",
                         epoch, it, len(loader), reduced.item(), scale.item(), time.time() - end)
            end = time.time()

        if val_set is not None:
            top1, top5 = zero_shot(raw, tokenizer, val_set, rank, world_size, device, workers=args.workers)
            log.info("epoch %d zero-shot top1 %.2f top5 %.2f", epoch, 100 * top1, 100 * top5)

        if master:
            torch.save({"epoch": epoch + 1, "state_dict": raw.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.out, "epoch_latest.pt.tmp"))
            os.replace(os.path.join(args.out, "epoch_latest.pt.tmp"), os.path.join(args.out, "epoch_latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
