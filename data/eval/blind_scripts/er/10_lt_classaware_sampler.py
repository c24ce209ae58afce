"""Long-tailed classification with class-aware sampling (Shen et al., ECCV 2016 / mmdet's
ClassAwareSampler), ResNet-10 / ResNet-50 on ImageNet-LT or Places-LT.

The sampler cycles over classes in a shuffled order and takes `num_sample_class`
consecutive images from each class's own shuffled queue.

    torchrun --nproc_per_node=4 lt_classaware_sampler.py --dataset imagenet_lt --arch resnet10
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

DATASETS = {
    "imagenet_lt": ("/data/imagenet", "lists/ImageNet_LT_{}.txt", 1000),
    "places_lt": ("/data/places365_standard", "lists/Places_LT_{}.txt", 365),
}


class ListDataset(Dataset):
    def __init__(self, root, txt, tf):
        self.root, self.tf = root, tf
        with open(txt) as f:
            pairs = [l.rsplit(maxsplit=1) for l in f.read().splitlines() if l]
        self.paths = [p for p, _ in pairs]
        self.labels = [int(c) for _, c in pairs]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), self.labels[i]


class DistributedClassAwareSampler(Sampler):
    def __init__(self, labels, num_replicas, rank, num_sample_class=1, seed=0):
        self.num_replicas, self.rank = num_replicas, rank
        self.num_sample_class, self.seed = num_sample_class, seed
        self.epoch = 0
        num_classes = max(labels) + 1
        self.cls_idx = [[] for _ in range(num_classes)]
        for i, y in enumerate(labels):
            self.cls_idx[y].append(i)
        self.valid = [c for c in range(num_classes) if self.cls_idx[c]]
        self.num_samples = math.ceil(len(labels) / num_replicas)
        self.total = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rnd = random.Random(self.seed + self.epoch)
        queues = {c: [] for c in self.valid}
        order = []
        out = []
        while len(out) < self.total:
            if not order:
                order = self.valid[:]
                rnd.shuffle(order)
            c = order.pop()
            for _ in range(self.num_sample_class):
                if not queues[c]:
                    queues[c] = self.cls_idx[c][:]
                    rnd.shuffle(queues[c])
                out.append(queues[c].pop())
        out = out[: self.total]
        return iter(out[self.rank: self.total: self.num_replicas])

    def __len__(self):
        return self.num_samples


def resnet10(num_classes):
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)


def resnet50(num_classes):
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        root, pattern, self.num_classes = DATASETS[args.dataset]
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.train_set = ListDataset(root, pattern.format("train"), transforms.Compose([
            transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
            transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm]))
        self.test_set = ListDataset(root, pattern.format("test"), transforms.Compose([
            transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
        self.train_counts = torch.bincount(torch.tensor(self.train_set.labels), minlength=self.num_classes)

        self.sampler = DistributedClassAwareSampler(self.train_set.labels, self.world, self.rank,
                                                    num_sample_class=args.num_sample_class, seed=args.seed)
        self.train_loader = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)
        test_idx = list(range(self.rank, len(self.test_set), self.world))
        self.test_loader = DataLoader(torch.utils.data.Subset(self.test_set, test_idx), batch_size=256,
                                      num_workers=args.workers, pin_memory=True)

        net = {"resnet10": resnet10, "resnet50": resnet50}[args.arch](self.num_classes)
        self.model = DDP(net.to(self.device), device_ids=[self.local_rank])
        lr = args.lr * args.batch_size * self.world / 256
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9,
                                         weight_decay=args.wd)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, T_max=args.epochs * len(self.train_loader))
        self.writer = SummaryWriter(args.out) if self.rank == 0 else None

    def train_epoch(self, epoch):
        self.model.train()
        t0, seen = time.time(), 0
        for it, (x, y) in enumerate(self.train_loader):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = F.cross_entropy(self.model(x), y, label_smoothing=self.args.smoothing)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            seen += x.size(0)
            if self.writer and it % 50 == 0:
                step = epoch * len(self.train_loader) + it
                self.writer.add_scalar("train/loss", loss.item(), step)
                self.writer.add_scalar("train/lr", self.scheduler.get_last_lr()[0], step)
        if self.rank == 0:
            print(f"epoch {epoch}: {seen * self.world / (time.time() - t0):.0f} img/s", flush=True)

    @torch.no_grad()
    def test(self):
        net = self.model.module
        net.eval()
        C = self.num_classes
        correct = torch.zeros(C, dtype=torch.long, device=self.device)
        total = torch.zeros(C, dtype=torch.long, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            pred = net(x).argmax(1)
            total += torch.bincount(y, minlength=C)
            correct += torch.bincount(y[pred == y], minlength=C)
        dist.all_reduce(correct)
        dist.all_reduce(total)
        acc = (correct.float() / total.clamp(min=1).float()).cpu()
        n = self.train_counts
        return {"all": correct.sum().item() / total.sum().item(),
                "many": acc[n > 100].mean().item(),
                "medium": acc[(n <= 100) & (n >= 20)].mean().item(),
                "few": acc[n < 20].mean().item()}

    def save(self, epoch):
        if self.rank != 0:
            return
        torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   os.path.join(self.args.out, "latest.pth"))

    def fit(self):
        if self.rank == 0:
            os.makedirs(self.args.out, exist_ok=True)
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            if (epoch + 1) % self.args.eval_every == 0 or epoch + 1 == self.args.epochs:
                r = self.test()
                if self.rank == 0:
                    print("  test " + " ".join(f"{k}={100 * v:.2f}" for k, v in r.items()), flush=True)
                    for k, v in r.items():
                        self.writer.add_scalar(f"test/{k}", v, epoch)
            self.save(epoch)
        if self.writer:
            self.writer.close()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=list(DATASETS), default="imagenet_lt")
    p.add_argument("--arch", choices=["resnet10", "resnet50"], default="resnet10")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="at total batch 256")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--smoothing", type=float, default=0.0)
    p.add_argument("--num-sample-class", type=int, default=1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/classaware")
    Trainer(p.parse_args()).fit()


if __name__ == "__main__":
    main()
