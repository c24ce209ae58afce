#!/usr/bin/env python
# Linear probing of an MAE-pretrained ViT-B/16 on ImageNet-1k (frozen encoder, LARS on the head).
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as transforms
from torchvision import datasets


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0, (g["trust_coefficient"] * param_norm / update_norm), one),
                                    one)
                    dp = dp.mul(q)
                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def get_args_parser():
    parser = argparse.ArgumentParser("MAE linear probing", add_help=False)
    parser.add_argument("--batch_size", default=512, type=int, help="per GPU")
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("--model", default="vit_base_patch16_224", type=str)
    parser.add_argument("--finetune", default="", help="MAE pre-trained checkpoint")
    parser.add_argument("--global_pool", action="store_true")
    parser.add_argument("--weight_decay", type=float, default=0)
    parser.add_argument("--blr", type=float, default=0.1)
    parser.add_argument("--min_lr", type=float, default=0.0)
    parser.add_argument("--warmup_epochs", type=int, default=10)
    parser.add_argument("--data_path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--nb_classes", default=1000, type=int)
    parser.add_argument("--output_dir", default="./output_linprobe")
    parser.add_argument("--num_workers", default=10, type=int)
    parser.add_argument("--eval", action="store_true")
    return parser


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def load_pretrained(model, path):
    checkpoint = torch.load(path, map_location="cpu")
    checkpoint_model = checkpoint["model"]
    state_dict = model.state_dict()
    for k in ["head.weight", "head.bias"]:
        if k in checkpoint_model and checkpoint_model[k].shape != state_dict[k].shape:
            del checkpoint_model[k]
    msg = model.load_state_dict(checkpoint_model, strict=False)
    assert set(msg.missing_keys) <= {"head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"}, msg
    return msg


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = nn.CrossEntropyLoss()
    model.eval()
    correct1, correct5, total, loss_sum = 0, 0, 0, 0.0
    for images, target in data_loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        _, pred = output.topk(5, 1, True, True)
        hits = pred.eq(target.view(-1, 1))
        correct1 += hits[:, :1].sum().item()
        correct5 += hits.sum().item()
        total += images.shape[0]
        loss_sum += loss.item() * images.shape[0]
    return {"acc1": 100.0 * correct1 / total, "acc5": 100.0 * correct5 / total, "loss": loss_sum / total}


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    transform_train = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=3),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    transform_val = transforms.Compose([
        transforms.Resize(256, interpolation=3),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, "train"), transform=transform_train)
    dataset_val = datasets.ImageFolder(os.path.join(args.data_path, "val"), transform=transform_val)

    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=world_size, rank=rank, shuffle=True)
    sampler_val = torch.utils.data.DistributedSampler(dataset_val, num_replicas=world_size, rank=rank, shuffle=False)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    data_loader_val = torch.utils.data.DataLoader(dataset_val, sampler=sampler_val, batch_size=args.batch_size,
                                                  num_workers=args.num_workers, pin_memory=True, drop_last=False)

    model = timm.create_model(args.model, num_classes=args.nb_classes, global_pool="avg" if args.global_pool else "token")
    if args.finetune and not args.eval:
        msg = load_pretrained(model, args.finetune)
        if rank == 0:
            print(msg)
    nn.init.trunc_normal_(model.head.weight, std=0.01)
    nn.init.zeros_(model.head.bias)

    # freeze everything but the head
    for _, p in model.named_parameters():
        p.requires_grad = False
    for _, p in model.head.named_parameters():
        p.requires_grad = True
    model.to(device)

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    eff_batch_size = args.batch_size * world_size
    args.lr = args.blr * eff_batch_size / 256
    if rank == 0:
        print(f"lr: {args.lr:.4f}  effective batch size: {eff_batch_size}")

    optimizer = LARS(model_without_ddp.head.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss()
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    if args.eval:
        ckpt = torch.load(os.path.join(args.output_dir, "checkpoint-best.pth"), map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        stats = evaluate(data_loader_val, model, device)
        if rank == 0:
            print(f"Accuracy of the network on the {len(dataset_val)} test images: {stats['acc1']:.1f}%")
        dist.destroy_process_group()
        return

    max_accuracy = 0.0
    start_time = time.time()
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        n_steps = len(data_loader_train)
        for it, (samples, targets) in enumerate(data_loader_train):
            lr = adjust_learning_rate(optimizer, it / n_steps + epoch, args)
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(outputs, targets)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}][{it}/{n_steps}] loss {loss.item():.4f} lr {lr:.5f}")

        test_stats = evaluate(data_loader_val, model, device)
        if rank == 0:
            print(f"Accuracy of the network on the {len(dataset_val)} test images: {test_stats['acc1']:.1f}%")
            if test_stats["acc1"] > max_accuracy:
                max_accuracy = test_stats["acc1"]
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "args": vars(args)},
                           os.path.join(args.output_dir, "checkpoint-best.pth"))
            print(f"Max accuracy: {max_accuracy:.2f}%")
            log_stats = {**{f"test_{k}": v for k, v in test_stats.items()}, "epoch": epoch,
                         "time": time.time() - start_time}
            with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                f.write(json.dumps(log_stats) + "\n")

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
