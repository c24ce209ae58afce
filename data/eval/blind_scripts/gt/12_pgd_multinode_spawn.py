"""L-inf PGD adversarial training on ImageNet (eps=4/255, 3 steps), several nodes.

One process per GPU, spawned with torch.multiprocessing; the processes of all
nodes meet at --dist-url. Run the same command on every node with its own
--rank (node index):

    # node 0                                          # node 1
    python 12_pgd_multinode_spawn.py /datasets/imagenet \
        --dist-url tcp://10.1.1.20:23456 --world-size 2 --rank 0   # ... --rank 1
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
import torch.nn.functional as F
import torchvision.models as models
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

parser = argparse.ArgumentParser(description="ImageNet PGD adversarial training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-j", "--workers", default=8, type=int, help="data loading workers per node")
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("-b", "--batch-size", default=256, type=int, help="total batch size of all nodes")
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", default=1e-4, type=float)
parser.add_argument("--eps", default=4.0, type=float)
parser.add_argument("--alpha", default=1.0, type=float)
parser.add_argument("--attack-steps", default=3, type=int)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--save-dir", default="/shared/ckpt/pgd_in", help="on the shared filesystem")
parser.add_argument("--print-freq", default=100, type=int)


class InputNormalize(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        return self.model((x - self.mean) / self.std)


def pgd(model, x, y, eps, alpha, steps):
    delta = torch.empty_like(x).uniform_(-eps, eps)
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        loss = F.cross_entropy(model(x + delta), y)
        g, = torch.autograd.grad(loss, delta)
        delta = (delta.detach() + alpha * g.sign()).clamp(-eps, eps)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


def main_worker(gpu, ngpus_per_node, args):
    rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=rank)
    is_master = rank == 0
    cudnn.benchmark = True

    batch_size = args.batch_size // dist.get_world_size()
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node
    eps, alpha = args.eps / 255.0, args.alpha / 255.0

    model = InputNormalize(models.__dict__[args.arch]()).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)

    traindir, valdir = os.path.join(args.data, "train"), os.path.join(args.data, "val")
    train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor()]))
    val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()]))
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False)
    train_loader = DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler,
                              num_workers=workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=100, sampler=val_sampler,
                            num_workers=workers, pin_memory=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        stat = torch.zeros(3, device=gpu)
        for i, (images, target) in enumerate(train_loader):
            images = images.cuda(gpu, non_blocking=True)
            target = target.cuda(gpu, non_blocking=True)
            adv = pgd(model, images, target, eps, alpha, args.attack_steps)
            output = model(adv)
            loss = F.cross_entropy(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stat += torch.stack([loss.detach() * target.size(0),
                                 (output.argmax(1) == target).sum().float(),
                                 torch.tensor(float(target.size(0)), device=gpu)])
            if is_master and i % args.print_freq == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"{(time.time() - end) / (i + 1):.3f}s/it", flush=True)
        scheduler.step()
        dist.all_reduce(stat)

        model.eval()
        ev = torch.zeros(3, device=gpu)
        for images, target in val_loader:
            images, target = images.cuda(gpu, non_blocking=True), target.cuda(gpu, non_blocking=True)
            adv = pgd(model, images, target, eps, alpha, 10)
            with torch.no_grad():
                ev[0] += (model(images).argmax(1) == target).sum()
                ev[1] += (model(adv).argmax(1) == target).sum()
                ev[2] += target.size(0)
        dist.all_reduce(ev)
        clean_acc, adv_acc = (ev[0] / ev[2]).item(), (ev[1] / ev[2]).item()

        if is_master:
            print(f"* epoch {epoch}: train loss {(stat[0] / stat[2]).item():.4f} "
                  f"adv-train acc {(stat[1] / stat[2]).item():.4f} | val clean {clean_acc:.4f} "
                  f"PGD-10 {adv_acc:.4f}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            path = os.path.join(args.save_dir, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "adv_acc": adv_acc}, path)
            if adv_acc > best_acc:
                best_acc = adv_acc
                shutil.copyfile(path, os.path.join(args.save_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
