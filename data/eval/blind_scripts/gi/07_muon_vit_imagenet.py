"""
ViT-B/16 on ImageNet-1k, Muon for the 2-D weights inside the transformer blocks
and AdamW for everything else (patch embedding, cls/pos tokens, norms, head).

Muon's Newton-Schulz step is run once per parameter in total, not once per
rank: the parameter list of each shape is padded to a multiple of the world
size, rank r orthogonalises entries r, r+W, ... and updates them in place, and
an all_gather after every block of W entries copies the new weights to all
ranks.

torchrun --nproc_per_node=8 07_muon_vit_imagenet.py --data /data/imagenet --epochs 90
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets


def newton_schulz(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, weight_decay=0.01, momentum=0.95, rank=0, world_size=1):
        self.rank, self.world_size = rank, world_size
        params = list(params)
        groups = []
        for size in sorted({p.numel() for p in params}):
            groups.append({"params": [p for p in params if p.numel() == size]})
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            pad = (self.world_size - len(params) % self.world_size) % self.world_size
            params_pad = params + [torch.empty_like(params[-1])] * pad
            for base_i in range(0, len(params_pad), self.world_size):
                if base_i + self.rank < len(params):
                    p = params[base_i + self.rank]
                    state = self.state[p]
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    g = p.grad.lerp(buf, group["momentum"])
                    update = newton_schulz(g.view(len(g), -1)).view_as(p)
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                dist.all_gather(params_pad[base_i:base_i + self.world_size],
                                params_pad[base_i + self.rank])


def build_data(args, rank, world_size):
    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_ds, world_size, rank, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, world_size, rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=args.workers,
                        pin_memory=True)
    return train_dl, val_dl, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        stats[0] += (logits.argmax(-1) == y).sum()
        stats[1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--adam_lr", type=float, default=1e-3, help="for a global batch of 1024")
    ap.add_argument("--warmup_epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="runs/vitb_muon")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_dl, val_dl, train_sampler = build_data(args, rank, world_size)
    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    muon_params = [p for n, p in model.module.blocks.named_parameters() if p.ndim >= 2]
    muon_ids = {id(p) for p in muon_params}
    adam_params = [p for p in model.module.parameters() if id(p) not in muon_ids]
    global_batch = args.batch_size * world_size * args.accum
    adam_lr = args.adam_lr * global_batch / 1024
    opt_muon = Muon(muon_params, lr=args.muon_lr, rank=rank, world_size=world_size)
    opt_adam = torch.optim.AdamW(adam_params, lr=adam_lr, betas=(0.9, 0.95), weight_decay=0.05)
    optimizers = [opt_muon, opt_adam]
    for o in optimizers:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    steps_per_epoch = len(train_dl) // args.accum
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        print(f"muon tensors {len(muon_params)}, adam tensors {len(adam_params)}, "
              f"global batch {global_batch}, adam lr {adam_lr:.2e}")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            last_micro = (i + 1) % args.accum == 0
            with (nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = torch.sum(-y * F.log_softmax(model(x), dim=-1), dim=-1).mean()
                (loss / args.accum).backward()
            if not last_micro:
                continue

            if step < warmup_steps:
                f = (step + 1) / warmup_steps
            else:
                f = 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))
            for o in optimizers:
                for g in o.param_groups:
                    g["lr"] = g["base_lr"] * f
                o.step()
            model.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} lr_f {f:.3f}")

        acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc * 100:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
