"""Stochastic weight averaging (Izmailov et al. 2018) for VGG16-BN / PreResNet on CIFAR.

SGD with a cosine schedule until --swa-start, then a constant SWA learning rate
while averaging the weights once per epoch. BN statistics of the averaged model
are recomputed at the end.

torchrun --standalone --nproc_per_node=4 08_swa_cifar.py --arch vgg16_bn --dataset cifar100
"""
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, SWALR, update_bn
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
import torchvision
from torchvision import transforms

CFG_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        layers, cin = [], 3
        for v in CFG_VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(512, 512), nn.ReLU(True),
            nn.Dropout(), nn.Linear(512, 512), nn.ReLU(True),
            nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar100", choices=["cifar10", "cifar100"])
    p.add_argument("--data-path", default="~/datasets")
    p.add_argument("--arch", default="vgg16_bn")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--swa-start", type=int, default=161)
    p.add_argument("--lr", type=float, default=0.05, help="for a total batch of 128")
    p.add_argument("--swa-lr", type=float, default=0.01, help="for a total batch of 128")
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--out-dir", default="results/swa")
    return p.parse_args()


def save_checkpoint(state, is_best, out_dir, name="checkpoint.pt"):
    path = os.path.join(out_dir, name)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pt"))


@torch.no_grad()
def test(net, loader, device):
    net.eval()
    tot = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = net(x)
        tot[0] += F.cross_entropy(out, y, reduction="sum")
        tot[1] += (out.argmax(1) == y).sum()
        tot[2] += y.numel()
    dist.all_reduce(tot)
    return (tot[0] / tot[2]).item(), (100 * tot[1] / tot[2]).item()


def average_bn_buffers(net, world):
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            dist.all_reduce(m.running_mean)
            dist.all_reduce(m.running_var)
            m.running_mean /= world
            m.running_var /= world


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    root = os.path.expanduser(args.data_path)
    ds_cls = torchvision.datasets.CIFAR100 if args.dataset == "cifar100" else torchvision.datasets.CIFAR10
    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = ds_cls(root, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    test_set = ds_cls(root, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    num_classes = 100 if args.dataset == "cifar100" else 10

    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=256, num_workers=4)

    net = VGG(num_classes).to(device)
    model = DDP(net, device_ids=[local_rank])
    swa_model = AveragedModel(net)

    scale = args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * scale, momentum=0.9, weight_decay=args.wd)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.swa_start)
    swa_scheduler = SWALR(optimizer, swa_lr=args.swa_lr * scale, anneal_epochs=5)
    criterion = nn.CrossEntropyLoss()

    writer = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        writer = SummaryWriter(args.out_dir)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])

        if epoch >= args.swa_start:
            swa_model.update_parameters(net)
            swa_scheduler.step()
        else:
            cosine.step()

        dist.all_reduce(running)
        test_loss, test_acc = test(net, test_loader, device)
        is_best = test_acc > best_acc
        best_acc = max(best_acc, test_acc)
        if rank == 0:
            writer.add_scalar("train/loss", (running[0] / running[1]).item(), epoch)
            writer.add_scalar("test/loss", test_loss, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            writer.add_scalar("lr", optimizer.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch:3d} | test acc {test_acc:.2f} | {time.time() - start:.1f}s")

        save_checkpoint({
            "epoch": epoch,
            "state_dict": net.state_dict(),
            "swa_state_dict": swa_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "best_acc": best_acc,
        }, is_best, args.out_dir)

    # recompute BN statistics for the averaged weights on each shard, then average them
    update_bn(train_loader, swa_model, device=device)
    average_bn_buffers(swa_model.module, world)
    swa_loss, swa_acc = test(swa_model.module, test_loader, device)
    if rank == 0:
        writer.add_scalar("swa/test_acc", swa_acc, args.epochs)
        print(f"SWA test acc {swa_acc:.2f} (best SGD {best_acc:.2f})")
        torch.save(swa_model.module.state_dict(), os.path.join(args.out_dir, "swa_final.pt"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
