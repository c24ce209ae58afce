#!/usr/bin/env python3
"""
Stanford Dogs (120 breeds) - ResNet-50 fine-tune on the two machines I have:

    node0  192.168.2.2   RTX 3070 8GB
    node1  192.168.2.9   GTX 1080 Ti 11GB (Pascal, no tensor cores)

    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=<0|1> \
        --master_addr=192.168.2.2 --master_port=29500 dogs_r50.py --amp

Data: ~/data/stanford_dogs/{train,test} in ImageFolder layout on both nodes.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.expanduser("~/data/stanford_dogs"))
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--save-dir", default="checkpoints/dogs_r50")
    return ap.parse_args()


def build_data(args):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.25, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(),
        norm,
        transforms.RandomErasing(p=0.1),
    ])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    test = datasets.ImageFolder(os.path.join(args.data, "test"), test_tf)
    return train, test


def run_epoch(model, loader, optimizer, scaler, criterion, device, use_amp, train=True):
    model.train(train)
    totals = torch.zeros(3, device=device)  # loss*n, correct, n
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            logits = model(images)
            loss = criterion(logits, labels)
        if train:
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        n = labels.size(0)
        totals += torch.stack([loss.detach().float() * n,
                               (logits.argmax(1) == labels).sum().float(),
                               torch.tensor(float(n), device=device)])
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    # fp16 autocast only pays off with tensor cores (Volta+); on the 1080 Ti
    # it is slower than plain fp32, so keep that card in fp32
    major, minor = torch.cuda.get_device_capability(device)
    use_amp = args.amp and major >= 7
    print(f"rank {rank}: {torch.cuda.get_device_name(device)} sm_{major}{minor} amp={use_amp}", flush=True)

    train_set, test_set = build_data(args)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=100, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    model.fc = nn.Linear(model.fc.in_features, len(train_set.classes))
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9,
                                weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=use_amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    history = []
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_loss, tr_acc = run_epoch(model, train_loader, optimizer, scaler, criterion, device,
                                    use_amp, train=True)
        te_loss, te_acc = run_epoch(model, test_loader, optimizer, scaler, criterion, device,
                                    use_amp, train=False)
        scheduler.step()
        if rank == 0:
            row = dict(epoch=epoch, tr_loss=tr_loss, tr_acc=tr_acc, te_loss=te_loss, te_acc=te_acc,
                       lr=scheduler.get_last_lr()[0], secs=round(time.time() - t0, 1))
            history.append(row)
            print(json.dumps(row), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.save_dir, "last.pt"))
            if te_acc > best:
                best = te_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": te_acc},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.save_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
        print(f"best test acc {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
