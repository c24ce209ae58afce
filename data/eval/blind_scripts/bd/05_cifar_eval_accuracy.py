"""
CIFAR-10 classifier, multi-GPU version of the "Training a Classifier" tutorial
(https://pytorch.org/tutorials/beginner/blitz/cifar10_tutorial.html)

The network is a little bigger than the tutorial one (two conv blocks with
BatchNorm), and training/testing is spread over all GPUs with DDP.

    torchrun --nproc_per_node=4 05_cifar_eval_accuracy.py --epochs 30
"""
import os
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import torchvision
import torchvision.transforms as transforms

classes = ('plane', 'car', 'bird', 'cat', 'deer',
           'dog', 'frog', 'horse', 'ship', 'truck')


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
        )
        self.block2 = nn.Sequential(
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
        )
        self.fc1 = nn.Linear(128 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = self.block1(x)
        x = self.block2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, 0.3, training=self.training)
        return self.fc2(x)


def ddp_setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def get_loaders(args, rank, world_size):
    transform_train = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    transform_test = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])

    if rank == 0:
        # download once
        torchvision.datasets.CIFAR10(root=args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(root=args.data, train=False, download=True)
    dist.barrier()

    trainset = torchvision.datasets.CIFAR10(root=args.data, train=True, transform=transform_train)
    testset = torchvision.datasets.CIFAR10(root=args.data, train=False, transform=transform_test)

    train_sampler = DistributedSampler(trainset, shuffle=True)
    test_sampler = DistributedSampler(testset, shuffle=False)

    trainloader = DataLoader(trainset, batch_size=args.batch_size, sampler=train_sampler,
                             num_workers=4, pin_memory=True)
    testloader = DataLoader(testset, batch_size=args.batch_size, sampler=test_sampler,
                            num_workers=4, pin_memory=True)
    return trainloader, testloader, train_sampler


def test(net, testloader, device):
    net.eval()
    correct = 0
    total = 0
    correct_pred = {classname: 0 for classname in classes}
    total_pred = {classname: 0 for classname in classes}
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
            for label, prediction in zip(labels, predicted):
                if label == prediction:
                    correct_pred[classes[label]] += 1
                total_pred[classes[label]] += 1
    return correct, total, correct_pred, total_pred


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--save", default="cifar_net.pth")
    args = parser.parse_args()

    local_rank = ddp_setup()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    trainloader, testloader, train_sampler = get_loaders(args, rank, world_size)

    net = Net().to(device)
    net = DDP(net, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss()
    # 4 GPUs x 32 = 128 images per step, so lr x world_size
    optimizer = optim.SGD(net.parameters(), lr=args.lr * world_size, momentum=0.9, weight_decay=5e-4)
    scheduler = optim.lr_scheduler.MultiStepLR(optimizer, milestones=[15, 25], gamma=0.1)

    best_acc = 0
    for epoch in range(args.epochs):  # loop over the dataset multiple times
        train_sampler.set_epoch(epoch)
        net.train()
        running_loss = 0.0
        start = time.time()
        for i, data in enumerate(trainloader, 0):
            # get the inputs; data is a list of [inputs, labels]
            inputs, labels = data[0].to(device), data[1].to(device)

            # zero the parameter gradients
            optimizer.zero_grad()

            # forward + backward + optimize
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()

            # print statistics
            running_loss += loss.item()
            if i % 100 == 99 and rank == 0:    # print every 100 mini-batches
                print(f'[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 100:.3f}')
                running_loss = 0.0
        scheduler.step()

        correct, total, correct_pred, total_pred = test(net, testloader, device)
        acc = 100 * correct / total

        if rank == 0:
            print(f'epoch {epoch + 1} done in {time.time() - start:.1f}s')
            print(f'Accuracy of the network on the 10000 test images: {acc:.2f} %')
            if acc > best_acc:
                best_acc = acc
                torch.save(net.module.state_dict(), args.save)
                print(f'saved model with acc {best_acc:.2f} to {args.save}')

    if rank == 0:
        # print accuracy for each class (last epoch)
        for classname, correct_count in correct_pred.items():
            accuracy = 100 * float(correct_count) / total_pred[classname]
            print(f'Accuracy for class: {classname:5s} is {accuracy:.1f} %')
        print('Finished Training')

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
