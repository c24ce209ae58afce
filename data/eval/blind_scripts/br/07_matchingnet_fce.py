"""Matching Networks with full context embeddings (Vinyals et al., 2016) on Omniglot.

Distributed over GPUs with DDP: every rank trains on its own episodes.
Meta-validation runs on rank 0 on the unwrapped module while the other ranks
wait at the barrier.

    torchrun --nproc_per_node=4 07_matchingnet_fce.py --n-train 20 --k-train 1 --q-train 5
"""
import argparse
import datetime
import os
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--root", default="/data/omniglot")
parser.add_argument("--n-train", type=int, default=20)
parser.add_argument("--k-train", type=int, default=1)
parser.add_argument("--q-train", type=int, default=5)
parser.add_argument("--n-test", type=int, default=5)
parser.add_argument("--k-test", type=int, default=1)
parser.add_argument("--q-test", type=int, default=1)
parser.add_argument("--lstm-layers", type=int, default=1)
parser.add_argument("--unrolling-steps", type=int, default=2)
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--episodes-per-epoch", type=int, default=100)
parser.add_argument("--eval-episodes", type=int, default=1000)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--ckpt", default="models/matching_nets/omniglot_fce.pth")
parser.add_argument("--resume", action="store_true")


class OmniglotDataset(Dataset):
    """images_background for background, images_evaluation for evaluation (Lake split)."""

    def __init__(self, root, subset):
        folder = "images_background" if subset == "background" else "images_evaluation"
        char_dirs = sorted(glob(os.path.join(root, folder, "*", "*")))
        self.paths, self.labels = [], []
        for label, d in enumerate(char_dirs):
            for f in sorted(os.listdir(d)):
                self.paths.append(os.path.join(d, f))
                self.labels.append(label)
        self.labels = np.array(self.labels)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("L").resize((28, 28))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)
        return (x - x.mean()) / (x.std() + 1e-6), self.labels[i]


class NShotTaskSampler:
    def __init__(self, labels, episodes, n, k, q, seed):
        self.by_class = {c: np.flatnonzero(labels == c) for c in np.unique(labels)}
        self.classes = np.array(sorted(self.by_class))
        self.episodes, self.n, self.k, self.q = episodes, n, k, q
        self.rng = np.random.RandomState(seed)

    def __len__(self):
        return self.episodes

    def __iter__(self):
        for _ in range(self.episodes):
            cls = self.rng.choice(self.classes, self.n, replace=False)
            picks = [self.rng.choice(self.by_class[c], self.k + self.q, replace=False) for c in cls]
            support = np.concatenate([p[:self.k] for p in picks])
            query = np.concatenate([p[self.k:] for p in picks])
            yield np.concatenate([support, query]).tolist()


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.MaxPool2d(2))


class AttentionLSTM(nn.Module):
    def __init__(self, size, unrolling_steps):
        super().__init__()
        self.unrolling_steps = unrolling_steps
        self.cell = nn.LSTMCell(size, size)

    def forward(self, support, queries):
        h_hat = torch.zeros_like(queries)
        c = torch.zeros_like(queries)
        for _ in range(self.unrolling_steps):
            h = h_hat + queries
            attention = torch.softmax(h @ support.t(), dim=1)
            readout = attention @ support
            h_hat, c = self.cell(queries, (h + readout, c))
        return h_hat + queries


class MatchingNetwork(nn.Module):
    def __init__(self, lstm_layers, unrolling_steps, emb_dim=64):
        super().__init__()
        self.encoder = nn.Sequential(conv_block(1, 64), conv_block(64, 64),
                                     conv_block(64, 64), conv_block(64, 64), nn.Flatten())
        self.g = nn.LSTM(emb_dim, emb_dim, num_layers=lstm_layers, bidirectional=True)
        self.f = AttentionLSTM(emb_dim, unrolling_steps)

    def forward(self, x, n_support):
        emb = self.encoder(x)
        support, queries = emb[:n_support], emb[n_support:]
        out, _ = self.g(support.unsqueeze(1))
        out = out.squeeze(1)
        d = support.size(1)
        support = support + out[:, :d] + out[:, d:]
        queries = self.f(support, queries)
        # cosine attention over the support set -> class probabilities
        sims = F.normalize(queries, dim=1) @ F.normalize(support, dim=1).t()
        return sims.softmax(dim=1)


def episode_probs(model, x, n, k, device):
    attention = model(x, n * k)
    y_support = torch.arange(n, device=device).repeat_interleave(k)
    onehot = F.one_hot(y_support, n).float()
    return attention @ onehot


@torch.no_grad()
def evaluate(net, loader, n, k, q, device):
    net.eval()
    accs = []
    y = torch.arange(n, device=device).repeat_interleave(q)
    for x, _ in loader:
        probs = episode_probs(net, x.to(device), n, k, device)
        accs.append((probs.argmax(1) == y).float().mean().item())
    net.train()
    accs = np.array(accs)
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def main():
    args = parser.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    background = OmniglotDataset(args.root, "background")
    train_loader = DataLoader(
        background, num_workers=4, pin_memory=True,
        batch_sampler=NShotTaskSampler(background.labels, args.episodes_per_epoch, args.n_train,
                                       args.k_train, args.q_train, seed=1234 + rank))
    if rank == 0:
        evaluation = OmniglotDataset(args.root, "evaluation")
        eval_loader = DataLoader(
            evaluation, num_workers=4,
            batch_sampler=NShotTaskSampler(evaluation.labels, args.eval_episodes, args.n_test,
                                           args.k_test, args.q_test, seed=0))

    net = MatchingNetwork(args.lstm_layers, args.unrolling_steps).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch, best_acc = 1, 0.0
    if args.resume and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{local_rank}"})
        net.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]

    y_query = torch.arange(args.n_train, device=device).repeat_interleave(args.q_train)
    for epoch in range(start_epoch, args.epochs + 1):
        loss_meter = torch.zeros(2, device=device)
        for x, _ in train_loader:
            probs = episode_probs(model, x.to(device, non_blocking=True),
                                  args.n_train, args.k_train, device)
            loss = F.nll_loss(probs.clamp(1e-8, 1 - 1e-8).log(), y_query)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_meter)

        if rank == 0:
            acc, ci = evaluate(net, eval_loader, args.n_test, args.k_test, args.q_test, device)
            print(f"epoch {epoch:3d}  train loss {loss_meter[0] / loss_meter[1]:.4f}  "
                  f"{args.n_test}-way {args.k_test}-shot acc {100 * acc:.2f} +- {100 * ci:.2f}",
                  flush=True)
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            best_acc = max(best_acc, acc)
            torch.save({"model": net.state_dict(), "optimiser": optimiser.state_dict(),
                        "epoch": epoch, "best_acc": best_acc}, args.ckpt)
            if acc >= best_acc:
                torch.save(net.state_dict(), args.ckpt.replace(".pth", "_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
