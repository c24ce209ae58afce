"""LwF.MC (multi-class LwF, as used as a baseline in iCaRL) on ImageNet-Subset.

ImageNet-Subset = the 100-class subset used by UCIR / PODNet, prepared as an
ImageFolder tree (train/ and val/). Class-incremental: 50 base classes and
then 5 or 10 incremental steps. Mixed precision.

    torchrun --nproc_per_node=4 11_lwf_mc_imagenet_subset.py \
        --data /ssd/imagenet_subset --base_classes 50 --increment 10
"""
import argparse
import copy
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/ssd/imagenet_subset")
    p.add_argument("--output_dir", default="./exp/lwf_mc_in100")
    p.add_argument("--num_classes", type=int, default=100)
    p.add_argument("--base_classes", type=int, default=50)
    p.add_argument("--increment", type=int, default=10)
    p.add_argument("--shuffle_classes", type=int, default=1)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--seed", type=int, default=1993)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def lwf_mc_loss(logits, targets, old_logits, n_old, T):
    """BCE on all seen classes; targets for old classes are the old model's sigmoid outputs."""
    onehot = F.one_hot(targets, logits.size(1)).float()
    if old_logits is not None:
        onehot[:, :n_old] = torch.sigmoid(old_logits[:, :n_old] / T)
    return F.binary_cross_entropy_with_logits(logits, onehot)


@torch.no_grad()
def top1_per_step(net, loader, steps, device):
    net.eval()
    right = np.zeros(len(steps) - 1)
    seen = np.zeros(len(steps) - 1)
    for x, y in loader:
        with autocast():
            out = net(x.to(device, non_blocking=True))[:, :steps[-1]]
        pred = out.argmax(1).cpu()
        for k in range(len(steps) - 1):
            m = (y >= steps[k]) & (y < steps[k + 1])
            right[k] += (pred[m] == y[m]).sum().item()
            seen[k] += m.sum().item()
    return 100.0 * right / np.maximum(seen, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    lr = args.lr * args.batch_size * world_size / 256
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)

    if args.shuffle_classes:
        class_order = np.random.permutation(args.num_classes).tolist()
    else:
        class_order = list(range(args.num_classes))
    label_map = {c: i for i, c in enumerate(class_order)}
    train_set.target_transform = label_map.__getitem__
    val_set.target_transform = label_map.__getitem__
    y_train = np.array([label_map[t] for t in train_set.targets])
    y_val = np.array([label_map[t] for t in val_set.targets])

    steps = [0] + list(range(args.base_classes, args.num_classes + 1, args.increment))
    n_steps = len(steps) - 1

    net = torchvision.models.resnet18(num_classes=args.num_classes).to(device)
    model = DDP(net, device_ids=[local_rank])
    old_net = None
    scaler = GradScaler()
    acc = np.zeros((n_steps, n_steps))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "config.json"), "w") as f:
            json.dump({**vars(args), "class_order": class_order, "world_size": world_size}, f, indent=1)

    for s in range(n_steps):
        lo, hi = steps[s], steps[s + 1]
        subset = Subset(train_set, np.where((y_train >= lo) & (y_train < hi))[0].tolist())
        sampler = DistributedSampler(subset, shuffle=True)
        loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for it, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with autocast():
                    logits = model(x)[:, :hi]
                    old_logits = None
                    if old_net is not None:
                        with torch.no_grad():
                            old_logits = old_net(x)
                    loss = lwf_mc_loss(logits.float(), y, None if old_logits is None else old_logits.float(),
                                       lo, args.T)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if rank == 0 and it % 100 == 0:
                    print(f"step {s} ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f}", flush=True)
            sched.step()
            if rank == 0:
                print(f"step {s} epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            val_loader = DataLoader(Subset(val_set, np.where(y_val < hi)[0].tolist()), batch_size=200,
                                    num_workers=args.workers, pin_memory=True)
            acc[s, :s + 1] = top1_per_step(net, val_loader, steps[:s + 2], device)
            print(f"### step {s}: classes {hi}, avg top-1 {acc[s, :s + 1].mean():.2f}, "
                  f"per step {np.round(acc[s, :s + 1], 1).tolist()}", flush=True)
            torch.save({"step": s, "model": net.state_dict(), "class_order": class_order, "acc": acc},
                       os.path.join(args.output_dir, f"step{s}.pth"))
        dist.barrier()

        old_net = copy.deepcopy(net).eval()
        for prm in old_net.parameters():
            prm.requires_grad = False

    if rank == 0:
        avg_inc = np.mean([acc[s, :s + 1].mean() for s in range(n_steps)])
        print(f"average incremental accuracy {avg_inc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
