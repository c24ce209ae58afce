"""ViT-S/8 from scratch on Tiny-ImageNet (64x64, 200 classes), DDP.

Evaluate every --eval-every epochs on the validation split, keep best.pth by
top-1, stop after --patience evaluations without improvement, then test the
best weights on the held-out split with a fresh model.

    torchrun --nproc_per_node=4 12_tinyimagenet_vit_best.py --data /data/tiny-imagenet-200
"""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

MEAN, STD = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="root with train/ val/ test/ in ImageFolder layout")
    p.add_argument("--output", default="output/tin_vit_s8")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR for 4 GPUs x 256")
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--workers", type=int, default=8)
    return p


def make_model():
    return timm.create_model("vit_small_patch8_224", img_size=64, num_classes=200, drop_path_rate=0.1)


def cosine_lr(epoch, args):
    if epoch < args.warmup_epochs:
        return args.lr * (epoch + 1) / args.warmup_epochs
    progress = (epoch - args.warmup_epochs) / max(1, args.epochs - args.warmup_epochs)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def top1_top5(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).topk(5, 1).indices
        s[0] += (pred[:, 0] == y).sum()
        s[1] += (pred == y.unsqueeze(1)).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def sharded_loader(ds, rank, world, workers):
    return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=512, num_workers=workers,
                      pin_memory=True)


def test_best(args, device, rank, world):
    """Fresh model, best weights from disk, test split."""
    model = make_model().to(device)
    ckpt = torch.load(os.path.join(args.output, "best.pth"), map_location="cpu")
    model.load_state_dict(ckpt["model"])
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    test_ds = ImageFolder(os.path.join(args.data, "test"), transform=eval_tf)
    t1, t5 = top1_top5(model, sharded_loader(test_ds, rank, world, args.workers), device)
    return ckpt["epoch"], t1, t5


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0
    torch.manual_seed(42)

    train_tf = T.Compose([
        T.RandomResizedCrop(64, scale=(0.35, 1.0)),
        T.RandomHorizontalFlip(),
        T.TrivialAugmentWide(),
        T.ToTensor(),
        T.Normalize(MEAN, STD),
        T.RandomErasing(p=0.25),
    ])
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train_ds = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    assert train_ds.classes == val_ds.classes

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = sharded_loader(val_ds, rank, world, args.workers)

    model = DDP(make_model().to(device), device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or n.endswith(("pos_embed", "cls_token")) else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)

    if main_proc:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    history, best_top1, misses = [], 0.0, 0
    for epoch in range(args.epochs):
        for g in optimizer.param_groups:
            g["lr"] = cosine_lr(epoch, args)
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        if (epoch + 1) % args.eval_every != 0:
            continue
        top1, top5 = top1_top5(model.module, val_loader, device)
        history.append({"epoch": epoch, "top1": top1, "top5": top5})
        if main_proc:
            print(f"epoch {epoch} loss {loss.item():.3f} val top1 {top1:.4f} top5 {top5:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)", flush=True)
        if top1 > best_top1:
            best_top1, misses = top1, 0
            if main_proc:
                torch.save({"epoch": epoch, "model": model.state_dict(), "top1": top1},
                           os.path.join(args.output, "best.pth"))
        else:
            misses += 1
            if misses >= args.patience:
                if main_proc:
                    print(f"early stop at epoch {epoch}", flush=True)
                break

    dist.barrier()
    best_epoch, t1, t5 = test_best(args, device, rank, world)
    if main_proc:
        print(f"best epoch {best_epoch}: test top1 {t1:.4f} top5 {t5:.4f}")
        with open(os.path.join(args.output, "results.json"), "w") as f:
            json.dump({"history": history, "best_epoch": best_epoch, "test_top1": t1, "test_top5": t5}, f,
                      indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
