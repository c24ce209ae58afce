"""
MNIST classifier + 2-D embedding visualisation, trained on multiple GPUs.

After training, rank 0 pushes the test set through the network, takes the
embedding head output and saves a scatter plot (embeddings.png).

    python 12_mnist_embedding_tsne.py --epochs 8 --gpus 4
"""
import argparse
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


class EmbedNet(nn.Module):
    def __init__(self, emb_dim=2):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(64 * 7 * 7, 128)
        self.classifier = nn.Linear(128, 10)
        # small head used to look at the learned feature space
        self.embedding_head = nn.Linear(128, emb_dim)

    def forward(self, x, return_embedding=False):
        h = self.features(x).flatten(1)
        h = F.relu(self.fc(h))
        if return_embedding:
            return self.embedding_head(h)
        return self.classifier(h)


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12356"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def train_epoch(model, loader, opt, device, epoch, rank):
    model.train()
    total, n = 0.0, 0
    for batch_idx, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        total += loss.item() * x.size(0)
        n += x.size(0)
        if rank == 0 and batch_idx % 100 == 0:
            print(f"  epoch {epoch} batch {batch_idx}/{len(loader)} loss {loss.item():.4f}")
    return total / n


@torch.no_grad()
def test_accuracy(model, loader, device):
    model.eval()
    correct, n = 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum().item()
        n += y.size(0)
    return correct / n


@torch.no_grad()
def plot_embeddings(model, loader, device, path):
    model.eval()
    embs, labels = [], []
    for x, y in loader:
        embs.append(model(x.to(device), return_embedding=True).cpu())
        labels.append(y)
    embs = torch.cat(embs).numpy()
    labels = torch.cat(labels).numpy()
    plt.figure(figsize=(8, 8))
    sc = plt.scatter(embs[:, 0], embs[:, 1], c=labels, cmap="tab10", s=2)
    plt.legend(*sc.legend_elements(), title="digit")
    plt.savefig(path, dpi=150)
    plt.close()


def run(rank, world_size, args):
    setup(rank, world_size)
    device = torch.device(f"cuda:{rank}")
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(args.data, train=True, download=False, transform=tf)
    test_set = datasets.MNIST(args.data, train=False, download=False, transform=tf)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=1000, shuffle=False, num_workers=2)

    model = EmbedNet(emb_dim=2).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss = train_epoch(model, train_loader, opt, device, epoch, rank)
        sched.step()
        if rank == 0:
            acc = test_accuracy(model.module, test_loader, device)
            print(f"epoch {epoch}: train loss {loss:.4f} | test acc {acc * 100:.2f}%")
            torch.save({"epoch": epoch,
                        "model_state_dict": model.module.state_dict(),
                        "optimizer_state_dict": opt.state_dict()}, args.ckpt)
        dist.barrier()

    if rank == 0:
        plot_embeddings(model.module, test_loader, device, "embeddings.png")
        print("saved embeddings.png")

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="./data")
    parser.add_argument("--ckpt", default="embednet.pt")
    args = parser.parse_args()

    # get the data before the workers start
    datasets.MNIST(args.data, train=True, download=True)
    datasets.MNIST(args.data, train=False, download=True)

    mp.spawn(run, args=(args.gpus, args), nprocs=args.gpus, join=True)
