'''Train CIFAR10 with PyTorch, multi-GPU (DDP) version.

Model is PreActResNet18 from kuangliu/pytorch-cifar. Launch with the (old)
launcher, it still works and our cluster docs use it:

    python -m torch.distributed.launch --nproc_per_node=4 18_preact_resnet_launch.py --lr 0.1

Older launchers pass "--local_rank=N", newer ones pass "--local-rank=N" (and
torchrun only sets the LOCAL_RANK env var), so all three are accepted below.
'''
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.backends.cudnn as cudnn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import torchvision
import torchvision.transforms as transforms


class PreActBlock(nn.Module):
    '''Pre-activation version of the BasicBlock.'''
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super(PreActBlock, self).__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)

        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False)
            )

    def forward(self, x):
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if hasattr(self, 'shortcut') else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out += shortcut
        return out


class PreActResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10):
        super(PreActResNet, self).__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.layer1 = self._make_layer(block, 64, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, 128, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, 256, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, 512, num_blocks[3], stride=2)
        self.bn = nn.BatchNorm2d(512 * block.expansion)
        self.linear = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block, planes, num_blocks, stride):
        strides = [stride] + [1] * (num_blocks - 1)
        layers = []
        for stride in strides:
            layers.append(block(self.in_planes, planes, stride))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x):
        out = self.conv1(x)
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1)
        out = out.view(out.size(0), -1)
        return self.linear(out)


def PreActResNet18():
    return PreActResNet(PreActBlock, [2, 2, 2, 2])


parser = argparse.ArgumentParser(description='PyTorch CIFAR10 Training (DDP)')
parser.add_argument('--lr', default=0.1, type=float, help='learning rate for batch 128')
parser.add_argument('--epochs', default=200, type=int)
parser.add_argument('--batch-size', default=128, type=int, help='per GPU')
parser.add_argument('--resume', '-r', action='store_true', help='resume from checkpoint')
parser.add_argument('--data', default='./data')
parser.add_argument('--ckpt', default='./checkpoint/ckpt.pth')
parser.add_argument('--local-rank', '--local_rank', dest='local_rank', type=int,
                    default=int(os.environ.get('LOCAL_RANK', 0)))
args = parser.parse_args()

# the launcher also exports LOCAL_RANK; prefer it when it's there
local_rank = int(os.environ.get('LOCAL_RANK', args.local_rank))
torch.cuda.set_device(local_rank)
dist.init_process_group(backend='nccl', init_method='env://')
rank = dist.get_rank()
world_size = dist.get_world_size()
device = torch.device('cuda', local_rank)
cudnn.benchmark = True

best_acc = 0  # best test accuracy
start_epoch = 0  # start from epoch 0 or last checkpoint epoch

# Data
if rank == 0:
    print('==> Preparing data..')
transform_train = transforms.Compose([
    transforms.RandomCrop(32, padding=4),
    transforms.RandomHorizontalFlip(),
    transforms.ToTensor(),
    transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
])
transform_test = transforms.Compose([
    transforms.ToTensor(),
    transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
])

# rank 0 downloads, everybody else waits at the barrier until it is done
if rank != 0:
    dist.barrier()
trainset = torchvision.datasets.CIFAR10(root=args.data, train=True, download=(rank == 0), transform=transform_train)
testset = torchvision.datasets.CIFAR10(root=args.data, train=False, download=(rank == 0), transform=transform_test)
if rank == 0:
    dist.barrier()

train_sampler = DistributedSampler(trainset, shuffle=True)
test_sampler = DistributedSampler(testset, shuffle=False)
trainloader = DataLoader(trainset, batch_size=args.batch_size, sampler=train_sampler, num_workers=2, pin_memory=True)
testloader = DataLoader(testset, batch_size=100, sampler=test_sampler, num_workers=2, pin_memory=True)

# Model
if rank == 0:
    print('==> Building model..')
net = PreActResNet18().to(device)
net = DDP(net, device_ids=[local_rank], output_device=local_rank)

if args.resume:
    # Load checkpoint (every rank reads the same file, onto the CPU first)
    if rank == 0:
        print('==> Resuming from checkpoint..')
    assert os.path.isfile(args.ckpt), 'Error: no checkpoint found!'
    checkpoint = torch.load(args.ckpt, map_location='cpu')
    net.module.load_state_dict(checkpoint['net'])
    best_acc = checkpoint['acc']
    start_epoch = checkpoint['epoch'] + 1

criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(net.parameters(), lr=args.lr * args.batch_size * world_size / 128,
                      momentum=0.9, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
for _ in range(start_epoch):
    scheduler.step()


# Training
def train(epoch):
    net.train()
    train_loss, correct, total = 0, 0, 0
    for batch_idx, (inputs, targets) in enumerate(trainloader):
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()

        train_loss += loss.item()
        _, predicted = outputs.max(1)
        total += targets.size(0)
        correct += predicted.eq(targets).sum().item()
        if rank == 0 and batch_idx % 50 == 0:
            print('  [%d/%d] Loss: %.3f | Acc: %.3f%% (%d/%d)'
                  % (batch_idx, len(trainloader), train_loss / (batch_idx + 1), 100. * correct / total, correct, total))


def test(epoch):
    global best_acc
    net.eval()
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for inputs, targets in testloader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = net(inputs)
            stats[0] += criterion(outputs, targets) * targets.size(0)
            stats[1] += outputs.argmax(1).eq(targets).sum()
            stats[2] += targets.size(0)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    test_loss = (stats[0] / stats[2]).item()
    acc = 100. * (stats[1] / stats[2]).item()
    if rank == 0:
        print('Epoch %d test: loss %.3f | acc %.3f%%' % (epoch, test_loss, acc))

    # Save checkpoint.
    if acc > best_acc:
        if rank == 0:
            print('Saving..')
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            state = {'net': net.module.state_dict(), 'acc': acc, 'epoch': epoch}
            torch.save(state, args.ckpt)
        best_acc = acc
    dist.barrier()


for epoch in range(start_epoch, args.epochs):
    train_sampler.set_epoch(epoch)
    t0 = time.time()
    train(epoch)
    test(epoch)
    scheduler.step()
    if rank == 0:
        print('epoch %d took %.1fs, lr %.5f' % (epoch, time.time() - t0, scheduler.get_last_lr()[0]))

dist.destroy_process_group()
