"""CLIP pretraining from webdataset tar shards (img2dataset output: {jpg, txt, json}).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        09_clip_webdataset_shards.py --shards '/lustre/cc12m/{00000..01242}.tar' \
        --val-shards '/lustre/cc12m_val/{00000..00007}.tar' --out /lustre/runs/clip_cc12m
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--val-shards", required=True)
    ap.add_argument("--num-samples", type=int, default=10_968_539, help="samples in the training shards")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def make_loader(urls, transform, tokenizer, batch_size, workers, train=True):
    pipeline = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=train,
                              handler=wds.warn_and_continue)
    if train:
        pipeline = pipeline.shuffle(5000)
    pipeline = (pipeline
                .decode("pilrgb", handler=wds.warn_and_continue)
                .to_tuple("jpg;png;webp", "txt")
                .map_tuple(transform, lambda t: tokenizer([t])[0])
                .batched(batch_size, partial=not train))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers, pin_memory=True,
                           persistent_workers=train)
    return loader


def contrastive_loss(img, txt, scale, rank):
    all_img = torch.cat(torch.distributed.nn.all_gather(img))
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt))
    n = img.size(0)
    target = torch.arange(rank * n, (rank + 1) * n, device=img.device)
    li = F.cross_entropy(scale * img @ all_txt.t(), target)
    lt = F.cross_entropy(scale * txt @ all_img.t(), target)
    return (li + lt) / 2


@torch.no_grad()
def val_loss(model, loader, device):
    model.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for images, texts in loader:
        images, texts = images.to(device), texts.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i, t, s = model.module(images, texts)
            logits = s * i @ t.t()
            labels = torch.arange(len(images), device=device)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        total += loss.float() * len(images)
        count += len(images)
    dist.all_reduce(total)
    dist.all_reduce(count)
    model.train()
    return (total / count).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model, tf_train, tf_val = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_loader = make_loader(args.shards, tf_train, tokenizer, args.batch_size, args.workers, train=True)
    val_loader = make_loader(args.val_shards, tf_val, tokenizer, 128, 4, train=False)

    steps_per_epoch = args.num_samples // (args.batch_size * world)
    total_steps = steps_per_epoch * args.epochs
    params = [p for p in model.parameters() if p.requires_grad]
    gain_or_bias = [p for p in params if p.ndim < 2]
    rest = [p for p in params if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": gain_or_bias, "weight_decay": 0.0},
                                   {"params": rest, "weight_decay": args.wd}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / max(1, total_steps - args.warmup)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} ranks, ~{steps_per_epoch} steps/epoch, {total_steps} total")

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for images, texts in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_f, txt_f, scale = model(images, texts)
                loss = contrastive_loss(img_f, txt_f, scale, rank)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if step % 100 == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    sps = 100 * args.batch_size * world / (time.time() - t0)
                    print(f"ep {epoch} step {step} loss {loss_avg.item():.4f} scale {scale.item():.1f} "
                          f"lr {lr_at(step):.2e} {sps:.0f} samples/s", flush=True)
                t0 = time.time()

        vl = val_loss(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} done at step {step}, val loss {vl:.4f}")
            torch.save({"epoch": epoch + 1, "step": step, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
