"""
CIFAR-100 ResNet-18 with DDP, tracking the run in Weights & Biases.

    wandb login
    torchrun --nproc_per_node=4 17_cifar100_wandb.py --project cifar100-ddp --epochs 60
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as transforms
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", default="cifar100-ddp")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    return parser.parse_args()


def resnet18_cifar(num_classes=100):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def accuracy(output, target, topk=(1, 5)):
    maxk = max(topk)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum() for k in topk]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(4, device=device)   # loss, top1, top5, n
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        top1, top5 = accuracy(out, y)
        sums += torch.stack([F.cross_entropy(out, y, reduction="sum"), top1, top5,
                             torch.tensor(float(y.size(0)), device=device)])
    dist.all_reduce(sums)
    return (sums[0] / sums[3]).item(), (sums[1] / sums[3]).item(), (sums[2] / sums[3]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))
    wandb.config.update({"world_size": world_size, "global_batch": args.batch_size * world_size})

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.RandomRotation(15),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD)])

    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()

    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=250, sampler=test_sampler, num_workers=4, pin_memory=True)

    model = resnet18_cifar().to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # global batch 256 on 4 GPUs, lr scaled from the usual 0.1 @ 128
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.15)

    best_top1 = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            loss = criterion(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1

            if global_step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                           "epoch": epoch}, step=global_step)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f}")

        test_loss, top1, top5 = evaluate(model, test_loader, device)
        wandb.log({"test/loss": test_loss, "test/top1": top1, "test/top5": top5,
                   "epoch_time": time.time() - t0}, step=global_step)

        if rank == 0:
            print(f"== epoch {epoch}: test loss {test_loss:.4f} top1 {top1 * 100:.2f} top5 {top5 * 100:.2f}")
            state = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict()}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
                wandb.run.summary["best_top1"] = best_top1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
