"""Online (single-pass) ER on Split mini-ImageNet, 20 tasks x 5 classes, with
"anytime" evaluation during the stream and an accuracy matrix at task ends.

Expects the usual mini-imagenet-cache-{train,val,test}.pkl files; all 100
classes are pooled, 500 images per class for training and 100 for testing.

    torchrun --nproc_per_node=4 18_online_er_miniimagenet.py --cache-dir /data/miniimagenet
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet18


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default="/data/miniimagenet")
    ap.add_argument("--out", default="./runs/oer_mini")
    ap.add_argument("--n-tasks", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=10, help="incoming stream batch per GPU")
    ap.add_argument("--mem-batch", type=int, default=10)
    ap.add_argument("--mem-size", type=int, default=2500, help="per GPU")
    ap.add_argument("--iters", type=int, default=3, help="gradient steps per incoming batch")
    ap.add_argument("--lr", type=float, default=0.1, help="single-GPU lr, scaled with the number of GPUs")
    ap.add_argument("--eval-every", type=int, default=200, help="anytime eval period (stream batches)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_mini_imagenet(cache_dir):
    xs, ys, label = [], [], 0
    for split in ("train", "val", "test"):
        with open(os.path.join(cache_dir, f"mini-imagenet-cache-{split}.pkl"), "rb") as f:
            d = pickle.load(f)
        for cls in sorted(d["class_dict"]):
            idx = d["class_dict"][cls]
            xs.append(d["image_data"][idx])
            ys.append(np.full(len(idx), label))
            label += 1
    x = torch.from_numpy(np.concatenate(xs)).permute(0, 3, 1, 2).contiguous()  # uint8 N,3,84,84
    y = torch.from_numpy(np.concatenate(ys)).long()
    return x, y


def split_train_test(x, y, n_train=500):
    tr, te = [], []
    for c in range(int(y.max()) + 1):
        idx = torch.nonzero(y == c).flatten()
        tr.append(idx[:n_train])
        te.append(idx[n_train:])
    tr, te = torch.cat(tr), torch.cat(te)
    return (x[tr], y[tr]), (x[te], y[te])


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def prep(x, device):
    x = x.to(device, non_blocking=True).float()
    return (x - MEAN.to(device)) / STD.to(device)


class Reservoir:
    def __init__(self, size, device):
        self.size, self.device, self.seen = size, device, 0
        self.x = torch.zeros(size, 3, 84, 84, dtype=torch.uint8, device=device)
        self.y = torch.zeros(size, dtype=torch.long, device=device)

    def update(self, x, y):
        for i in range(len(y)):
            j = self.seen if self.seen < self.size else np.random.randint(self.seen + 1)
            if j < self.size:
                self.x[j], self.y[j] = x[i], y[i]
            self.seen += 1

    def sample(self, n):
        idx = torch.randint(0, min(self.seen, self.size), (n,), device=self.device)
        return self.x[idx], self.y[idx]


@torch.no_grad()
def evaluate_seen(net, test_x, test_y, classes, device, rank, world):
    """Accuracy on the test images of `classes`, each rank takes every world-th image."""
    net.eval()
    sel = torch.nonzero(torch.isin(test_y, torch.as_tensor(classes))).flatten()[rank::world]
    s = torch.zeros(2, device=device)
    for k in range(0, len(sel), 500):
        b = sel[k:k + 500]
        pred = net(prep(test_x[b], device)).argmax(1)
        s[0] += (pred == test_y[b].to(device)).sum()
        s[1] += len(b)
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    x, y = load_mini_imagenet(args.cache_dir)
    (train_x, train_y), (test_x, test_y) = split_train_test(x, y)
    order = np.random.RandomState(args.seed).permutation(100)
    cpt = 100 // args.n_tasks
    tasks = [order[t * cpt:(t + 1) * cpt].tolist() for t in range(args.n_tasks)]

    net = resnet18(num_classes=100).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world)
    memory = Reservoir(args.mem_size, device)
    acc = np.zeros((args.n_tasks, args.n_tasks))
    anytime = []
    n_batches = 0

    for t, classes in enumerate(tasks):
        sel = torch.nonzero(torch.isin(train_y, torch.as_tensor(classes))).flatten()
        ds = TensorDataset(train_x[sel], train_y[sel])
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + t, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                            num_workers=2, pin_memory=True)
        tic = time.time()
        for bx, by in loader:
            xb, yb = prep(bx, device), by.to(device, non_blocking=True)
            for _ in range(args.iters):
                if memory.seen > 0:
                    mx, my = memory.sample(args.mem_batch)
                    inp, tgt = torch.cat([xb, prep(mx, device)]), torch.cat([yb, my])
                else:
                    inp, tgt = xb, yb
                loss = F.cross_entropy(model(inp), tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            memory.update(bx.to(device), yb)
            n_batches += 1

            if rank == 0 and n_batches % args.eval_every == 0:
                seen_cls = [c for cl in tasks[:t + 1] for c in cl]
                a = evaluate_seen(net, test_x, test_y, seen_cls, device, rank, world)
                anytime.append((n_batches, a))
                print(f"  [anytime] batch {n_batches} task {t} acc_seen {a:.4f} loss {loss.item():.3f}", flush=True)

        for j in range(t + 1):
            acc[t, j] = evaluate_seen(net, test_x, test_y, tasks[j], device, rank, world)
        if rank == 0:
            print(f"task {t} done ({time.time() - tic:.0f}s): avg acc {acc[t, :t + 1].mean():.4f}", flush=True)

    if rank == 0:
        T_ = args.n_tasks
        forgetting = np.mean([acc[j:T_ - 1, j].max() - acc[T_ - 1, j] for j in range(T_ - 1)])
        print(f"final avg acc {acc[-1].mean():.4f}  forgetting {forgetting:.4f}")
        os.makedirs(args.out, exist_ok=True)
        np.save(os.path.join(args.out, "acc_matrix.npy"), acc)
        np.save(os.path.join(args.out, "anytime.npy"), np.array(anytime))
        torch.save(net.state_dict(), os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
