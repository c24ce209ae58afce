"""
CLIP-style contrastive pretraining on image-text pairs stored as WebDataset shards
(LAION-style {000000..041455}.tar with .jpg/.txt).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        09_wds_clip_contrastive.py --shards "/weka/laion400m/{000000..041455}.tar" \
        --samples_per_epoch 10000000 --out /weka/exp/clip_vitb32

Shards are sampled with replacement (resampled=True) and every worker is given a
fixed number of batches per "epoch", so all ranks run exactly the same number of steps.
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
    ap.add_argument("--samples_per_epoch", type=int, required=True)
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch_size", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak lr, tuned for 32 x 256")
    ap.add_argument("--wd", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def make_loader(args, preprocess, tokenizer, world_size):
    global_bs = args.batch_size * world_size
    batches_per_epoch = math.ceil(args.samples_per_epoch / global_bs)
    # per rank: batches_per_epoch batches, spread over the workers of this rank
    per_worker = math.ceil(batches_per_epoch / max(1, args.workers))
    pipeline = (
        wds.WebDataset(args.shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(2000, initial=500)
        .decode("pilrgb", handler=wds.warn_and_continue)
        .rename(image="jpg;png;jpeg;webp", text="txt")
        .map_dict(image=preprocess, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False,
                           num_workers=args.workers, persistent_workers=True, pin_memory=True)
    loader = loader.with_epoch(per_worker * args.workers)
    return loader, per_worker * args.workers


def clip_loss(img_f, txt_f, logit_scale, rank, world_size):
    # all_gather from torch.distributed.nn keeps the autograd graph, so the
    # local features get gradients from the negatives seen by every other rank
    all_img = torch.cat(torch.distributed.nn.all_gather(img_f), dim=0)
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt_f), dim=0)
    logits_i = logit_scale * img_f @ all_txt.t()
    logits_t = logit_scale * txt_f @ all_img.t()
    n = img_f.size(0)
    labels = torch.arange(n, device=img_f.device) + rank * n
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # per-rank seed: augmentation RNGs differ across ranks; DDP broadcasts rank 0's
    # initial weights at construction, so the replicas still start identical
    torch.manual_seed(args.seed + rank)

    model, preprocess, _ = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(device)
    loader, steps_per_epoch = make_loader(args, preprocess, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    params = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in params if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in params if not exclude(n, p)], "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoints", "epoch_latest.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        sd = ck["state_dict"]
        if next(iter(sd)).startswith("module."):
            sd = {k[len("module."):]: v for k, v in sd.items()}
        model.load_state_dict(sd)
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"]

    model = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(os.path.join(args.out, "checkpoints"), exist_ok=True)
        print(f"{world_size} GPUs, global batch {args.batch_size * world_size}, "
              f"{steps_per_epoch} steps/epoch")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, logit_scale = model(images, texts)
                loss = clip_loss(img_f, txt_f, logit_scale, rank, world_size)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))

            if i % 100 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    sps = (i + 1) * args.batch_size * world_size / (time.time() - t0)
                    print(f"epoch {epoch} [{i}/{steps_per_epoch}] loss {l.item():.4f} "
                          f"scale {model.module.logit_scale.exp().item():.1f} {sps:.0f} samples/s")

        if rank == 0:
            state = {"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                     "optimizer": optimizer.state_dict()}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
