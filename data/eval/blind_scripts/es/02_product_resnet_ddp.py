"""ResNet-50 with an auxiliary head on the product-image catalogue (plain DDP version).

The accelerate version of this trainer lives in train_accel.py; this one is kept on
torchrun because the cluster images here do not ship accelerate configs.

    torchrun --standalone --nproc_per_node=8 02_product_resnet_ddp.py --data /data/products
"""
import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="ImageFolder root with train/ and val/")
    p.add_argument("--out", default="checkpoints/products_r50")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--aux-epochs", type=int, default=10, help="train the layer3 head for this many epochs")
    p.add_argument("--aux-weight", type=float, default=0.3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ResNetWithAux(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)
        self.aux_head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                      nn.Linear(1024, num_classes))

    def forward(self, x, with_aux=False):
        x = self.stem(x)
        x = self.layer2(self.layer1(x))
        feat3 = self.layer3(x)
        x = self.layer4(feat3)
        logits = self.fc(torch.flatten(self.pool(x), 1))
        if with_aux:
            return logits, self.aux_head(feat3)
        return logits


def build_loaders(args, rank, world_size):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(),
        normalize,
    ])
    val_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize,
    ])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # validation runs on rank 0 only over the whole split, so no sampler here
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=args.workers, pin_memory=True)
    return train_set, train_sampler, train_loader, val_loader


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    correct = total = 0
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(images)
        correct += (logits.argmax(1) == target).sum().item()
        total += target.numel()
    net.train()
    return correct / total


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # rank 0 validates the full split while the others wait in the barrier
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    set_seed(args.seed)

    train_set, train_sampler, train_loader, val_loader = build_loaders(args, rank, world_size)
    num_classes = len(train_set.classes)

    model = ResNetWithAux(num_classes).to(device)
    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    # the aux head stops receiving gradients after --aux-epochs
    model = DDP(model, device_ids=[local_rank], output_device=local_rank, find_unused_parameters=True)

    global_batch = args.batch_size * world_size
    lr = args.base_lr * global_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world_size} GPUs, global batch {global_batch}, lr {lr:.3f}, {num_classes} classes", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        use_aux = epoch < args.aux_epochs
        loss_sum = torch.zeros(2, device=device)
        t0 = time.time()
        for it, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if use_aux:
                    logits, aux_logits = model(images, with_aux=True)
                    loss = F.cross_entropy(logits, target) + args.aux_weight * F.cross_entropy(aux_logits, target)
                else:
                    logits = model(images)
                    loss = F.cross_entropy(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach() * target.size(0)
            loss_sum[1] += target.size(0)
            if it % 100 == 0 and rank == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
        scheduler.step()

        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        epoch_loss = (loss_sum[0] / loss_sum[1]).item()

        if rank == 0:
            acc = validate(model.module, val_loader, device)
            is_best = acc > best_acc
            best_acc = max(acc, best_acc)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_acc": best_acc,
                "classes": train_set.classes,
            }
            torch.save(state, os.path.join(args.out, "last.pt"))
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pt"))
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": epoch_loss, "val_acc": acc}) + "\n")
            print(f"epoch {epoch}: train loss {epoch_loss:.4f} val acc {acc:.4f} best {best_acc:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
