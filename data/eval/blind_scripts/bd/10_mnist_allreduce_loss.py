"""
mnist_ddp.py -- learning DDP, step 3: average the training loss over all GPUs

Each GPU only sees 1/N of the data, so the loss printed by one process is only
the loss on its own part. Here every process computes its mean epoch loss and
we all_reduce it so rank 0 can print the real average.

Run it with torchrun:
    torchrun --nproc_per_node=4 10_mnist_allreduce_loss.py
"""
import os
import argparse
from datetime import datetime

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
import torchvision
from torchvision import transforms


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument('--epochs', default=10, type=int)
    parser.add_argument('--batch-size', default=100, type=int)
    parser.add_argument('--lr', default=1e-4, type=float)
    parser.add_argument('--data', default='./data', type=str)
    parser.add_argument('--save', default='model_mnist.ckpt', type=str)
    return parser.parse_args()


def test(model, device, test_loader):
    model.eval()
    correct = 0
    total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            images = images.to(device)
            labels = labels.to(device)
            outputs = model(images)
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    return 100 * correct / total


def main():
    args = parse()

    local_rank = int(os.environ['LOCAL_RANK'])
    rank = int(os.environ['RANK'])
    world_size = int(os.environ['WORLD_SIZE'])

    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    device = torch.device('cuda:%d' % local_rank)

    torch.manual_seed(0)
    model = ConvNet().to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)

    # Data loading code
    if rank == 0:
        torchvision.datasets.MNIST(root=args.data, train=True, download=True)
        torchvision.datasets.MNIST(root=args.data, train=False, download=True)
    dist.barrier()

    train_dataset = torchvision.datasets.MNIST(root=args.data, train=True,
                                               transform=transforms.ToTensor(), download=False)
    test_dataset = torchvision.datasets.MNIST(root=args.data, train=False,
                                              transform=transforms.ToTensor(), download=False)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(dataset=train_dataset, batch_size=args.batch_size,
                              shuffle=False, num_workers=2, pin_memory=True,
                              sampler=train_sampler)
    test_loader = DataLoader(dataset=test_dataset, batch_size=args.batch_size,
                             shuffle=False, num_workers=2)

    start = datetime.now()
    total_step = len(train_loader)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running_loss = 0.0
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            # Forward pass
            outputs = model(images)
            loss = criterion(outputs, labels)

            # Backward and optimize
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            running_loss += loss.item()
            if (i + 1) % 100 == 0 and rank == 0:
                print('Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}'.format(
                    epoch + 1, args.epochs, i + 1, total_step, loss.item()))

        # average epoch loss over all processes
        epoch_loss = torch.tensor([running_loss / total_step])
        dist.all_reduce(epoch_loss, op=dist.ReduceOp.SUM)
        epoch_loss /= world_size

        if rank == 0:
            acc = test(model.module, device, test_loader)
            print('Epoch [{}/{}] mean train loss (all GPUs): {:.4f}  test acc: {:.2f}%'.format(
                epoch + 1, args.epochs, epoch_loss.item(), acc))
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), args.save)

    if rank == 0:
        print("Training complete in: " + str(datetime.now() - start))
        print("Best test accuracy: {:.2f}%".format(best_acc))

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
