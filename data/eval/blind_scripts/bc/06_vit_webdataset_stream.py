"""ViT training streamed from webdataset tar shards in the object store.

    torchrun --nnodes=4 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=vit-$SLURM_JOB_ID \
        train_vit_wds.py --train-shards 'pipe:aws s3 cp s3://corpora/img21k/train-{000000..009999}.tar -' ...
"""
import argparse
import contextlib
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
import wandb
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--samples-per-epoch", type=int, default=12_800_000)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--num-classes", type=int, default=21841)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro step")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--base-lr", type=float, default=1e-3, help="for a global batch of 1024")
    p.add_argument("--warmup-epochs", type=float, default=2)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--wandb-project", default="vit-pretrain")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_train_loader(args, world):
    tf = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
                    T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    global_batch = args.batch_size * world
    # Every rank gets exactly the same number of batches per epoch: shards are resampled
    # with replacement per worker, so the stream never runs dry on one rank before another.
    num_batches = args.samples_per_epoch // global_batch
    num_worker_batches = num_batches // args.workers
    num_batches = num_worker_batches * args.workers
    dataset = (
        wds.WebDataset(args.train_shards, resampled=True, handler=wds.warn_and_continue)
        .shuffle(10_000)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg;png;jpeg", "cls")
        .map_tuple(tf, int)
        .batched(args.batch_size, partial=False)
        .with_epoch(num_worker_batches)
    )
    loader = wds.WebLoader(dataset, batch_size=None, shuffle=False, num_workers=args.workers,
                           pin_memory=True, persistent_workers=True)
    return loader, num_batches


def make_val_loader(args, rank, world):
    tf = T.Compose([T.Resize(248, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                    T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = ImageFolder(args.val_dir, tf)
    shard = Subset(ds, range(rank, len(ds), world))
    return DataLoader(shard, batch_size=128, num_workers=4, pin_memory=True)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        s[0] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        s[1] += (logits.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (100.0 * s[1] / s[2]).item()


def load_state(path, net, optimizer):
    ckpt = torch.load(path, map_location="cpu")
    # runs started before the DDP port saved nn.DataParallel weights
    model_sd = {k.removeprefix("module."): v for k, v in ckpt["model"].items()}
    net.load_state_dict(model_sd)
    if "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt.get("epoch", -1) + 1, ckpt.get("wandb_id")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_loader, batches_per_epoch = make_train_loader(args, world)
    val_loader = make_val_loader(args, rank, world)
    steps_per_epoch = batches_per_epoch // args.accum

    net = timm.create_model(args.model, num_classes=args.num_classes, drop_path_rate=0.1).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.base_lr, weight_decay=args.wd,
                                  betas=(0.9, 0.999))
    ckpt_path = os.path.join(args.out_dir, "last.pt")
    start_epoch, wandb_id = 0, None
    if os.path.exists(ckpt_path):
        start_epoch, wandb_id = load_state(ckpt_path, net, optimizer)
    model = DDP(net, device_ids=[local_rank])

    global_batch = args.batch_size * args.accum * world
    peak_lr = args.base_lr * global_batch / 1024
    warmup = int(args.warmup_epochs * steps_per_epoch)
    total = args.epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup:
            return peak_lr * (step + 1) / warmup
        return 0.5 * peak_lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        run = wandb.init(project=args.wandb_project, id=wandb_id, resume="allow", config=vars(args))
        wandb_id = run.id

    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(model(x), y) / args.accum
                loss.backward()
            if not sync_now:
                continue
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 200 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": lr_at(step),
                               "img_per_s": global_batch * 200 / (time.time() - t0)}, step=step)
                    t0 = time.time()

        val_loss, top1 = evaluate(net, val_loader, device)
        if rank == 0:
            wandb.log({"val/loss": val_loss, "val/top1": top1, "epoch": epoch}, step=step)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "wandb_id": wandb_id, "world_size": world}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
