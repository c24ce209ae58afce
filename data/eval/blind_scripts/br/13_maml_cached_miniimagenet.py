"""Second-order MAML on mini-ImageNet (Finn et al. 2017), hand-written inner loop.

Decoding 60k JPEGs per run is slow, so the resized images of each split are
cached once as a uint8 .npy next to the data. The meta-batch is split over the
GPUs and the meta-gradients are all-reduced.

    torchrun --nproc_per_node=4 13_maml_cached_miniimagenet.py --data /nfs/data/mini-imagenet
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.func import functional_call


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="contains images/ and {train,val,test}.csv")
    ap.add_argument("--out", default="./maml_runs/mini_5w1s")
    ap.add_argument("--n-way", type=int, default=5)
    ap.add_argument("--k-spt", type=int, default=1)
    ap.add_argument("--k-qry", type=int, default=15)
    ap.add_argument("--task-num", type=int, default=4, help="meta-batch size, across all GPUs")
    ap.add_argument("--meta-lr", type=float, default=1e-3)
    ap.add_argument("--update-lr", type=float, default=0.01)
    ap.add_argument("--update-step", type=int, default=5)
    ap.add_argument("--update-step-test", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=60000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-tasks", type=int, default=600)
    return ap.parse_args()


def load_split(root, split, size=84):
    cache = os.path.join(root, f"cache_{split}_{size}.npz")
    if not os.path.exists(cache):
        with open(os.path.join(root, f"{split}.csv")) as f:
            rows = list(csv.reader(f))[1:]
        wnids = sorted({r[1] for r in rows})
        images = np.zeros((len(rows), size, size, 3), dtype=np.uint8)
        labels = np.zeros(len(rows), dtype=np.int64)
        for i, (fname, wnid) in enumerate(rows):
            img = Image.open(os.path.join(root, "images", fname)).convert("RGB")
            images[i] = np.asarray(img.resize((size, size), Image.LANCZOS))
            labels[i] = wnids.index(wnid)
        np.savez(cache, images=images, labels=labels)
    pack = np.load(cache)
    return pack["images"], pack["labels"]


class TaskPool:
    def __init__(self, images, labels, rng):
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # uint8 NCHW
        self.by_class = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.rng = rng
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def sample(self, n_way, k_spt, k_qry, device):
        cls = self.rng.choice(len(self.by_class), n_way, replace=False)
        spt, qry = [], []
        for c in cls:
            idx = self.rng.choice(self.by_class[c], k_spt + k_qry, replace=False)
            spt.append(idx[:k_spt])
            qry.append(idx[k_spt:])
        def prep(idx):
            x = self.images[np.concatenate(idx)].float().div_(255)
            return ((x - self.mean) / self.std).to(device, non_blocking=True)
        y_spt = torch.arange(n_way).repeat_interleave(k_spt).to(device)
        y_qry = torch.arange(n_way).repeat_interleave(k_qry).to(device)
        return prep(spt), y_spt, prep(qry), y_qry


class Learner(nn.Module):
    """4 x [conv 3x3, 32 filters, BN, ReLU, maxpool 2] + linear, as in the MAML paper."""

    def __init__(self, n_way):
        super().__init__()
        layers, cin = [], 3
        for _ in range(4):
            layers += [nn.Conv2d(cin, 32, 3, padding=1),
                       nn.BatchNorm2d(32, track_running_stats=False),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            cin = 32
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(32 * 5 * 5, n_way)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def adapt(model, params, x_spt, y_spt, steps, lr, create_graph):
    fast = dict(params)
    for _ in range(steps):
        loss = F.cross_entropy(functional_call(model, fast, (x_spt,)), y_spt)
        grads = torch.autograd.grad(loss, list(fast.values()), create_graph=create_graph)
        fast = {name: w - lr * g for (name, w), g in zip(fast.items(), grads)}
    return fast


def sync_grads(model, world):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def evaluate(model, pool, args, device, world):
    params = dict(model.named_parameters())
    accs = []
    for _ in range(args.eval_tasks // world):
        x_s, y_s, x_q, y_q = pool.sample(args.n_way, args.k_spt, args.k_qry, device)
        fast = adapt(model, params, x_s, y_s, args.update_step_test, args.update_lr, create_graph=False)
        with torch.no_grad():
            pred = functional_call(model, fast, (x_q,)).argmax(1)
        accs.append((pred == y_q).float().mean())
    accs = torch.stack(accs)
    s = torch.stack([accs.sum(), (accs * accs).sum(), torch.tensor(float(len(accs)), device=device)])
    dist.all_reduce(s)
    mean = s[0] / s[2]
    ci = 1.96 * torch.sqrt((s[1] / s[2] - mean * mean).clamp(min=0) / s[2])
    return mean.item(), ci.item()


def main():
    args = parse()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if args.task_num % world != 0:
        raise ValueError(f"--task-num {args.task_num} must be a multiple of the world size {world}")
    local_tasks = args.task_num // world
    torch.manual_seed(222)

    train_pool = TaskPool(*load_split(args.data, "train"), np.random.RandomState(222 + rank))
    val_pool = TaskPool(*load_split(args.data, "val"), np.random.RandomState(1000 + rank))

    model = Learner(args.n_way).to(device)
    meta_opt = torch.optim.Adam(model.parameters(), lr=args.meta_lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{sum(p.numel() for p in model.parameters())} parameters, "
              f"{local_tasks} tasks per GPU x {world} GPUs", flush=True)

    best, t0 = 0.0, time.time()
    for step in range(1, args.iterations + 1):
        params = dict(model.named_parameters())
        meta_opt.zero_grad(set_to_none=True)
        q_acc = torch.zeros((), device=device)
        for _ in range(local_tasks):
            x_s, y_s, x_q, y_q = train_pool.sample(args.n_way, args.k_spt, args.k_qry, device)
            fast = adapt(model, params, x_s, y_s, args.update_step, args.update_lr, create_graph=True)
            logits_q = functional_call(model, fast, (x_q,))
            (F.cross_entropy(logits_q, y_q) / local_tasks).backward()
            q_acc += (logits_q.argmax(1) == y_q).float().mean().detach() / local_tasks
        sync_grads(model, world)
        meta_opt.step()

        if step % 100 == 0:
            dist.all_reduce(q_acc)
            if rank == 0:
                print(f"step {step}: train query acc {q_acc.item() / world:.4f} "
                      f"({(time.time() - t0) / 100:.2f}s/step)", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0:
            acc, ci = evaluate(model, val_pool, args, device, world)
            if rank == 0:
                print(f"step {step}: val {100 * acc:.2f} +- {100 * ci:.2f}", flush=True)
                torch.save({"model": model.state_dict(), "opt": meta_opt.state_dict(), "step": step},
                           os.path.join(args.out, "last.pt"))
                if acc > best:
                    best = acc
                    torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
