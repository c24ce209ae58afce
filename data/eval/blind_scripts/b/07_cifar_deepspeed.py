"""
CIFAR-10 ResNet training with DeepSpeed (ZeRO stage 1, fp16).

    deepspeed --num_gpus=4 07_cifar_deepspeed.py --deepspeed --deepspeed_config ds_config.json --epochs 30

ds_config.json:
{
  "train_micro_batch_size_per_gpu": 64,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 5e-4}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6000, "warmup_num_steps": 300}},
  "fp16": {"enabled": true, "initial_scale_power": 15},
  "zero_optimization": {"stage": 1},
  "steps_per_print": 200
}
"""
import argparse
import logging
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as transforms


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR-10 DeepSpeed")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--data_root", type=str, default="./data")
    parser.add_argument("--save_dir", type=str, default="./checkpoints")
    parser.add_argument("--log_interval", type=int, default=50)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, 2, 1)
        self.layer2 = self._make_layer(128, 2, 2)
        self.layer3 = self._make_layer(256, 2, 2)
        self.layer4 = self._make_layer(512, 2, 2)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def setup_logging(rank):
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(message)s", level=level)
    return logging.getLogger("cifar")


def main():
    args = get_args()
    rank = dist.get_rank()
    logger = setup_logging(rank)

    transform_train = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    ])
    transform_test = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    ])

    if rank != 0:
        dist.barrier()  # let rank 0 download the data first
    trainset = torchvision.datasets.CIFAR10(root=args.data_root, train=True, download=True,
                                            transform=transform_train)
    testset = torchvision.datasets.CIFAR10(root=args.data_root, train=False, download=True,
                                           transform=transform_test)
    if rank == 0:
        dist.barrier()

    net = ResNet18()
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

    local_device = model_engine.local_rank
    fp16 = model_engine.fp16_enabled()
    test_sampler = torch.utils.data.distributed.DistributedSampler(testset, shuffle=False)
    testloader = torch.utils.data.DataLoader(testset, batch_size=256, sampler=test_sampler,
                                             num_workers=4, pin_memory=True)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model_engine.train()
        if hasattr(trainloader, "data_sampler") and hasattr(trainloader.data_sampler, "set_epoch"):
            trainloader.data_sampler.set_epoch(epoch)
        t0 = time.time()
        running = 0.0
        for i, (inputs, labels) in enumerate(trainloader):
            inputs = inputs.to(local_device)
            labels = labels.to(local_device)
            if fp16:
                inputs = inputs.half()
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running += loss.item()
            if i % args.log_interval == args.log_interval - 1:
                logger.info(f"epoch {epoch} iter {i + 1} loss {running / args.log_interval:.4f}")
                running = 0.0

        model_engine.eval()
        correct = torch.zeros(1, device=local_device)
        total = torch.zeros(1, device=local_device)
        with torch.no_grad():
            for inputs, labels in testloader:
                inputs = inputs.to(local_device)
                labels = labels.to(local_device)
                if fp16:
                    inputs = inputs.half()
                preds = model_engine(inputs).argmax(dim=1)
                correct += (preds == labels).sum()
                total += labels.numel()
        dist.all_reduce(correct)
        dist.all_reduce(total)
        logger.info(f"epoch {epoch} test acc {100.0 * correct.item() / total.item():.2f}% "
                    f"({time.time() - t0:.1f}s)")

        # save_checkpoint must be called on every rank (ZeRO shards optimizer state)
        model_engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}",
                                     client_state={"epoch": epoch})

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
