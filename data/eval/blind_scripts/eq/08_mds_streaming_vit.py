"""
ViT-B/16 training on an MDS dataset (mosaicml-streaming) read from object storage.

    torchrun --nproc_per_node=8 08_mds_streaming_vit.py \
        --remote s3://ml-datasets/imagenet21k-mds --local /local_nvme/mds_cache \
        --ckpt_dir /fsx/ckpt/vit_b16_in21k

StreamingDataset partitions samples over ranks and dataloader workers by itself,
so there is no DistributedSampler here.
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from streaming import StreamingDataLoader, StreamingDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--val_remote", default=None)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--num_classes", type=int, default=10450)
    p.add_argument("--batch_size", type=int, default=128, help="per GPU")
    p.add_argument("--blr", type=float, default=1e-3, help="lr per 1024 images")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--total_steps", type=int, default=300_000)
    p.add_argument("--warmup_steps", type=int, default=10_000)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ImageTransform:
    def __init__(self, train):
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
                                 T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
        else:
            self.tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                                 T.Normalize((0.5,) * 3, (0.5,) * 3)])

    def __call__(self, img):
        return self.tf(img.convert("RGB"))


class MDSImages(StreamingDataset):
    def __init__(self, transform, **kw):
        super().__init__(**kw)
        self.transform = transform

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)
        return self.transform(sample["image"]), sample["label"]


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds = MDSImages(ImageTransform(True), remote=args.remote, local=args.local, split="train",
                         shuffle=True, shuffle_seed=args.seed, batch_size=args.batch_size,
                         predownload=8 * args.batch_size)
    train_loader = StreamingDataLoader(train_ds, batch_size=args.batch_size, num_workers=args.workers,
                                       pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = None
    if args.val_remote:
        val_ds = MDSImages(ImageTransform(False), remote=args.val_remote,
                           local=os.path.join(args.local, "val"), split="val",
                           shuffle=False, batch_size=256)
        val_loader = StreamingDataLoader(val_ds, batch_size=256, num_workers=4)

    model = timm.create_model(args.model, num_classes=args.num_classes, drop_path_rate=0.1).to(device)
    eff_bs = args.batch_size * world
    lr = args.blr * eff_bs / 1024
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n in ("cls_token", "pos_embed") else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.total_steps))

    step = 0
    latest = os.path.join(args.ckpt_dir, "latest.pt")
    if os.path.exists(latest):
        state = torch.load(latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        train_loader.load_state_dict(state["dataloader"])
        step = state["step"]
        if rank == 0:
            print(f"resuming from step {step}")

    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None

    model.train()
    t0 = time.time()
    while step < args.total_steps:
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    ips = 50 * eff_bs / (time.time() - t0)
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                    writer.add_scalar("train/img_per_s", ips, step)
                    t0 = time.time()

            if step % args.save_every == 0 or step == args.total_steps:
                if val_loader is not None:
                    acc = validate(model.module, val_loader, device)
                    if rank == 0:
                        writer.add_scalar("val/top1", acc, step)
                # dataloader state is global in streaming (samples seen by all ranks)
                dl_state = train_loader.state_dict()
                if rank == 0:
                    os.makedirs(args.ckpt_dir, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "dataloader": dl_state,
                                "step": step}, latest + ".tmp")
                    os.replace(latest + ".tmp", latest)
                dist.barrier()

            if step >= args.total_steps:
                break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
