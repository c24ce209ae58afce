#!/usr/bin/env python
# ViT-B/16 ImageNet training, tuned for 8xH100 nodes.
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
#       02_vit_b16_imagenet.py --data /datasets/imagenet --output /shared/runs/vit_b16
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU, per micro step")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=5e-4, help="for a global batch of 512")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--bucket-cap-mb", type=int, default=100)
    ap.add_argument("--resume", default="")
    ap.add_argument("--log-every", type=int, default=50)
    return ap.parse_args()


class CudaPrefetcher:
    """Copies the next batch on a side stream while the current one is computed."""

    def __init__(self, loader, device):
        self.loader = loader
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        nxt = self._load(it)
        while nxt is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            x, y = nxt
            x.record_stream(torch.cuda.current_stream(self.device))
            y.record_stream(torch.cuda.current_stream(self.device))
            nxt = self._load(it)
            yield x, y

    def _load(self, it):
        try:
            x, y = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            x = x.to(self.device, non_blocking=True).float()
            x = x.sub_(self.mean).div_(self.std).contiguous(memory_format=torch.channels_last)
            y = y.to(self.device, non_blocking=True)
        return x, y


def to_uint8_tensor(img):
    return transforms.functional.pil_to_tensor(img)


@torch.compile
def smoothed_ce(logits, target, smoothing: float):
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, target.unsqueeze(1)).squeeze(1)
    return ((1.0 - smoothing) * nll - smoothing * logp.mean(dim=-1)).mean()


def cosine_lr(step, total, warmup, peak):
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # loss_sum, correct, count
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)
        stats[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        stats[1] += (logits.argmax(-1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(),
        to_uint8_tensor,
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), to_uint8_tensor])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    # strided shard without padding so every val image is counted exactly once
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    val_loader = DataLoader(val_shard, batch_size=256, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1)
    model = model.to(device, memory_format=torch.channels_last)
    compiled = torch.compile(model)
    ddp = DDP(compiled, device_ids=[local_rank], bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=True)
    ddp.register_comm_hook(state=dist.group.WORLD, hook=default_hooks.fp16_compress_hook)

    global_batch = args.batch_size * args.accum * world
    peak_lr = args.base_lr * global_batch / 512
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(("pos_embed", "cls_token")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.999), fused=True)

    steps_per_epoch = len(train_loader) // args.accum
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    start_epoch, step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]

    if is_main:
        os.makedirs(args.output, exist_ok=True)
        print(f"global batch {global_batch}, peak lr {peak_lr:.2e}, {steps_per_epoch} steps/epoch")

    prefetch = CudaPrefetcher(train_loader, device)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        start_ev.record()
        running = torch.zeros((), device=device)
        for i, (x, y) in enumerate(prefetch):
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                lr = cosine_lr(step, total_steps, warmup_steps, peak_lr)
                for g in opt.param_groups:
                    g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if last_micro:
                    loss = smoothed_ce(ddp(x), y, args.label_smoothing) / args.accum
                    loss.backward()
                else:
                    with ddp.no_sync():
                        loss = smoothed_ce(ddp(x), y, args.label_smoothing) / args.accum
                        loss.backward()
            running += loss.detach()
            if not last_micro:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                end_ev.record()
                end_ev.synchronize()
                ms = start_ev.elapsed_time(end_ev) / args.log_every
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if is_main:
                    img_s = global_batch / (ms / 1000)
                    print(f"ep {epoch} step {step} loss {running.item() / args.log_every:.4f} "
                          f"lr {lr:.2e} {ms:.1f} ms/step {img_s:,.0f} img/s")
                running.zero_()
                start_ev.record()

        val_loss, val_acc = evaluate(model, CudaPrefetcher(val_loader, device), device)
        if is_main:
            print(f"epoch {epoch}: val loss {val_loss:.4f} top1 {val_acc * 100:.2f}")
            with open(os.path.join(args.output, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc}) + "\n")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.output, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
