"""ArcFace (additive angular margin) on CASIA-WebFace / a cleaned in-house face set.

The training list is a text file with one "relative/path.jpg<TAB>identity_name" per line.

    torchrun --nproc_per_node=8 09_arcface_webface.py --root /data/faces/webface_112x112 \
        --train-list /data/faces/webface_112x112/train.tsv --lfw /data/faces/lfw_112x112 --out work/arcface_r50
"""
import argparse
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from backbones import iresnet50

logger = logging.getLogger("arcface")


class FaceList(Dataset):
    def __init__(self, root, list_file, transform):
        self.root = root
        self.transform = transform
        samples = []
        with open(list_file) as f:
            for line in f:
                path, name = line.rstrip("\n").split("\t")
                samples.append((path, name))
        identities = list(set(name for _, name in samples))
        self.class_to_idx = {name: i for i, name in enumerate(identities)}
        self.samples = [(p, self.class_to_idx[n]) for p, n in samples]
        self.num_classes = len(identities)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label = self.samples[idx]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label


class ArcFaceHead(nn.Module):
    def __init__(self, in_features, num_classes, s=64.0, m=0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight)).float()
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = F.one_hot(label, cosine.size(1)).bool()
        logits = torch.where(one_hot, phi, cosine) * self.s
        return logits


class FaceModel(nn.Module):
    def __init__(self, num_classes, emb_size=512):
        super().__init__()
        self.backbone = iresnet50(num_features=emb_size, dropout=0.0)
        self.head = ArcFaceHead(emb_size, num_classes)

    def forward(self, x, label=None):
        emb = self.backbone(x)
        if label is None:
            return emb
        return self.head(emb, label)


def read_lfw_pairs(lfw_dir):
    pairs = []
    with open(os.path.join(lfw_dir, "pairs.txt")) as f:
        for line in f.readlines()[1:]:
            t = line.split()
            if len(t) == 3:
                pairs.append((f"{t[0]}/{t[0]}_{int(t[1]):04d}.jpg", f"{t[0]}/{t[0]}_{int(t[2]):04d}.jpg", 1))
            else:
                pairs.append((f"{t[0]}/{t[0]}_{int(t[1]):04d}.jpg", f"{t[2]}/{t[2]}_{int(t[3]):04d}.jpg", 0))
    return pairs


@torch.no_grad()
def lfw_accuracy(backbone, lfw_dir, transform, device):
    backbone.eval()
    pairs = read_lfw_pairs(lfw_dir)
    cache = {}

    def embed(path):
        if path not in cache:
            img = transform(Image.open(os.path.join(lfw_dir, path)).convert("RGB")).unsqueeze(0).to(device)
            e = backbone(img) + backbone(torch.flip(img, dims=[3]))
            cache[path] = F.normalize(e, dim=1)[0]
        return cache[path]

    sims = np.array([float(embed(a) @ embed(b)) for a, b, _ in pairs])
    issame = np.array([s for _, _, s in pairs], dtype=bool)
    folds = np.array_split(np.arange(len(pairs)), 10)
    accs = []
    for k in range(10):
        test = folds[k]
        train = np.concatenate([folds[j] for j in range(10) if j != k])
        ths = np.arange(-1, 1, 0.005)
        best = ths[np.argmax([((sims[train] > t) == issame[train]).mean() for t in ths])]
        accs.append(((sims[test] > best) == issame[test]).mean())
    backbone.train()
    return float(np.mean(accs)), float(np.std(accs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--lfw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 512")
    ap.add_argument("--epochs", type=int, default=28)
    ap.add_argument("--milestones", type=int, nargs="+", default=[10, 18, 24])
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    train_tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize([0.5] * 3, [0.5] * 3)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    dataset = FaceList(args.root, args.train_list, train_tf)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    logger.info("%d images, %d identities", len(dataset), dataset.num_classes)

    model = FaceModel(dataset.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.1)
    criterion = nn.CrossEntropyLoss()

    writer = SummaryWriter(os.path.join(args.out, "logs")) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            logits = model(img, label)
            loss = criterion(logits, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                with torch.no_grad():
                    acc = (logits.argmax(1) == label).float().mean()
                    stats = torch.stack([loss.detach(), acc])
                    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/acc", stats[1].item(), step)
                    logger.info("epoch %d step %d loss %.4f acc %.4f", epoch, step, stats[0], stats[1])
        scheduler.step()

        if rank == 0:
            acc, std = lfw_accuracy(model.module.backbone, args.lfw, test_tf, device)
            writer.add_scalar("val/lfw", acc, epoch)
            logger.info("epoch %d LFW %.4f +- %.4f", epoch, acc, std)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"backbone": model.module.backbone.state_dict(), "head": model.module.head.state_dict(),
                        "class_to_idx": dataset.class_to_idx, "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch:02d}.pth"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
