"""Learnable Weight Scaling (LWS) on ImageNet-LT -- second stage of "Decoupling
Representation and Classifier for Long-Tailed Recognition" (Kang et al., ICLR 2020).

Everything from stage 1 is frozen, only a per-class scale f_c on the classifier
weights is learned with class-balanced sampling:  W~_c = f_c * W_c.

    torchrun --nproc_per_node=8 imagenetlt_lws.py \
        --stage1-ckpt work_dirs/rx50_stage1/latest.pth --work-dir work_dirs/rx50_lws
"""
import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms

log = logging.getLogger(__name__)


class ImageNetLT(Dataset):
    def __init__(self, root, txt, transform=None):
        self.root, self.transform = root, transform
        with open(txt) as f:
            rows = [l.split() for l in f if l.strip()]
        self.files = [r[0] for r in rows]
        self.targets = torch.tensor([int(r[1]) for r in rows])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.root, self.files[idx])).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[idx])


class BalancedDistSampler(Sampler):
    """Class-balanced sampling with replacement, sharded across ranks."""

    def __init__(self, targets, num_replicas, rank, seed=0):
        counts = torch.bincount(targets).float()
        self.weights = (1.0 / counts)[targets]
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.num_samples = len(targets) // num_replicas
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        idx = torch.multinomial(self.weights, self.num_samples * self.num_replicas, replacement=True, generator=g)
        return iter(idx[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class LWSClassifier(nn.Module):
    def __init__(self, in_dim, num_classes):
        super().__init__()
        self.fc = nn.Linear(in_dim, num_classes)
        self.scales = nn.Parameter(torch.ones(num_classes))

    def forward(self, x):
        return self.fc(x) * self.scales


class LTNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        backbone = torchvision.models.resnext50_32x4d()
        feat_dim = backbone.fc.in_features
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.classifier = LWSClassifier(feat_dim, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def load_stage1(net, path):
    ckpt = torch.load(path, map_location="cpu")
    sd = {k.replace("module.", "", 1): v for k, v in ckpt["model"].items()}
    # stage 1 used a plain nn.Linear head called "classifier"
    sd = {k.replace("classifier.", "classifier.fc.", 1) if k.startswith("classifier.") else k: v
          for k, v in sd.items()}
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert missing == ["classifier.scales"] and not unexpected, (missing, unexpected)


def build_optimizer(model, args):
    return torch.optim.SGD([model.classifier.scales], lr=args.lr, momentum=0.9, weight_decay=args.wd)


@torch.no_grad()
def evaluate(net, loader, many_shot, few_shot, device):
    net.eval()
    nc = many_shot.numel()
    correct = torch.zeros(nc, device=device)
    total = torch.zeros(nc, device=device)
    for imgs, labels in loader:
        imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        pred = net(imgs).argmax(1)
        total += torch.bincount(labels, minlength=nc)
        correct += torch.bincount(labels[pred == labels], minlength=nc)
    dist.all_reduce(correct)
    dist.all_reduce(total)
    acc = correct / total.clamp(min=1)
    medium = ~many_shot & ~few_shot
    return (correct.sum() / total.sum()).item(), acc[many_shot].mean().item(), \
        acc[medium].mean().item(), acc[few_shot].mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", default="/datasets/ILSVRC2012")
    parser.add_argument("--lists", default="data/ImageNet_LT")
    parser.add_argument("--stage1-ckpt", required=True)
    parser.add_argument("--work-dir", default="work_dirs/lws")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU (8 GPUs -> 512)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    # lr 0.2 is for a global batch of 512
    args.lr = args.lr * args.batch_size * world / 512

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = ImageNetLT(args.data_root, os.path.join(args.lists, "ImageNet_LT_train.txt"),
                           transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                               transforms.ToTensor(), norm]))
    test_set = ImageNetLT(args.data_root, os.path.join(args.lists, "ImageNet_LT_test.txt"),
                          transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                              transforms.ToTensor(), norm]))
    train_counts = torch.bincount(train_set.targets, minlength=1000).to(device)
    many_shot, few_shot = train_counts > 100, train_counts < 20

    sampler = BalancedDistSampler(train_set.targets, world, rank)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_part = torch.utils.data.Subset(test_set, range(rank, len(test_set), world))
    test_loader = DataLoader(test_part, batch_size=200, num_workers=args.workers, pin_memory=True)

    net = LTNet(num_classes=1000)
    load_stage1(net, args.stage1_ckpt)
    for p in net.parameters():
        p.requires_grad_(False)
    net.classifier.scales.requires_grad_(True)
    net.to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = build_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        model.module.backbone.eval()  # frozen BN statistics
        for it, (imgs, labels) in enumerate(train_loader):
            imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(imgs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                log.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        top1, many, med, few = evaluate(model.module, test_loader, many_shot, few_shot, device)
        log.info("epoch %d: top1 %.2f | many %.2f medium %.2f few %.2f",
                 epoch, 100 * top1, 100 * many, 100 * med, 100 * few)
        if rank == 0:
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, "lws_latest.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
