# Places-LT: ImageNet-pretrained ResNet-152 fine-tuned with class-balanced focal loss
# (Cui et al., "Class-Balanced Loss Based on Effective Number of Samples", CVPR 2019).
#
#   torchrun --standalone --nproc_per_node=4 places_lt_focal.py \
#       --data /data/places365_standard --lists /data/Places_LT --beta 0.9999 --gamma 1.0
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_args():
    parser = argparse.ArgumentParser("Places-LT CB focal")
    parser.add_argument("--data", default="/data/places365_standard")
    parser.add_argument("--lists", default="/data/Places_LT")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr-backbone", type=float, default=0.001)
    parser.add_argument("--lr-head", type=float, default=0.01)
    parser.add_argument("--beta", type=float, default=0.9999)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output-dir", default="output/places_lt_cbfocal")
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--checkpoint", default="")
    return parser.parse_args()


class PlacesLT(Dataset):
    def __init__(self, root, txt, transform):
        self.root, self.transform = root, transform
        self.paths, self.labels = [], []
        with open(txt) as f:
            for line in f:
                p, y = line.strip().rsplit(" ", 1)
                self.paths.append(p)
                self.labels.append(int(y))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(os.path.join(self.root, self.paths[i]), "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), self.labels[i]


def class_balanced_weights(counts, beta, device="cuda:0"):
    """w_c proportional to (1 - beta) / (1 - beta^n_c), normalised to sum to C."""
    counts = np.asarray(counts, dtype=np.float64)
    effective_num = 1.0 - np.power(beta, counts)
    w = (1.0 - beta) / np.maximum(effective_num, 1e-12)
    w = w / w.sum() * len(counts)
    return torch.tensor(w, dtype=torch.float32, device=device)


class CBFocalLoss(nn.Module):
    def __init__(self, weights, gamma):
        super().__init__()
        self.weights, self.gamma = weights, gamma

    def forward(self, logits, target):
        # sigmoid focal loss on one-hot targets, as in the paper
        onehot = F.one_hot(target, logits.size(1)).float()
        bce = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")
        p = torch.sigmoid(logits)
        p_t = p * onehot + (1 - p) * (1 - onehot)
        loss = (1 - p_t) ** self.gamma * bce
        w = self.weights[target].unsqueeze(1)
        return (w * loss).sum() / onehot.sum()


def split_accuracy(correct, total, train_counts):
    acc = correct / np.maximum(total, 1)
    many = train_counts > 100
    few = train_counts < 20
    med = ~many & ~few
    return acc[many].mean(), acc[med].mean(), acc[few].mean()


@torch.no_grad()
def run_eval(model, loader, num_classes, device):
    model.eval()
    correct = torch.zeros(num_classes, dtype=torch.float64, device=device)
    total = torch.zeros(num_classes, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        preds = model(images).argmax(dim=1)
        total.index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))
        correct.index_add_(0, labels, (preds == labels).double())
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return correct.cpu().numpy(), total.cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = PlacesLT(args.data, os.path.join(args.lists, "Places_LT_train.txt"), T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
        T.ColorJitter(0.4, 0.4, 0.4, 0), T.ToTensor(), normalize]))
    test_set = PlacesLT(args.data, os.path.join(args.lists, "Places_LT_test.txt"), T.Compose([
        T.Resize(256), T.CenterCrop(224), T.ToTensor(), normalize]))
    num_classes = 365
    train_counts = np.bincount(train_set.labels, minlength=num_classes)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided shards, no padding: each test image is counted exactly once
    test_subset = torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_subset, batch_size=100, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnet152(weights="IMAGENET1K_V1")
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu")
        model.module.load_state_dict(state["model"])

    if args.eval_only:
        correct, total = run_eval(model, test_loader, num_classes, device)
        if is_main:
            many, med, few = split_accuracy(correct, total, train_counts)
            print(f"top1 {100 * correct.sum() / total.sum():.2f}  many {100 * many:.2f}  "
                  f"medium {100 * med:.2f}  few {100 * few:.2f}")
        dist.destroy_process_group()
        return

    weights = class_balanced_weights(train_counts, args.beta)
    criterion = CBFocalLoss(weights, args.gamma)

    head = [p for n, p in model.module.named_parameters() if n.startswith("fc.")]
    body = [p for n, p in model.module.named_parameters() if not n.startswith("fc.")]
    scale = world_size * args.batch_size / 256
    optimizer = torch.optim.SGD([
        {"params": body, "lr": args.lr_backbone * scale},
        {"params": head, "lr": args.lr_head * scale},
    ], momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        running = torch.zeros(2, device=device)
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach() * labels.numel(), torch.tensor(float(labels.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(running)

        correct, total = run_eval(model, test_loader, num_classes, device)
        if is_main:
            many, med, few = split_accuracy(correct, total, train_counts)
            top1 = correct.sum() / total.sum()
            print(f"[{epoch + 1}/{args.epochs}] loss {running[0].item() / running[1].item():.4f} "
                  f"top1 {100 * top1:.2f} many {100 * many:.2f} med {100 * med:.2f} few {100 * few:.2f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "top1": top1}
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.output_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
