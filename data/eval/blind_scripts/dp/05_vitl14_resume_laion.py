"""Long-running ViT-L/14 CLIP run on LAION-2B-en shards, resumable.

Submitted through slurm as one torchrun per node:
    srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 \
        --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29400 \
        05_vitl14_resume_laion.py --resume latest
"""
import argparse
import glob
import logging
import math
import os
import re
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import open_clip

log = logging.getLogger("train")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", default="/lustre/laion2b-en/{000000..231349}.tar")
    p.add_argument("--samples-per-epoch", type=int, default=200_000_000)
    p.add_argument("--model", default="ViT-L-14")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=13000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt-dir", default="/lustre/exp/clip_vitl14/checkpoints")
    p.add_argument("--resume", default=None, help="path, or 'latest'")
    p.add_argument("--log-interval", type=int, default=50)
    return p.parse_args()


def latest_checkpoint(ckpt_dir):
    files = glob.glob(os.path.join(ckpt_dir, "epoch_*.pt"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.search(r"epoch_(\d+)\.pt", f).group(1)))


def gather_with_grad(x):
    return torch.cat(torch.distributed.nn.all_gather(x), dim=0)


def clip_loss(img, txt, logit_scale, rank):
    all_img = gather_with_grad(img)
    all_txt = gather_with_grad(txt)
    logits_i = logit_scale * img @ all_txt.T
    logits_t = logit_scale * txt @ all_img.T
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels)) / 2


def make_loader(args, preprocess, tokenizer, world_size):
    shards = list(braceexpand.braceexpand(args.train_data))
    n_batches = math.ceil(args.samples_per_epoch / (args.batch_size * world_size))
    n_worker_batches = math.ceil(n_batches / args.workers)
    ds = wds.DataPipeline(
        wds.ResampledShards(shards),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=10000, initial=2000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(n_worker_batches)
    loader = wds.WebLoader(ds, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=True, pin_memory=True)
    return loader, n_worker_batches * args.workers


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    model, preprocess_train, _ = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, args.beta2), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, step = 0, 0
    resume = latest_checkpoint(args.ckpt_dir) if args.resume == "latest" else args.resume
    if resume is not None:
        checkpoint = torch.load(resume)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"]
        step = checkpoint["step"]
        log.info("resumed %s at epoch %d step %d", resume, start_epoch, step)
        del checkpoint

    ddp = DDP(model, device_ids=[local_rank])
    loader, steps_per_epoch = make_loader(args, preprocess_train, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (s - args.warmup) / (total_steps - args.warmup)))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        ddp.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            lr = lr_at(step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = ddp(images, texts)
            loss = clip_loss(img_f.float(), txt_f.float(), scale, rank)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if i % args.log_interval == 0:
                log.info("epoch %d %d/%d loss %.4f gnorm %.2f scale %.1f lr %.3e %.2f it/s",
                         epoch, i, steps_per_epoch, loss.item(), gnorm.item(), scale.item(), lr,
                         (i + 1) / (time.time() - t0))

        if rank == 0:
            path = os.path.join(args.ckpt_dir, f"epoch_{epoch + 1}.pt")
            torch.save({"epoch": epoch + 1, "step": step, "name": args.model,
                        "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict()}, path + ".tmp")
            os.replace(path + ".tmp", path)
            log.info("saved %s", path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
