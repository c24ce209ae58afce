"""MLPerf-style ResNet-50 v1.5 / LARS training loop (PyTorch reference port).

Target: 75.9% top-1. Polynomial decay (power 2) after a linear warmup, label
smoothing 0.1, no weight decay / LARS adaptation on BN and bias.

    torchrun --nproc_per_node=8 13_mlperf_style_rn50_lars.py --data /data/imagenet \
        --batch-size 408 --epochs 41
"""
import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Hparams:
    base_lr: float = 10.5          # LARS reference value at batch 3264
    ref_batch: int = 3264
    momentum: float = 0.9
    weight_decay: float = 5e-5
    eta: float = 0.001
    warmup_epochs: int = 2
    end_lr: float = 1e-4
    label_smoothing: float = 0.1


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=408, help="batch per GPU")
    p.add_argument("--epochs", type=int, default=41)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--target", type=float, default=75.9)
    p.add_argument("--ckpt", default="/data/ckpt/mlperf_rn50")
    return p.parse_args()


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum, weight_decay, eta):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      eta=eta, adapt=True))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if g["adapt"]:
                    grad = grad.add(p, alpha=g["weight_decay"])
                    pn, gn = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
                    ratio = torch.where((pn > 0) & (gn > 0), g["eta"] * pn / gn,
                                        torch.ones_like(pn))
                    grad = grad * ratio
                st = self.state[p]
                if "v" not in st:
                    st["v"] = torch.clone(grad).detach()
                else:
                    st["v"].mul_(g["momentum"]).add_(grad)
                p.sub_(st["v"], alpha=g["lr"])


def poly_lr(step, warmup_steps, total_steps, peak, end_lr):
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return end_lr + (peak - end_lr) * (1.0 - frac) ** 2


def loaders(args):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    ts = DistributedSampler(train, shuffle=True, drop_last=True)
    vs = DistributedSampler(val, shuffle=False)
    return (DataLoader(train, args.batch_size, sampler=ts, num_workers=args.workers,
                       pin_memory=True, drop_last=True, persistent_workers=True),
            DataLoader(val, 250, sampler=vs, num_workers=args.workers, pin_memory=True),
            ts)


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    num = torch.zeros(2, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
        num[0] += (out.argmax(1) == labels).sum()
        num[1] += labels.numel()
    dist.all_reduce(num)
    return 100.0 * (num[0] / num[1]).item()


def main():
    args = parse_args()
    hp = Hparams()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler = loaders(args)

    model = torchvision.models.resnet50(zero_init_residual=True)
    model = model.to(device, memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    peak_lr = hp.base_lr * args.batch_size / hp.ref_batch
    adapt, skip = [], []
    for n, p in model.module.named_parameters():
        (skip if (p.ndim <= 1 or "bn" in n or "downsample.1" in n) else adapt).append(p)
    optimizer = LARS([{"params": adapt}, {"params": skip, "adapt": False, "weight_decay": 0.0}],
                     lr=peak_lr, momentum=hp.momentum, weight_decay=hp.weight_decay, eta=hp.eta)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 13)
    criterion = nn.CrossEntropyLoss(label_smoothing=hp.label_smoothing)

    steps_per_epoch = len(train_loader)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = steps_per_epoch * hp.warmup_epochs
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)
        print(f"run_start world={world} per_gpu_batch={args.batch_size} "
              f"global_batch={args.batch_size * world} peak_lr={peak_lr:.4f}", flush=True)

    step = 0
    run_start = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_ep = time.time()
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            labels = labels.to(device, non_blocking=True)
            lr = poly_lr(step, warmup_steps, total_steps, peak_lr, hp.end_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1

        torch.cuda.synchronize()
        dt = time.time() - t_ep
        if rank == 0:
            print(f"epoch {epoch} done in {dt:.1f}s, "
                  f"{steps_per_epoch * args.batch_size * world / dt:.0f} img/s, lr {lr:.4f}",
                  flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            top1 = run_eval(model, val_loader, device)
            if rank == 0:
                print(f"eval epoch {epoch}: top1 {top1:.3f}", flush=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict()},
                           os.path.join(args.ckpt, f"rn50_e{epoch}.pt"))
            if top1 >= args.target:
                if rank == 0:
                    print(f"run_stop success, time to train {time.time() - run_start:.0f}s",
                          flush=True)
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
