"""Scaling-law sweep point: CLIP on a LAION-400M subset, with held-out shards for val loss.

    torchrun --nproc_per_node=8 11_laion_subset_holdout.py --shards "/data/laion400m/{00000..02047}.tar" \
        --model ViT-B-32 --samples-seen 400000000 --out /nfs/sweeps/b32_400m
"""
import argparse
import json
import math
import os
import random
import time

import braceexpand
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import open_clip


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--val-shards", type=int, default=16, help="number of shards held out for val loss")
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--samples-seen", type=int, default=400_000_000)
    p.add_argument("--checkpoints", type=int, default=20, help="how many times to eval/save over the run")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=5000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val-batches", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p.parse_args()


def contrastive(img, txt, scale):
    img_all = torch.cat(dist_nn.all_gather(img))
    txt_all = torch.cat(dist_nn.all_gather(txt))
    logits = scale * img_all @ txt_all.T
    y = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y))


def make_pipeline(urls, preprocess, tokenizer, batch_size, resampled):
    if resampled:
        stages = [wds.ResampledShards(urls), wds.tarfile_to_samples(handler=wds.warn_and_continue),
                  wds.shuffle(5000, initial=1000)]
    else:
        stages = [wds.SimpleShardList(urls), wds.split_by_worker,
                  wds.tarfile_to_samples(handler=wds.warn_and_continue)]
    stages += [
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(batch_size, partial=False),
    ]
    return wds.DataPipeline(*stages)


@torch.no_grad()
def val_loss(model, loader, device, max_batches):
    model.eval()
    tot = torch.zeros(2, device=device)
    for b, (images, texts) in enumerate(loader):
        if b >= max_batches:
            break
        with torch.autocast("cuda"):
            img, txt, scale = model(images.to(device), texts.to(device))
        logits = scale * img.float() @ txt.float().T
        y = torch.arange(len(logits), device=device)
        tot[0] += 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y))
        tot[1] += 1
    model.train()
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation / dropout streams per rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    shards = list(braceexpand.braceexpand(args.shards))
    random.shuffle(shards)
    val_urls, train_urls = shards[: args.val_shards], shards[args.val_shards:]
    my_val_urls = val_urls[rank::world]

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    ddp = DDP(model, device_ids=[local_rank])

    global_batch = args.batch_size * world
    total_steps = args.samples_seen // global_batch
    interval = total_steps // args.checkpoints
    per_worker = math.ceil(interval / args.workers)

    train_ds = make_pipeline(train_urls, preprocess_train, tokenizer, args.batch_size, resampled=True)
    train_ds = train_ds.with_epoch(per_worker)
    train_loader = wds.WebLoader(train_ds, batch_size=None, num_workers=args.workers, persistent_workers=True)
    val_ds = make_pipeline(my_val_urls, preprocess_val, tokenizer, 256, resampled=False)
    val_loader = wds.WebLoader(val_ds, batch_size=None, num_workers=2)

    opt = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n], "weight_decay": 0.0},
         {"params": [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n],
          "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (s - args.warmup) / max(1, total_steps - args.warmup)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump(vars(args) | {"world": world, "total_steps": total_steps},
                  open(os.path.join(args.out, "args.json"), "w"), indent=2)

    step = 0
    for chunk in range(args.checkpoints):
        tic = time.time()
        for images, texts in train_loader:
            lr = lr_at(step)
            for g in opt.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp(images, texts)
                loss = contrastive(img, txt, scale)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step}/{total_steps} loss {loss.item():.4f} lr {lr:.2e} "
                      f"{100 * global_batch / (time.time() - tic):.0f} samples/s", flush=True)
                tic = time.time()

        vl = val_loss(model, val_loader, device, args.val_batches)
        if rank == 0:
            print(f"[chunk {chunk}] step {step} samples {step * global_batch} val_loss {vl:.4f}", flush=True)
            with open(os.path.join(args.out, "val.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "samples": step * global_batch, "val_loss": vl}) + "\n")
            torch.save({"step": step, "state_dict": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
