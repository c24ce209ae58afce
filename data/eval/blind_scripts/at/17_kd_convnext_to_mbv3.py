"""
Logit distillation ConvNeXt-Tiny -> MobileNetV3-Large on ImageNet with
decoupled KD (DKD, Zhao et al. 2022). Teacher and student accuracies are
reported alongside throughput of the student at batch 1 / 64.

    torchrun --nproc_per_node=8 dkd_mbv3.py --data /data/imagenet --epochs 120
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.8)
    p.add_argument("--wd", type=float, default=4e-5)
    p.add_argument("--alpha", type=float, default=1.0, help="TCKD weight")
    p.add_argument("--beta", type=float, default=2.0, help="NCKD weight")
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=20, help="epochs of linear DKD warm-up")
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="/shared/dkd/convnext_t_mbv3l")
    return p.parse_args()


def dkd_loss(s, t, y, alpha, beta, T):
    gt = F.one_hot(y, s.size(1)).bool()
    ps, pt = F.softmax(s / T, 1), F.softmax(t / T, 1)
    # binary (target vs non-target) distributions
    bs = torch.stack([(ps * gt).sum(1), (ps * ~gt).sum(1)], 1).clamp_min(1e-8)
    bt = torch.stack([(pt * gt).sum(1), (pt * ~gt).sum(1)], 1).clamp_min(1e-8)
    tckd = (bt * (bt.log() - bs.log())).sum(1).mean() * T ** 2
    # distributions over non-target classes only
    ls_nt = F.log_softmax(s / T - 1000.0 * gt, 1)
    pt_nt = F.softmax(t / T - 1000.0 * gt, 1)
    nckd = F.kl_div(ls_nt, pt_nt, reduction="batchmean") * T ** 2
    return alpha * tckd + beta * nckd


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        acc[0] += (top5[:, 0] == y).sum()
        acc[1] += (top5 == y[:, None]).any(1).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[2]).item(), (100 * acc[1] / acc[2]).item()


@torch.no_grad()
def throughput(model, device, bs):
    model.eval()
    x = torch.randn(bs, 3, 224, 224, device=device)
    for _ in range(10):
        model(x)
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(30):
        model(x)
    torch.cuda.synchronize()
    return 30 * bs / (time.time() - t0)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(
        os.path.join(args.data, "val"),
        T.Compose([T.Resize(232), T.CenterCrop(224), T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, 250, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    teacher = torchvision.models.convnext_tiny(weights="IMAGENET1K_V1").to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if rank == 0:
        t1, t5 = evaluate(teacher, val_loader, device)
        print(f"teacher ConvNeXt-T: top1 {t1:.2f} top5 {t5:.2f}", flush=True)

    student = torchvision.models.mobilenet_v3_large(num_classes=1000).to(device)
    student = torch.nn.SyncBatchNorm.convert_sync_batchnorm(student)
    model = DDP(student, device_ids=[local_rank])

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.04)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        ramp = min(1.0, (epoch + 1) / args.warmup)
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = model(x)
            ce = F.cross_entropy(s_logits.float(), y)
            kd = dkd_loss(s_logits.float(), t_logits.float(), y, args.alpha, args.beta, args.T)
            loss = ce + ramp * kd
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it} ce {ce.item():.3f} dkd {kd.item():.3f}", flush=True)

        top1, top5 = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "top1": top1}, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))

    if rank == 0:
        s = model.module
        print(f"best top1 {best:.2f} | student img/s bs1 {throughput(s, device, 1):.0f} "
              f"bs64 {throughput(s, device, 64):.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
