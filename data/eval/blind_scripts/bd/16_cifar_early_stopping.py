"""
CIFAR-10 CNN with early stopping, DDP.

EarlyStopping class is from Bjarte Sunde's pytorchtools (early-stopping-pytorch).
Validation is done by rank 0 on a fixed 5k hold-out split of the training set.

    torchrun --nproc_per_node=4 16_cifar_early_stopping.py --max-epochs 100 --patience 7
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as T


class EarlyStopping:
    """Early stops the training if validation loss doesn't improve after a given patience."""
    def __init__(self, patience=7, verbose=False, delta=0, path='checkpoint.pt', trace_func=print):
        self.patience = patience
        self.verbose = verbose
        self.counter = 0
        self.best_score = None
        self.early_stop = False
        self.val_loss_min = np.Inf
        self.delta = delta
        self.path = path
        self.trace_func = trace_func

    def __call__(self, val_loss, model):
        score = -val_loss
        if self.best_score is None:
            self.best_score = score
            self.save_checkpoint(val_loss, model)
        elif score < self.best_score + self.delta:
            self.counter += 1
            self.trace_func(f'EarlyStopping counter: {self.counter} out of {self.patience}')
            if self.counter >= self.patience:
                self.early_stop = True
        else:
            self.best_score = score
            self.save_checkpoint(val_loss, model)
            self.counter = 0

    def save_checkpoint(self, val_loss, model):
        '''Saves model when validation loss decrease.'''
        if self.verbose:
            self.trace_func(f'Validation loss decreased ({self.val_loss_min:.6f} --> {val_loss:.6f}).  Saving model ...')
        torch.save(model.state_dict(), self.path)
        self.val_loss_min = val_loss


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.3),
            nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.4),
        )
        self.fc = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))


def validate(model, loader, device):
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction='sum').item()
            correct += (out.argmax(1) == y).sum().item()
            n += y.size(0)
    return loss_sum / n, correct / n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--data', default='./data')
    parser.add_argument('--max-epochs', type=int, default=100)
    parser.add_argument('--patience', type=int, default=7)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--ckpt', default='cifar_cnn_earlystop.pt')
    args = parser.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    device = torch.device('cuda', local_rank)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.ToTensor(), norm])

    if rank == 0:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()

    # two views of the same files: augmented for training, plain for validation
    train_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf)
    val_full = torchvision.datasets.CIFAR10(args.data, train=True, transform=val_tf)
    # fixed permutation (same seed on every rank) -> same split everywhere
    perm = torch.randperm(len(train_full), generator=torch.Generator().manual_seed(0)).tolist()
    train_set = Subset(train_full, perm[5000:])
    val_set = Subset(val_full, perm[:5000])

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=500, shuffle=False, num_workers=2)

    model = CNN().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    early_stopping = EarlyStopping(patience=args.patience, verbose=True, path=args.ckpt)

    for epoch in range(1, args.max_epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        train_losses = []
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            train_losses.append(loss.item())

        if rank == 0:
            val_loss, val_acc = validate(model.module, val_loader, device)
            print(f'[{epoch:3d}/{args.max_epochs}] train_loss: {np.average(train_losses):.5f} '
                  f'valid_loss: {val_loss:.5f} valid_acc: {val_acc * 100:.2f}% ({time.time() - t0:.1f}s)')
            early_stopping(val_loss, model.module)

        if rank == 0 and early_stopping.early_stop:
            print("Early stopping")
            break

    if rank == 0:
        # load the last checkpoint with the best model
        model.module.load_state_dict(torch.load(args.ckpt, map_location=device))
        test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=val_tf)
        test_loader = DataLoader(test_set, batch_size=500, shuffle=False, num_workers=2)
        test_loss, test_acc = validate(model.module, test_loader, device)
        print(f'test loss {test_loss:.4f}  test acc {test_acc * 100:.2f}%')

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
