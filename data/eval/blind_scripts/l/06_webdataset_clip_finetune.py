"""
Contrastive image-text fine-tuning (open_clip ViT-B/16) on webdataset tar shards.

Launched on 2 nodes x 8 GPUs from the k8s PyTorchJob:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29400 --rdzv_id=$JOB_ID \
        06_webdataset_clip_finetune.py \
        --train-shards "/data/cc3m-wds/cc3m-train-{0000..0331}.tar" --epochs 10
"""
import argparse
import math
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="laion2b_s34b_b88k")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="/ckpt/clip_ft")
    return p.parse_args()


def make_loader(args, preprocess, tokenizer):
    pipeline = (
        wds.WebDataset(args.train_shards, nodesplitter=wds.split_by_node,
                       shardshuffle=True, handler=wds.warn_and_continue)
        .shuffle(2000)
        .decode("pilrgb", handler=wds.warn_and_continue)
        .rename(image="jpg;png;webp", text="txt")
        .map_dict(image=preprocess, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader


def gather_features(img, txt):
    # differentiable all_gather so every rank gets gradients for its own features
    all_img = torch.cat(torch.distributed.nn.all_gather(img), dim=0)
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt), dim=0)
    return all_img, all_txt


def clip_loss(img, txt, logit_scale, rank):
    all_img, all_txt = gather_features(img, txt)
    logits_i = logit_scale * img @ all_txt.t()
    logits_t = logit_scale * txt @ all_img.t()
    n = img.size(0)
    labels = torch.arange(n, device=img.device) + rank * n
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


def cosine_lr(optim, base_lr, warmup, total):
    def _set(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        for g in optim.param_groups:
            g["lr"] = lr
        return lr
    return _set


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local_rank}"))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, preprocess, _ = open_clip.create_model_and_transforms(args.model,
                                                                pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    loader = make_loader(args, preprocess, tokenizer)
    est_steps_per_epoch = 2_900_000 // (args.batch_size * world)
    set_lr = cosine_lr(optim, args.lr, args.warmup, est_steps_per_epoch * args.epochs)

    step = 0
    for epoch in range(args.epochs):
        ddp.train()
        t0 = time.time()
        n_batches = 0
        for images, texts in loader:
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            lr = set_lr(step)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, scale = ddp(images, texts)
            loss = clip_loss(img_f.float(), txt_f.float(), scale.float(), rank)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            n_batches += 1
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} lr {lr:.2e} "
                      f"scale {scale.item():.1f} {(time.time() - t0) / n_batches:.3f}s/it",
                      flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "step": step, "state_dict": model.state_dict(),
                        "optimizer": optim.state_dict()},
                       os.path.join(args.out, f"epoch_{epoch}.pt"))
            print(f"epoch {epoch}: {n_batches} batches, {time.time() - t0:.0f}s", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
