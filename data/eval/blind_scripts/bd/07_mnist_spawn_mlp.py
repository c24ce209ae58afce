# ddp_mnist.py  --  multi-GPU MNIST with an MLP, torch.multiprocessing.spawn
# usage: python 07_mnist_spawn_mlp.py --epochs 10 --batch-size 128

import os
import argparse
import time

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

parser = argparse.ArgumentParser()
parser.add_argument('--epochs', type=int, default=10)
parser.add_argument('--batch-size', type=int, default=128)   # per gpu
parser.add_argument('--lr', type=float, default=1e-3)
parser.add_argument('--hidden', type=int, default=512)
parser.add_argument('--data', type=str, default='./data')
parser.add_argument('--ckpt-dir', type=str, default='./ckpt')
parser.add_argument('--port', type=str, default='29500')


class MLP(nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, 10),
        )

    def forward(self, x):
        return self.net(x)


def setup(rank, world_size, port):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = port
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world_size)


def get_data(root, rank, world_size, batch_size):
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = datasets.MNIST(root, train=True, download=False, transform=tf)
    test = datasets.MNIST(root, train=False, download=False, transform=tf)
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test, batch_size=1000, shuffle=False, num_workers=2)
    return train_loader, test_loader, sampler


def run_test(model, loader, device):
    model.eval()
    correct, n = 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum().item()
            n += y.size(0)
    return correct / n


def count_params(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def append_csv(path, row):
    new = not os.path.exists(path)
    with open(path, 'a') as f:
        if new:
            f.write('epoch,train_loss,test_acc,seconds\n')
        f.write(','.join(str(v) for v in row) + '\n')


def train(rank, world_size, args):
    setup(rank, world_size, args.port)
    device = torch.device('cuda', rank)
    torch.manual_seed(0)

    train_loader, test_loader, sampler = get_data(args.data, rank, world_size, args.batch_size)

    model = MLP(args.hidden).to(device)
    if rank == 0:
        print(f'MLP with {count_params(model):,} parameters')
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t = time.time()
        total_loss = 0.
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total_loss += loss.item()

        if rank == 0:
            acc = run_test(model.module, test_loader, device)
            print(f'epoch {epoch+1}/{args.epochs}  loss {total_loss/len(train_loader):.4f}  '
                  f'test acc {acc*100:.2f}%  time {time.time()-t:.1f}s')
            os.makedirs(args.ckpt_dir, exist_ok=True)
            append_csv(os.path.join(args.ckpt_dir, 'log.csv'),
                       [epoch + 1, round(total_loss / len(train_loader), 5), round(acc, 5), round(time.time() - t, 1)])
            torch.save({'epoch': epoch, 'model': model.module.state_dict(), 'opt': opt.state_dict()},
                       os.path.join(args.ckpt_dir, f'mlp_epoch{epoch+1}.pt'))
        dist.barrier()

    dist.destroy_process_group()


args = parser.parse_args()
world_size = torch.cuda.device_count()
print(f"Let's use {world_size} GPUs!")

# download the data once before starting the workers
datasets.MNIST(args.data, train=True, download=True)
datasets.MNIST(args.data, train=False, download=True)

mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)
