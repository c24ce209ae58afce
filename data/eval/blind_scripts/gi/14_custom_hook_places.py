"""
ResNet-101 on Places365 with a custom DDP communication hook.

Large gradient buckets are sent as fp16 (pre-divided by the world size so the
sum cannot overflow), small buckets (biases, BN params, the last one) stay in
fp32 since they are latency bound anyway. Optional auxiliary classifier on
the layer3 features (deep supervision), controlled by --aux-weight.

    torchrun --nproc_per_node=8 14_custom_hook_places.py --data /datasets/places365_standard
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


class HookState:
    def __init__(self, process_group, min_fp16_numel=1 << 18):
        self.process_group = process_group
        self.min_fp16_numel = min_fp16_numel
        self.world_size = dist.get_world_size(process_group)


def mixed_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if buffer.numel() < state.min_fp16_numel:
        buffer.div_(state.world_size)
        fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    compressed = buffer.to(torch.float16).div_(state.world_size)
    fut = dist.all_reduce(compressed, group=state.process_group, async_op=True).get_future()

    def decompress(f):
        out = bucket.buffer()
        out.copy_(f.value()[0])
        return out

    return fut.then(decompress)


class ResNetWithAux(nn.Module):
    def __init__(self, num_classes, aux_weight=0.0):
        super().__init__()
        net = torchvision.models.resnet101(weights=None)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.fc = nn.Linear(2048, num_classes)
        self.aux_head = nn.Sequential(
            nn.Conv2d(1024, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, num_classes),
        )
        self.aux_weight = aux_weight

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        c3 = self.layer3(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layer4(c3), 1), 1))
        if self.training and self.aux_weight > 0:
            return logits, self.aux_head(c3)
        return logits, None


def make_loaders(root, bs, workers):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(os.path.join(root, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val = torchvision.datasets.ImageFolder(os.path.join(root, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    ts = DistributedSampler(train, shuffle=True)
    vs = DistributedSampler(val, shuffle=False)
    return (DataLoader(train, bs, sampler=ts, num_workers=workers, pin_memory=True, drop_last=True),
            DataLoader(val, bs, sampler=vs, num_workers=workers, pin_memory=True), ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    ap.add_argument("--aux-weight", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default="runs/places_r101")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    train_loader, val_loader, train_sampler = make_loaders(args.data, args.batch_size, args.workers)
    num_classes = len(train_loader.dataset.classes)

    model = ResNetWithAux(num_classes, aux_weight=args.aux_weight)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=32)
    model.register_comm_hook(HookState(dist.group.WORLD), mixed_compress_hook)

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{num_classes} classes, lr {lr:.3f}, world {world}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, aux = model(images)
                loss = F.cross_entropy(logits, target)
                if aux is not None:
                    loss = loss + args.aux_weight * F.cross_entropy(aux, target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"scale {scaler.get_scale():.0f}")

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for images, target in val_loader:
                images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
                target = target.to(device, non_blocking=True)
                logits, _ = model(images)
                stats[0] += (logits.argmax(1) == target).sum()
                stats[1] += target.numel()
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch} top1 {acc * 100:.2f}% ({time.time() - t0:.0f}s)")
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch, "acc": acc}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
