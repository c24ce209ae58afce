"""CLIP RN50 pre-training, one process per GPU started with torch.multiprocessing.spawn.

    # single node, 8 GPUs
    python 08_clip_rn50_spawn.py --gpus 8 --train-csv /data/cc3m/train.csv --root /data/cc3m
    # two nodes
    python 08_clip_rn50_spawn.py --nodes 2 --node-rank 0 --master-addr 10.0.0.1 --gpus 8 ...
"""
import argparse
import datetime
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

import open_clip


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29512)
    p.add_argument("--train-csv", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--imagenet-val", default=None)
    p.add_argument("--classnames", default=None)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="/nfs/exp/clip_rn50")
    p.add_argument("--resume", default=None)
    return p


class CsvImageText(Dataset):
    def __init__(self, csv_path, root, transform, tokenizer):
        df = pd.read_csv(csv_path, sep="\t" if csv_path.endswith(".tsv") else ",")
        self.paths = df["filepath"].tolist()
        self.titles = df["title"].astype(str).tolist()
        self.root = root
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        image = Image.open(os.path.join(self.root, self.paths[idx])).convert("RGB")
        return self.transform(image), self.tokenizer([self.titles[idx]])[0]


def clip_loss(img, txt, scale, rank, world_size):
    gathered_img = [torch.zeros_like(img) for _ in range(world_size)]
    gathered_txt = [torch.zeros_like(txt) for _ in range(world_size)]
    dist.all_gather(gathered_img, img)
    dist.all_gather(gathered_txt, txt)
    gathered_img[rank] = img
    gathered_txt[rank] = txt
    all_img, all_txt = torch.cat(gathered_img), torch.cat(gathered_txt)
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@torch.no_grad()
def zeroshot_top1(model, tokenizer, classnames, loader, device):
    # model is the bare module: BN layers use running statistics in eval mode, so this
    # needs no communication and can run on a single rank
    model.eval()
    tokens = tokenizer([f"a photo of a {c}." for c in classnames]).to(device)
    with torch.autocast("cuda", dtype=torch.float16):
        cls_w = F.normalize(model.encode_text(tokens).float(), dim=-1)
    correct = total = 0
    for images, target in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats = F.normalize(model.encode_image(images.to(device)).float(), dim=-1)
        correct += (feats @ cls_w.t()).argmax(1).eq(target.to(device)).sum().item()
        total += target.numel()
    model.train()
    return correct / max(total, 1)


def worker(local_rank, args):
    rank = args.node_rank * args.gpus + local_rank
    world_size = args.nodes * args.gpus
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=60))
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model, train_tf, val_tf = open_clip.create_model_and_transforms("RN50")
    tokenizer = open_clip.get_tokenizer("RN50")
    # per-GPU batches are small for BN statistics, so synchronise BN across all ranks
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    start_epoch = 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"]
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    dataset = CsvImageText(args.train_csv, args.root, train_tf, tokenizer)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    decay = [p for n, p in model.named_parameters() if not exclude(n, p)]
    no_decay = [p for n, p in model.named_parameters() if exclude(n, p)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        del ckpt
    total_steps = args.epochs * len(loader)

    val_loader, classnames = None, None
    if rank == 0 and args.imagenet_val:
        val_full = ImageFolder(args.imagenet_val, transform=val_tf)
        val_loader = DataLoader(Subset(val_full, range(0, len(val_full), 5)), batch_size=256,
                                num_workers=args.workers)
        with open(args.classnames) as f:
            classnames = [line.strip() for line in f]
        os.makedirs(args.out, exist_ok=True)

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (images, texts) in enumerate(loader):
            if step < args.warmup:
                lr = args.lr * (step + 1) / args.warmup
            else:
                lr = 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
                loss = clip_loss(img, txt, scale, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}] {i}/{len(loader)} loss={loss.item():.4f} scale={scale.item():.1f} "
                      f"lr={lr:.2e} {(time.time() - tic) / (i + 1):.3f}s/it", flush=True)

        if rank == 0:
            if val_loader is not None:
                top1 = zeroshot_top1(model.module, tokenizer, classnames, val_loader, device)
                print(f"epoch {epoch}: zero-shot top1 (10k val subset) {top1:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.gpus, join=True)
