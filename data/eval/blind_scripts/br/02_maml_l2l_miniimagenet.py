"""
MAML on mini-ImageNet with learn2learn, data-parallel over the meta-batch.

The meta-batch of tasks is split across ranks; every rank adapts its own tasks
and the meta-gradients are averaged with one all-reduce per outer step.
We do not wrap the model in DDP: the inner loop calls the functional clone
many times per outer step, and DDP's reducer expects a single forward/backward.

Launch:
    torchrun --standalone --nproc_per_node=8 02_maml_l2l_miniimagenet.py --meta-batch 32
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import learn2learn as l2l
from torch import nn
from torch.utils.tensorboard import SummaryWriter


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="~/data/l2l")
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=1)
    parser.add_argument("--meta-lr", type=float, default=0.001)
    parser.add_argument("--fast-lr", type=float, default=0.01)
    parser.add_argument("--adapt-steps", type=int, default=5)
    parser.add_argument("--test-adapt-steps", type=int, default=10)
    parser.add_argument("--meta-batch", type=int, default=32, help="tasks per outer step, all GPUs")
    parser.add_argument("--iterations", type=int, default=60000)
    parser.add_argument("--val-every", type=int, default=1000)
    parser.add_argument("--val-tasks", type=int, default=600)
    parser.add_argument("--first-order", action="store_true")
    parser.add_argument("--ckpt-dir", default="checkpoints/maml_mini")
    parser.add_argument("--resume", default="")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def accuracy(logits, targets):
    return (logits.argmax(dim=1) == targets).float().mean()


def fast_adapt(batch, learner, loss_fn, steps, shots, ways, device):
    data, labels = batch
    data, labels = data.to(device), labels.to(device)
    # even positions -> support, odd positions -> query
    support = np.zeros(data.size(0), dtype=bool)
    support[np.arange(shots * ways) * 2] = True
    query = torch.from_numpy(~support)
    support = torch.from_numpy(support)
    x_s, y_s = data[support], labels[support]
    x_q, y_q = data[query], labels[query]
    for _ in range(steps):
        learner.adapt(loss_fn(learner(x_s), y_s))
    logits = learner(x_q)
    return loss_fn(logits, y_q), accuracy(logits, y_q)


def allreduce_grads(params, world_size):
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world_size)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def meta_evaluate(maml, taskset, n_tasks, args, device, world_size, loss_fn):
    """Every rank runs n_tasks / world_size tasks; returns mean acc and 95% CI over all tasks."""
    local = []
    for _ in range(n_tasks // world_size):
        learner = maml.clone()
        _, acc = fast_adapt(taskset.sample(), learner, loss_fn, args.test_adapt_steps,
                            args.shots, args.ways, device)
        local.append(acc.item())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    accs = np.concatenate([np.asarray(a) for a in gathered])
    return accs.mean(), 1.96 * accs.std() / np.sqrt(len(accs))


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    assert args.meta_batch % world_size == 0, "meta-batch must split evenly across GPUs"
    tasks_per_rank = args.meta_batch // world_size

    # each rank draws different tasks; the weights are the same on all ranks
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed + rank)

    bench_kwargs = dict(train_ways=args.ways, train_samples=2 * args.shots,
                        test_ways=args.ways, test_samples=2 * args.shots,
                        num_tasks=-1, root=os.path.expanduser(args.root))
    # rank 0 downloads/unpacks the pickles, the others read them afterwards
    if rank == 0:
        tasksets = l2l.vision.benchmarks.get_tasksets("mini-imagenet", **bench_kwargs)
    dist.barrier()
    if rank != 0:
        tasksets = l2l.vision.benchmarks.get_tasksets("mini-imagenet", **bench_kwargs)

    model = l2l.vision.models.MiniImagenetCNN(args.ways)
    model.to(device)
    maml = l2l.algorithms.MAML(model, lr=args.fast_lr, first_order=args.first_order)
    opt = torch.optim.Adam(maml.parameters(), args.meta_lr)
    loss_fn = nn.CrossEntropyLoss(reduction="mean")

    start_it, best_val = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        maml.load_state_dict(ckpt["maml"])
        opt.load_state_dict(ckpt["opt"])
        start_it, best_val = ckpt["iteration"] + 1, ckpt["best_val"]

    writer = None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb"))

    for it in range(start_it, args.iterations):
        opt.zero_grad()
        meta_loss, meta_acc = 0.0, 0.0
        for _ in range(tasks_per_rank):
            learner = maml.clone()
            loss, acc = fast_adapt(tasksets.train.sample(), learner, loss_fn,
                                   args.adapt_steps, args.shots, args.ways, device)
            (loss / tasks_per_rank).backward()
            meta_loss += loss.item() / tasks_per_rank
            meta_acc += acc.item() / tasks_per_rank

        allreduce_grads(list(maml.parameters()), world_size)
        opt.step()

        stats = torch.tensor([meta_loss, meta_acc], device=device)
        dist.all_reduce(stats)
        stats /= world_size
        if rank == 0 and it % 50 == 0:
            writer.add_scalar("train/loss", stats[0].item(), it)
            writer.add_scalar("train/acc", stats[1].item(), it)
            print(f"it {it:6d}  loss {stats[0]:.4f}  acc {stats[1]:.4f}", flush=True)

        if (it + 1) % args.val_every == 0:
            val_acc, val_ci = meta_evaluate(maml, tasksets.validation, args.val_tasks,
                                            args, device, world_size, loss_fn)
            if rank == 0:
                writer.add_scalar("val/acc", val_acc, it)
                print(f"[val] it {it + 1}: {100 * val_acc:.2f} +- {100 * val_ci:.2f}", flush=True)
                state = {"maml": maml.state_dict(), "opt": opt.state_dict(),
                         "iteration": it, "best_val": max(best_val, val_acc)}
                torch.save(state, os.path.join(args.ckpt_dir, "last.pth"))
                if val_acc > best_val:
                    torch.save(state, os.path.join(args.ckpt_dir, "best.pth"))
            best_val = max(best_val, val_acc)
            dist.barrier()

    best = torch.load(os.path.join(args.ckpt_dir, "best.pth"), map_location=device)
    maml.load_state_dict(best["maml"])
    test_acc, test_ci = meta_evaluate(maml, tasksets.test, 2000, args, device, world_size, loss_fn)
    if rank == 0:
        print(f"meta-test {args.ways}w{args.shots}s: {100 * test_acc:.2f} +- {100 * test_ci:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
