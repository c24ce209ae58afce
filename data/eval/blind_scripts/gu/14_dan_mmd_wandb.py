"""DAN: deep adaptation network with multi-kernel MMD (Long et al., ICML'15).

Office-Home, ResNet-50, DDP, metrics tracked in Weights & Biases.

    torchrun --nproc_per_node=4 14_dan_mmd_wandb.py --root data/office-home --source Product --target Clipart
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/office-home")
    p.add_argument("--source", default="Product")
    p.add_argument("--target", default="Clipart")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--iters-per-epoch", type=int, default=500)
    p.add_argument("--mmd-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--project", default="uda-officehome")
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt-dir", default="checkpoints/dan")
    return p.parse_args()


def gaussian_kernels(x, y, kernel_mul=2.0, kernel_num=5):
    total = torch.cat([x, y], 0)
    l2 = torch.cdist(total, total).pow(2)
    n = total.size(0)
    bandwidth = l2.detach().sum() / (n * n - n)
    bandwidth = bandwidth / (kernel_mul ** (kernel_num // 2))
    return sum(torch.exp(-l2 / (bandwidth * kernel_mul ** i)) for i in range(kernel_num))


def mk_mmd(fs, ft):
    k = gaussian_kernels(fs, ft)
    b = fs.size(0)
    xx, yy = k[:b, :b], k[b:, b:]
    xy, yx = k[:b, b:], k[b:, :b]
    return xx.mean() + yy.mean() - xy.mean() - yx.mean()


class DANNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        r.fc = nn.Identity()
        self.backbone = r
        self.bottleneck = nn.Sequential(nn.Linear(2048, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(256, num_classes)

    def forward(self, x):
        f = self.bottleneck(self.backbone(x))
        return self.head(f), f


def loaders(args):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    src = datasets.ImageFolder(os.path.join(args.root, args.source), train_tf)
    tgt = datasets.ImageFolder(os.path.join(args.root, args.target), train_tf)
    test = datasets.ImageFolder(os.path.join(args.root, args.target), test_tf)
    out = []
    for ds, train in ((src, True), (tgt, True), (test, False)):
        sampler = DistributedSampler(ds, shuffle=train, drop_last=train)
        out.append(DataLoader(ds, batch_size=args.batch_size if train else 100, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=train))
    return out, len(src.classes)


def infinite(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        logits, _ = model(x.to(device, non_blocking=True))
        c[0] += (logits.argmax(1) == y.to(device)).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    model.train()
    return (100 * c[0] / c[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run = wandb.init(project=args.project, name=args.run_name or f"dan_{args.source}2{args.target}",
                     config={**vars(args), "world_size": world_size})

    (src_loader, tgt_loader, test_loader), num_classes = loaders(args)
    model = DANNet(num_classes).to(device)
    optimizer = torch.optim.SGD([
        {"params": model.backbone.parameters(), "lr": 0.1 * args.lr},
        {"params": list(model.bottleneck.parameters()) + list(model.head.parameters()), "lr": args.lr},
    ], momentum=0.9, weight_decay=5e-4, nesterov=True)
    base = [g["lr"] for g in optimizer.param_groups]
    model = DDP(model, device_ids=[local_rank])

    src_it, tgt_it = infinite(src_loader), infinite(tgt_loader)
    total = args.epochs * args.iters_per_epoch
    best, step = 0.0, 0
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i in range(args.iters_per_epoch):
            progress = step / total
            for g, b in zip(optimizer.param_groups, base):
                g["lr"] = b * (1 + 10 * progress) ** -0.75
            xs, ys = next(src_it)
            xt, _ = next(tgt_it)
            xs, ys, xt = xs.to(device), ys.to(device), xt.to(device)

            logits, feats = model(torch.cat([xs, xt]))
            n = xs.size(0)
            cls_loss = F.cross_entropy(logits[:n], ys)
            mmd = mk_mmd(feats[:n], feats[n:])
            lam = 2 / (1 + torch.exp(torch.tensor(-10.0 * progress))).item() - 1
            loss = cls_loss + args.mmd_weight * lam * mmd

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            if step % 20 == 0:
                vals = torch.stack([cls_loss.detach(), mmd.detach()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                wandb.log({"train/cls_loss": vals[0].item(), "train/mmd": vals[1].item(),
                           "train/lr": optimizer.param_groups[1]["lr"], "train/lambda": lam}, step=step)

        acc = evaluate(model, test_loader, device)
        wandb.log({"val/target_acc": acc, "epoch": epoch, "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: target acc {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.ckpt_dir, "last.pth"))
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.ckpt_dir, "best.pth"))
                run.summary["best_target_acc"] = best
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
