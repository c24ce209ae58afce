"""CLIP RN50 from scratch on LAION-style webdataset shards.

* shards are sampled with replacement per rank (resampled=True) and each rank
  runs a fixed number of batches per "epoch" (with_epoch), so all ranks always
  do the same number of steps
* BatchNorm in the ResNet tower is converted to SyncBatchNorm
* DDP model is compiled with torch.compile

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        17_clip_rn50_wds_resampled.py --train-shards '/fsx/laion/{00000..41407}.tar' \
        --val-shards '/fsx/laion_val/{00000..00015}.tar' --train-num-samples 135000000 --out /fsx/runs/rn50
"""
import argparse
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP


def build_train_loader(args, transform, tokenizer, world_size):
    global_batch = args.batch_size * world_size
    batches_per_rank = args.train_num_samples // global_batch
    # per worker, so that num_workers * per-worker batches == batches_per_rank
    batches_per_worker = math.ceil(batches_per_rank / args.workers)
    pipeline = (
        wds.WebDataset(args.train_shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(2000, initial=500)
        .decode("pilrgb", handler=wds.warn_and_continue)
        .rename(image="jpg;png;jpeg;webp", text="txt")
        .map_dict(image=transform, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(args.batch_size, partial=False)
        .with_epoch(batches_per_worker)
    )
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader, batches_per_worker * args.workers


def build_val_loader(args, transform, tokenizer):
    pipeline = (
        wds.WebDataset(args.val_shards, nodesplitter=wds.split_by_node, shardshuffle=False)
        .decode("pilrgb")
        .rename(image="jpg;png;jpeg;webp", text="txt")
        .map_dict(image=transform, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(256, partial=True)
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=2)


def clip_loss(img, txt, logit_scale, rank):
    all_img = torch.cat(torch.distributed.nn.all_gather(img), 0)
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt), 0)
    n = img.shape[0]
    labels = torch.arange(n, device=img.device) + rank * n
    return 0.5 * (F.cross_entropy(logit_scale * img @ all_txt.t(), labels) +
                  F.cross_entropy(logit_scale * txt @ all_img.t(), labels))


@torch.no_grad()
def local_batch_accuracy(raw_model, loader, device):
    """Mean in-batch image->text top-1.  Ranks may see different numbers of val
    batches; this loop runs no collectives (it calls the unwrapped model) and
    there is a single all_reduce at the end."""
    raw_model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for images, texts in loader:
        images, texts = images.to(device), texts.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img = raw_model.encode_image(images, normalize=True)
            txt = raw_model.encode_text(texts, normalize=True)
        pred = (img.float() @ txt.float().t()).argmax(1)
        stats[0] += (pred == torch.arange(len(pred), device=device)).sum()
        stats[1] += len(pred)
    dist.all_reduce(stats)
    raw_model.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-shards", required=True)
    ap.add_argument("--val-shards", required=True)
    ap.add_argument("--train-num-samples", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1 + rank)

    raw, tf_train, tf_val = open_clip.create_model_and_transforms("RN50", pretrained=None)
    tokenizer = open_clip.get_tokenizer("RN50")
    raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw).to(device)
    ddp = DDP(raw, device_ids=[local_rank])
    model = torch.compile(ddp)

    train_loader, steps_per_epoch = build_train_loader(args, tf_train, tokenizer, world_size)
    val_loader = build_val_loader(args, tf_val, tokenizer)
    total_steps = steps_per_epoch * args.epochs

    no_wd = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in raw.named_parameters() if no_wd(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in raw.named_parameters() if not no_wd(n, p)], "weight_decay": args.wd},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    latest = os.path.join(args.out, "latest.pt")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        raw.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{steps_per_epoch} steps/epoch/rank, global batch {args.batch_size * world_size}")

    for epoch in range(start_epoch, args.epochs):
        tic = time.time()
        for i, (images, texts) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * \
                0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
            for g in optimizer.param_groups:
                g["lr"] = lr
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
            loss = clip_loss(img.float(), txt.float(), scale.float(), rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                raw.logit_scale.clamp_(0, math.log(100))
            if i % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} {i}/{steps_per_epoch} loss {l.item():.4f} lr {lr:.2e} "
                          f"{(i + 1) * args.batch_size * world_size / (time.time() - tic):.0f} img/s", flush=True)

        acc = local_batch_accuracy(raw, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val in-batch i2t acc {acc:.4f}")
            torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1}, latest + ".tmp")
            os.replace(latest + ".tmp", latest)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
