"""
One-shot structured (channel) pruning of a ResNet-50 with Taylor importance,
followed by distillation fine-tuning from the dense model.

Stage 1: accumulate first-order Taylor scores on a few calibration batches,
         prune globally to the target MACs ratio (torch-pruning).
Stage 2: fine-tune the pruned student with KD from the original dense network.

    torchrun --nproc_per_node=8 prune_finetune.py --data /data/imagenet \
        --dense ckpt/resnet50_dense.pth --target-speedup 2.0
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_pruning as tp
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--dense", required=True)
    p.add_argument("--target-speedup", type=float, default=2.0)
    p.add_argument("--calib-batches", type=int, default=16)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.08)
    p.add_argument("--kd-T", type=float, default=1.0)
    p.add_argument("--kd-alpha", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="/shared/exp/r50_taylor_2x")
    return p.parse_args()


def loaders(args):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    tr_s = DistributedSampler(train, shuffle=True)
    va_s = DistributedSampler(val, shuffle=False)
    tr = DataLoader(train, args.batch_size, sampler=tr_s, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    va = DataLoader(val, 100, sampler=va_s, num_workers=args.workers, pin_memory=True)
    return tr, va, tr_s


def prune_model(model, calib_loader, args, device):
    example = torch.randn(1, 3, 224, 224, device=device)
    base_macs, base_params = tp.utils.count_ops_and_params(model, example)
    imp = tp.importance.TaylorImportance()
    pruner = tp.pruner.MetaPruner(
        model, example, importance=imp,
        pruning_ratio=0.5, global_pruning=True,
        max_pruning_ratio=0.8, iterative_steps=10,
        ignored_layers=[model.fc],
    )
    model.train()
    model.zero_grad()
    for i, (x, y) in enumerate(calib_loader):
        if i >= args.calib_batches:
            break
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
    macs = base_macs
    while base_macs / macs < args.target_speedup:
        pruner.step()
        macs, params = tp.utils.count_ops_and_params(model, example)
        if pruner.current_step == pruner.iterative_steps:
            break
    model.zero_grad()
    return model, base_macs, macs, base_params, params


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    train_loader, val_loader, train_sampler = loaders(args)

    dense = torchvision.models.resnet50()
    dense.load_state_dict(torch.load(args.dense, map_location="cpu"))
    dense = dense.to(device)
    teacher = copy.deepcopy(dense).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student, m0, m1, p0, p1 = prune_model(dense, train_loader, args, device)
    if rank == 0:
        print(f"MACs {m0 / 1e9:.2f}G -> {m1 / 1e9:.2f}G ({m0 / m1:.2f}x), "
              f"params {p0 / 1e6:.1f}M -> {p1 / 1e6:.1f}M", flush=True)
        os.makedirs(args.out, exist_ok=True)

    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    student = DDP(student, device_ids=[local_rank])

    opt = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
                ce = F.cross_entropy(s_logits, y)
                kd = F.kl_div(F.log_softmax(s_logits.float() / args.kd_T, 1),
                              F.softmax(t_logits.float() / args.kd_T, 1),
                              reduction="batchmean") * args.kd_T ** 2
                loss = (1 - args.kd_alpha) * ce + args.kd_alpha * kd
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it} ce {ce.item():.3f} kd {kd.item():.3f}", flush=True)

        top1 = evaluate(student, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {top1:.2f} time {time.time() - t0:.0f}s", flush=True)
            # torch-pruning changes the architecture: save the whole module
            model_cpu = copy.deepcopy(student.module).cpu()
            torch.save({"epoch": epoch, "model": model_cpu, "top1": top1},
                       os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(model_cpu, os.path.join(args.out, "best_pruned_full.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
