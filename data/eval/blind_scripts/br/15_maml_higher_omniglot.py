#!/usr/bin/env python3
# MAML on Omniglot with `higher`, data-parallel over the meta-batch.
#
# Adapted from higher's examples/maml-omniglot.py. Every GPU runs task_num/world
# tasks through its own differentiable inner loop; the meta-gradient is then
# averaged with a single all-reduce of the flattened gradients.
#
# BatchNorm keeps no running statistics (transductive, per task as in the
# paper), so there is nothing to synchronise between GPUs apart from the grads.
#
#   torchrun --nproc_per_node=4 15_maml_higher_omniglot.py --task-num 32 --k-spt 1
import argparse
import os
import time

import higher
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchvision.datasets import Omniglot


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.expanduser("~/data"))
    ap.add_argument("--n-way", type=int, default=5)
    ap.add_argument("--k-spt", type=int, default=1)
    ap.add_argument("--k-qry", type=int, default=15)
    ap.add_argument("--task-num", type=int, default=32, help="tasks per meta-update, summed over GPUs")
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--meta-lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--steps-per-epoch", type=int, default=100)
    ap.add_argument("--test-tasks", type=int, default=1024)
    ap.add_argument("--save", default="ckpt/maml_omniglot.pt")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


def build_arrays(root, download):
    """Omniglot as an array [n_chars, 20, 1, 28, 28]; background+evaluation, 1200 train chars."""
    chars = []
    for background in (True, False):
        ds = Omniglot(root, background=background, download=download)
        per_char = {}
        for path, label in ds._flat_character_images:
            per_char.setdefault((background, label), []).append(path)
        for key in sorted(per_char):
            chars.append([os.path.join(ds.target_folder, ds._characters[key[1]], p)
                          for p in sorted(per_char[key])])
    return chars


def load_images(chars):
    from PIL import Image
    arr = np.zeros((len(chars), 20, 1, 28, 28), dtype=np.float32)
    for c, paths in enumerate(chars):
        for i, p in enumerate(paths[:20]):
            arr[c, i, 0] = np.asarray(Image.open(p).convert("L").resize((28, 28)), np.float32) / 255.0
    return 1.0 - arr  # white strokes on black


class NShot:
    def __init__(self, data, rng):
        self.data, self.rng = data, rng

    def batch(self, n_tasks, n_way, k_spt, k_qry, device):
        xs, ys, xq, yq = [], [], [], []
        for _ in range(n_tasks):
            cls = self.rng.choice(len(self.data), n_way, replace=False)
            s, q = [], []
            for c in cls:
                idx = self.rng.permutation(20)[:k_spt + k_qry]
                s.append(self.data[c, idx[:k_spt]])
                q.append(self.data[c, idx[k_spt:]])
            xs.append(np.concatenate(s))
            xq.append(np.concatenate(q))
            ys.append(np.repeat(np.arange(n_way), k_spt))
            yq.append(np.repeat(np.arange(n_way), k_qry))
        t = lambda a, dt: torch.from_numpy(np.stack(a)).to(device=device, dtype=dt)
        return t(xs, torch.float32), t(ys, torch.long), t(xq, torch.float32), t(yq, torch.long)


def make_net(n_way):
    def block(cin):
        return [nn.Conv2d(cin, 64, 3), nn.BatchNorm2d(64, momentum=1, affine=True,
                                                      track_running_stats=False),
                nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*block(1), *block(64), *block(64), nn.Flatten(), nn.Linear(64, n_way))


def meta_step(net, inner_opt, batch, inner_steps, train):
    x_spt, y_spt, x_qry, y_qry = batch
    accs = []
    for i in range(x_spt.size(0)):
        with higher.innerloop_ctx(net, inner_opt, copy_initial_weights=False,
                                  track_higher_grads=train) as (fnet, diffopt):
            for _ in range(inner_steps):
                diffopt.step(F.cross_entropy(fnet(x_spt[i]), y_spt[i]))
            logits = fnet(x_qry[i])
            if train:
                (F.cross_entropy(logits, y_qry[i]) / x_spt.size(0)).backward()
            accs.append((logits.argmax(1) == y_qry[i]).float().mean().detach())
    return torch.stack(accs)


def all_reduce_mean_grads(params, world):
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(world)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    assert args.task_num % world == 0
    tasks_per_gpu = args.task_num // world
    torch.manual_seed(args.seed)

    if rank == 0:
        build_arrays(args.root, download=True)
    dist.barrier()
    data = load_images(build_arrays(args.root, download=False))
    train_tasks = NShot(data[:1200], np.random.RandomState(args.seed + 17 * rank))
    test_tasks = NShot(data[1200:], np.random.RandomState(10_000 + rank))

    net = make_net(args.n_way).to(device)
    meta_opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    inner_opt = torch.optim.SGD(net.parameters(), lr=args.inner_lr)

    if rank == 0 and args.wandb:
        wandb.init(project="maml-omniglot", config=vars(args))
    best = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        net.train()
        for _ in range(args.steps_per_epoch):
            meta_opt.zero_grad()
            batch = train_tasks.batch(tasks_per_gpu, args.n_way, args.k_spt, args.k_qry, device)
            train_acc = meta_step(net, inner_opt, batch, args.inner_steps, train=True).mean()
            all_reduce_mean_grads(list(net.parameters()), world)
            meta_opt.step()

        # meta-test: adaptation still needs gradients, only the outer graph is dropped
        accs = []
        for _ in range(args.test_tasks // (world * tasks_per_gpu)):
            batch = test_tasks.batch(tasks_per_gpu, args.n_way, args.k_spt, args.k_qry, device)
            accs.append(meta_step(net, inner_opt, batch, args.inner_steps, train=False))
        accs = torch.cat(accs)
        s = torch.stack([accs.sum(), accs.pow(2).sum(), torch.tensor(float(accs.numel()), device=device)])
        dist.all_reduce(s)
        mean = (s[0] / s[2]).item()
        ci = 1.96 * max((s[1] / s[2]).item() - mean ** 2, 0.0) ** 0.5 / s[2].item() ** 0.5
        dist.all_reduce(train_acc)
        train_acc /= world

        if rank == 0:
            print(f"epoch {epoch + 1}: last train acc {train_acc.item():.3f} | test {100 * mean:.2f} "
                  f"+- {100 * ci:.2f} | {time.time() - t0:.1f}s", flush=True)
            if args.wandb:
                wandb.log({"test/acc": mean, "test/ci95": ci, "epoch": epoch + 1})
            if mean > best:
                best = mean
                os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
                torch.save({"net": net.state_dict(), "epoch": epoch + 1, "acc": mean}, args.save)
        dist.barrier()

    if rank == 0 and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
