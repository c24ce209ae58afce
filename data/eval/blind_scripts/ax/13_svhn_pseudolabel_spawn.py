"""Round-based pseudo-labelling on SVHN (1k labels, `extra` split as unlabelled).

Structure follows the torchvision ImageNet example: one process per GPU
started with torch.multiprocessing.spawn.

    python svhn_pseudolabel_spawn.py --rounds 5 --dist-url tcp://127.0.0.1:23456
"""
import argparse
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as transforms
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models

parser = argparse.ArgumentParser(description="SVHN pseudo-labelling")
parser.add_argument("data", metavar="DIR", help="path to SVHN")
parser.add_argument("--rounds", default=5, type=int)
parser.add_argument("--epochs", default=30, type=int)
parser.add_argument("-b", "--batch-size", default=256, type=int,
                    help="total batch size over all GPUs on the node")
parser.add_argument("--lr", default=0.05, type=float)
parser.add_argument("--n-labeled", default=1000, type=int)
parser.add_argument("--keep-per-class", default=5000, type=int,
                    help="most confident pseudo-labels kept per class each round")
parser.add_argument("-j", "--workers", default=4, type=int)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--seed", default=17, type=int)
parser.add_argument("--out", default="svhn_pl", type=str)


class Relabel(Dataset):
    def __init__(self, base, idx, labels):
        self.base, self.idx, self.labels = base, idx, labels

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        return self.base[self.idx[i]][0], int(self.labels[i])


def wide_resnet():
    m = models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def main():
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    cudnn.benchmark = True
    os.makedirs(args.out, exist_ok=True)
    # fetch once in the parent so the workers only read
    for split in ("train", "extra", "test"):
        datasets.SVHN(args.data, split=split, download=True)
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args, ngpus_per_node))


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = gpu
    args.world_size = ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    per_gpu_bs = args.batch_size // ngpus_per_node
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node

    norm = transforms.Normalize((0.4377, 0.4438, 0.4728), (0.198, 0.201, 0.197))
    aug = transforms.Compose([transforms.RandomCrop(32, padding=2), transforms.ToTensor(), norm])
    plain = transforms.Compose([transforms.ToTensor(), norm])
    train_aug = datasets.SVHN(args.data, split="train", transform=aug)
    extra_aug = datasets.SVHN(args.data, split="extra", transform=aug)
    extra_plain = datasets.SVHN(args.data, split="extra", transform=plain)
    test_set = datasets.SVHN(args.data, split="test", transform=plain)

    rng = np.random.RandomState(args.seed)
    labeled = rng.choice(len(train_aug), args.n_labeled, replace=False).tolist()
    labeled_set = Subset(train_aug, labeled)

    test_loader = DataLoader(test_set, batch_size=512, num_workers=workers,
                             sampler=DistributedSampler(test_set, shuffle=False))

    train_set = labeled_set
    best_acc = 0.0
    for rnd in range(args.rounds):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(wide_resnet()).cuda(gpu)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
        optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)
        sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=per_gpu_bs, sampler=sampler,
                            num_workers=workers, pin_memory=True, drop_last=True)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            end = time.time()
            for images, target in loader:
                images = images.cuda(gpu, non_blocking=True)
                target = target.cuda(gpu, non_blocking=True)
                loss = F.cross_entropy(model(images), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            scheduler.step()
            if args.rank == 0 and epoch % 5 == 0:
                print(f"round {rnd} epoch {epoch} loss {loss.item():.4f} "
                      f"({time.time() - end:.1f}s)", flush=True)

        acc = test(model.module, test_loader, gpu)
        is_best = acc > best_acc
        best_acc = max(acc, best_acc)
        if args.rank == 0:
            print(f"== round {rnd}: {len(train_set)} training samples, acc {acc:.4f}", flush=True)
            path = os.path.join(args.out, f"round{rnd}.pth.tar")
            torch.save({"round": rnd, "state_dict": model.module.state_dict(),
                        "best_acc": best_acc}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.out, "model_best.pth.tar"))

        idx, labels = select_pseudo_labels(model.module, extra_plain, args, gpu, workers)
        train_set = ConcatDataset([labeled_set, Relabel(extra_aug, idx, labels)])

    dist.destroy_process_group()


@torch.no_grad()
def select_pseudo_labels(net, dataset, args, gpu, workers):
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=1024, sampler=sampler, num_workers=workers)
    shard = torch.tensor(list(sampler)).cuda(gpu)
    net.eval()
    conf, pred = [], []
    for images, _ in loader:
        p = F.softmax(net(images.cuda(gpu, non_blocking=True)), 1)
        c, y = p.max(1)
        conf.append(c)
        pred.append(y)
    conf, pred = torch.cat(conf), torch.cat(pred)
    # shards are padded to equal length, so a plain all_gather works
    gathered = [torch.empty_like(t) for t in (shard, conf, pred) for _ in range(args.world_size)]
    ws = args.world_size
    dist.all_gather(gathered[:ws], shard)
    dist.all_gather(gathered[ws:2 * ws], conf)
    dist.all_gather(gathered[2 * ws:], pred)
    shard = torch.cat(gathered[:ws]).cpu().numpy()
    conf = torch.cat(gathered[ws:2 * ws]).cpu().numpy()
    pred = torch.cat(gathered[2 * ws:]).cpu().numpy()
    shard, first = np.unique(shard, return_index=True)
    conf, pred = conf[first], pred[first]
    keep = []
    for c in range(10):
        cls = np.where(pred == c)[0]
        top = cls[np.argsort(-conf[cls], kind="stable")[: args.keep_per_class]]
        keep.extend(top.tolist())
    keep = np.sort(np.array(keep))
    return shard[keep].tolist(), pred[keep].tolist()


@torch.no_grad()
def test(net, loader, gpu):
    net.eval()
    s = torch.zeros(2, device=f"cuda:{gpu}")
    for images, target in loader:
        s[0] += (net(images.cuda(gpu)).argmax(1) == target.cuda(gpu)).sum()
        s[1] += target.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


if __name__ == "__main__":
    main()
