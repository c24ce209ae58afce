"""DANN for digit adaptation (SVHN -> MNIST), one process per GPU via mp.spawn.

    python 05_dann_digits_spawn.py --data ./data --epochs 30
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse_args():
    parser = argparse.ArgumentParser(description="DANN SVHN->MNIST")
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--gamma", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--save-dir", default="checkpoints/dann_svhn_mnist")
    return parser.parse_args()


class GRL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lambd):
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lambd * g, None


class DigitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 5, padding=2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 5, padding=2), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 5, padding=2), nn.BatchNorm2d(256), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 10))
        self.domain = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                    nn.Linear(512, 1))

    def forward(self, x, lambd=0.0):
        f = self.features(x)
        return self.classifier(f), self.domain(GRL.apply(f, lambd))


def get_datasets(root, download):
    tf = transforms.Compose([
        transforms.Resize(32),
        transforms.Grayscale(num_output_channels=3),
        transforms.ToTensor(),
        transforms.Normalize((0.5,) * 3, (0.5,) * 3),
    ])
    svhn = datasets.SVHN(root, split="train", transform=tf, download=download)
    mnist_train = datasets.MNIST(root, train=True, transform=tf, download=download)
    mnist_test = datasets.MNIST(root, train=False, transform=tf, download=download)
    return svhn, mnist_train, mnist_test


def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits, _ = model(x)
            counts[0] += (logits.argmax(1) == y).sum()
            counts[1] += y.size(0)
    dist.all_reduce(counts)
    model.train()
    return 100.0 * (counts[0] / counts[1]).item()


def main_worker(gpu, args):
    world_size = torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=world_size, rank=gpu)
    device = torch.device("cuda", gpu)
    torch.manual_seed(1234)

    svhn, mnist_train, mnist_test = get_datasets(args.data, download=False)
    samplers = [DistributedSampler(d, shuffle=True, drop_last=True) for d in (svhn, mnist_train)]
    src_loader = DataLoader(svhn, args.batch_size, sampler=samplers[0], num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    tgt_loader = DataLoader(mnist_train, args.batch_size, sampler=samplers[1], num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    test_sampler = DistributedSampler(mnist_test, shuffle=False)
    test_loader = DataLoader(mnist_test, 256, sampler=test_sampler, num_workers=args.workers)

    model = DDP(DigitNet().to(device), device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    steps_per_epoch = min(len(src_loader), len(tgt_loader))
    total_steps = args.epochs * steps_per_epoch
    best = 0.0
    if gpu == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, ((xs, ys), (xt, _)) in enumerate(zip(src_loader, tgt_loader)):
            p = (epoch * steps_per_epoch + i) / total_steps
            lambd = 2.0 / (1.0 + math.exp(-args.gamma * p)) - 1.0
            lr = args.lr / (1.0 + 10 * p) ** 0.75
            for g in optimizer.param_groups:
                g["lr"] = lr

            xs, ys, xt = xs.to(device), ys.to(device), xt.to(device)
            x = torch.cat([xs, xt], 0)
            d_labels = torch.cat([torch.zeros(xs.size(0)), torch.ones(xt.size(0))]).to(device)
            cls_out, dom_out = model(x, lambd)
            loss_cls = F.cross_entropy(cls_out[: xs.size(0)], ys)
            loss_dom = F.binary_cross_entropy_with_logits(dom_out.squeeze(1), d_labels)
            loss = loss_cls + loss_dom

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            if i % 100 == 0 and gpu == 0:
                print(f"epoch {epoch} [{i}/{steps_per_epoch}] cls {loss_cls.item():.4f} "
                      f"dom {loss_dom.item():.4f} lambda {lambd:.3f} lr {lr:.5f}", flush=True)

        acc = evaluate(model, test_loader, device)
        if gpu == 0:
            print(f"epoch {epoch} done in {time.time() - tic:.0f}s, MNIST test acc {acc:.2f}", flush=True)
            state = {"epoch": epoch, "model": model.module.state_dict(), "acc": acc}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    # fetch the datasets once in the parent so the workers never download concurrently
    get_datasets(args.data, download=True)
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(args))


if __name__ == "__main__":
    main()
