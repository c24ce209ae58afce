# CIFAR-10 + ResNet-18, multi GPU with DistributedDataParallel
#
# launch with:
#   torchrun --standalone --nproc_per_node=4 02_cifar10_resnet_torchrun.py --epochs 50
#
# (this is for my Deep Learning course project, part 2: "scale it to 4 GPUs")

import os
import time
import argparse

import torch
import torch.nn as nn
import torch.optim as optim
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import torchvision
import torchvision.transforms as transforms


MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument('--data', default='./data')
    p.add_argument('--epochs', type=int, default=50)
    p.add_argument('--batch-size', type=int, default=128, help='per GPU')
    p.add_argument('--lr', type=float, default=0.1)
    p.add_argument('--momentum', type=float, default=0.9)
    p.add_argument('--wd', type=float, default=5e-4)
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--ckpt', default='checkpoints/resnet18_cifar.pth')
    p.add_argument('--resume', action='store_true')
    return p.parse_args()


def build_model():
    # torchvision resnet18, but with the CIFAR stem (3x3 conv, no maxpool)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def get_datasets(root, rank):
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    test_tf = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])

    # only rank 0 downloads, the others wait and then read the files
    if rank == 0:
        torchvision.datasets.CIFAR10(root=root, train=True, download=True)
        torchvision.datasets.CIFAR10(root=root, train=False, download=True)
    dist.barrier()

    trainset = torchvision.datasets.CIFAR10(root=root, train=True, download=False, transform=train_tf)
    testset = torchvision.datasets.CIFAR10(root=root, train=False, download=False, transform=test_tf)
    return trainset, testset


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    criterion = nn.CrossEntropyLoss(reduction='sum')
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        outputs = model(images)
        loss_sum += criterion(outputs, labels).item()
        _, predicted = outputs.max(1)
        total += labels.size(0)
        correct += predicted.eq(labels).sum().item()
    return loss_sum / total, 100.0 * correct / total


def main():
    args = get_args()

    # torchrun sets these for us
    local_rank = int(os.environ['LOCAL_RANK'])
    rank = int(os.environ['RANK'])
    world_size = int(os.environ['WORLD_SIZE'])

    torch.cuda.set_device(local_rank)
    device = torch.device('cuda', local_rank)
    dist.init_process_group(backend='nccl')

    if rank == 0:
        print(f'world size = {world_size}')
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)

    trainset, testset = get_datasets(args.data, rank)

    trainloader = DataLoader(trainset, batch_size=args.batch_size, shuffle=True,
                             num_workers=args.workers, pin_memory=True, drop_last=True)
    # evaluation is only done on rank 0, so a normal loader over the full test set
    testloader = DataLoader(testset, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss()
    # linear scaling rule (Goyal et al.): lr x number of GPUs
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum,
                          weight_decay=args.wd, nesterov=True)
    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch = 0
    best_acc = 0.0
    if args.resume and os.path.isfile(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        start_epoch = ckpt['epoch'] + 1
        best_acc = ckpt['best_acc']
        if rank == 0:
            print(f'resumed from epoch {start_epoch}, best acc {best_acc:.2f}')

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running_loss = 0.0
        correct = 0
        seen = 0

        for i, (inputs, targets) in enumerate(trainloader):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)

            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()

            running_loss += loss.item()
            correct += outputs.argmax(1).eq(targets).sum().item()
            seen += targets.size(0)

            if rank == 0 and i % 50 == 49:
                print(f'[epoch {epoch + 1}, iter {i + 1:4d}] loss: {running_loss / (i + 1):.3f} '
                      f'train acc (rank0): {100.0 * correct / seen:.2f}%')

        scheduler.step()

        if rank == 0:
            test_loss, test_acc = evaluate(model.module, testloader, device)
            print(f'epoch {epoch + 1}/{args.epochs} | {time.time() - t0:.1f}s | '
                  f'test loss {test_loss:.4f} | test acc {test_acc:.2f}% | lr {scheduler.get_last_lr()[0]:.4f}')

            is_best = test_acc > best_acc
            best_acc = max(best_acc, test_acc)
            torch.save({
                'epoch': epoch,
                'model': model.module.state_dict(),
                'optimizer': optimizer.state_dict(),
                'scheduler': scheduler.state_dict(),
                'best_acc': best_acc,
            }, args.ckpt)
            if is_best:
                torch.save(model.module.state_dict(), args.ckpt.replace('.pth', '_best.pth'))

        dist.barrier()

    if rank == 0:
        print(f'Finished Training. best acc = {best_acc:.2f}%')

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
