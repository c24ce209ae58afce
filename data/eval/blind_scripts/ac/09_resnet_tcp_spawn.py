"""ResNet-101 on the in-house 2k-class retail dataset, launched by hand on each node.

Two 8-GPU workstations on the same 100G switch, no scheduler. Run on every node,
changing only --node-rank:

    # on ws-gpu-01 (10.20.0.11)
    python train_r101.py --dist-url tcp://10.20.0.11:23456 --nodes 2 --node-rank 0 \
        --data /mnt/nas/retail2k --out /mnt/nas/runs/r101
    # on ws-gpu-02
    python train_r101.py --dist-url tcp://10.20.0.11:23456 --nodes 2 --node-rank 1 \
        --data /mnt/nas/retail2k --out /mnt/nas/runs/r101
"""
import argparse
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision.models as models
import torchvision.transforms as transforms
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

parser = argparse.ArgumentParser(description="retail2k training")
parser.add_argument("--data", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--arch", default="resnet101")
parser.add_argument("--epochs", type=int, default=90)
parser.add_argument("-b", "--batch-size", type=int, default=512, help="total over all GPUs of all nodes")
parser.add_argument("--lr", type=float, default=0.2)
parser.add_argument("--wd", type=float, default=1e-4)
parser.add_argument("-j", "--workers", type=int, default=32, help="per node")
parser.add_argument("--nodes", type=int, default=1)
parser.add_argument("--node-rank", type=int, default=0)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
parser.add_argument("--print-freq", type=int, default=100)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.nodes
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    cudnn.benchmark = True

    model = models.__dict__[args.arch](num_classes=2000)
    model.cuda(args.gpu)
    model = DDP(model, device_ids=[args.gpu])

    # per-process share of the global batch and of the node's loader workers
    batch_size = args.batch_size // args.world_size
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).cuda(args.gpu)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=args.wd)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_dataset = ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler,
                              num_workers=workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=batch_size, sampler=val_sampler,
                            num_workers=workers, pin_memory=True)

    steps = len(train_loader) * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps,
                                                    pct_start=5 / args.epochs, anneal_strategy="cos",
                                                    div_factor=25.0, final_div_factor=1e3)

    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc1 = 0, 0.0
    resume = os.path.join(args.out, "checkpoint.pth.tar")
    if os.path.isfile(resume):
        ckpt = torch.load(resume, map_location=f"cuda:{args.gpu}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]
        if args.rank == 0:
            print(f"=> resumed from epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, scheduler, scaler, epoch, args)
        acc1 = validate(val_loader, model, args)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}, resume)
            if is_best:
                shutil.copyfile(resume, os.path.join(args.out, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


def train(loader, model, criterion, optimizer, scheduler, scaler, epoch, args):
    model.train()
    losses = AverageMeter()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        losses.update(loss.item(), images.size(0))
        if i % args.print_freq == 0 and args.rank == 0:
            print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {losses.avg:.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.4f} {time.time() - end:.1f}s", flush=True)
            end = time.time()


@torch.no_grad()
def validate(loader, model, args):
    model.eval()
    stats = torch.zeros(2, device=args.gpu)
    for images, target in loader:
        images = images.cuda(args.gpu, non_blocking=True)
        target = target.cuda(args.gpu, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
        stats[0] += (output.argmax(1) == target).sum()
        stats[1] += target.size(0)
    dist.all_reduce(stats)
    acc1 = (100.0 * stats[0] / stats[1]).item()
    if args.rank == 0:
        print(f" * Acc@1 {acc1:.3f}", flush=True)
    return acc1


if __name__ == "__main__":
    main()
