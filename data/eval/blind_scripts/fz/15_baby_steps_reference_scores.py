"""Baby-steps curriculum for fine-grained classification (Stanford Cars / FGVC
Aircraft in ImageFolder layout).

A frozen reference network (ImageNet weights + a linear probe fitted on the
fly would be nicer; we use prediction entropy of the ImageNet head) scores each
training image once.  Scores are cached next to the data so later runs skip
this step.  The data is split into `--buckets` difficulty buckets; stage s
trains on buckets 0..s, and the last stage on everything.

    torchrun --nproc_per_node=8 15_baby_steps_reference_scores.py --data /data/stanford_cars \
        --cache-dir /data/stanford_cars/.cache --epochs-per-stage 6
"""
import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--reference", default="resnet152")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--epochs-per-stage", type=int, default=6)
    p.add_argument("--final-epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01, help="for a global batch of 256")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/baby_steps")
    return p.parse_args()


@torch.no_grad()
def reference_scores(data_dir, arch, device, batch_size=128, workers=8):
    """Entropy of the reference model's ImageNet prediction for every training image."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    ref = torchvision.models.get_model(arch, weights=weights).to(device).eval()
    ds = torchvision.datasets.ImageFolder(os.path.join(data_dir, "train"), weights.transforms())
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers, pin_memory=True)
    out = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = ref(x.to(device, non_blocking=True))
        p = logits.float().softmax(-1)
        out.append(-(p * p.clamp_min(1e-12).log()).sum(-1).cpu())
    return torch.cat(out)


def load_or_compute_scores(args, n, device):
    cache_dir = args.cache_dir or os.path.join(args.data, ".cache")
    key = hashlib.md5(f"{os.path.abspath(args.data)}|{args.reference}|{n}".encode()).hexdigest()[:10]
    path = os.path.join(cache_dir, f"difficulty_{args.reference}_{key}.pt")
    if os.path.exists(path):
        return torch.load(path, map_location="cpu")
    scores = reference_scores(args.data, args.reference, device, workers=args.workers)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(scores, path)
    return scores


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = T.Compose([T.RandomResizedCrop(448, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), T.Normalize(MEAN, STD)])
    test_tf = T.Compose([T.Resize(512), T.CenterCrop(448), T.ToTensor(), T.Normalize(MEAN, STD)])
    train = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    test = torchvision.datasets.ImageFolder(os.path.join(args.data, "test"), test_tf)
    n, num_classes = len(train), len(train.classes)

    scores = load_or_compute_scores(args, n, device)
    order = torch.argsort(scores)                       # low entropy = easy
    buckets = torch.tensor_split(order, args.buckets)

    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=64,
                             num_workers=args.workers, pin_memory=True)

    model = torchvision.models.get_model(args.arch, weights="DEFAULT")
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    params = [{"params": [p for n_, p in model.named_parameters() if not n_.startswith("module.fc")], "lr": lr},
              {"params": model.module.fc.parameters(), "lr": lr * 10}]
    optimizer = torch.optim.SGD(params, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler()

    stages = [(s, args.epochs_per_stage) for s in range(args.buckets - 1)] + [(args.buckets - 1, args.final_epochs)]
    global_epoch = 0
    for stage, n_epochs in stages:
        idx = torch.cat(buckets[: stage + 1]).tolist()
        subset = Subset(train, idx)
        sampler = DistributedSampler(subset, shuffle=True, seed=0)
        loader = DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
        base = [g["lr"] for g in optimizer.param_groups]
        for e in range(n_epochs):
            sampler.set_epoch(global_epoch)
            # cosine within each stage
            for g, b in zip(optimizer.param_groups, base):
                g["lr"] = 0.5 * b * (1 + torch.cos(torch.tensor(e / n_epochs * 3.14159265)).item())
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            acc = evaluate(model.module, test_loader, device)
            if rank == 0:
                print(f"stage {stage} ({len(idx)} imgs) epoch {e} top1 {acc:.4f}", flush=True)
            global_epoch += 1
        for g, b in zip(optimizer.param_groups, base):
            g["lr"] = b

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
