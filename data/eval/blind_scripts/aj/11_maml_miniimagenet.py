"""Second-order MAML on mini-ImageNet (5-way 1/5-shot) with learn2learn, data parallel
over tasks: every worker draws its own tasks, the meta-gradients are averaged.

    torchrun --nproc_per_node=4 11_maml_miniimagenet.py --shots 5 --meta-batch-size 8
"""
import argparse
import os
import random

import learn2learn as l2l
import numpy as np
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.utils.tensorboard import SummaryWriter


def accuracy(predictions, targets):
    predictions = predictions.argmax(dim=1).view(targets.shape)
    return (predictions == targets).sum().float() / targets.size(0)


def fast_adapt(batch, learner, loss, adaptation_steps, shots, ways, device):
    data, labels = batch
    data, labels = data.to(device), labels.to(device)

    # even indices -> support, odd -> query
    adaptation_indices = np.zeros(data.size(0), dtype=bool)
    adaptation_indices[np.arange(shots * ways) * 2] = True
    evaluation_indices = torch.from_numpy(~adaptation_indices)
    adaptation_indices = torch.from_numpy(adaptation_indices)
    adaptation_data, adaptation_labels = data[adaptation_indices], labels[adaptation_indices]
    evaluation_data, evaluation_labels = data[evaluation_indices], labels[evaluation_indices]

    for _ in range(adaptation_steps):
        train_error = loss(learner(adaptation_data), adaptation_labels)
        learner.adapt(train_error)

    predictions = learner(evaluation_data)
    valid_error = loss(predictions, evaluation_labels)
    valid_accuracy = accuracy(predictions, evaluation_labels)
    return valid_error, valid_accuracy


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="~/data/mini-imagenet")
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=1)
    parser.add_argument("--meta-lr", type=float, default=0.001)
    parser.add_argument("--fast-lr", type=float, default=0.01)
    parser.add_argument("--meta-batch-size", type=int, default=8, help="tasks per worker")
    parser.add_argument("--adaptation-steps", type=int, default=5)
    parser.add_argument("--num-iterations", type=int, default=60000)
    parser.add_argument("--first-order", action="store_true")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="runs/maml_mini")
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different tasks on every worker, identical initial weights
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    root = os.path.expanduser(args.root)
    if rank == 0:
        l2l.vision.benchmarks.get_tasksets("mini-imagenet", root=root, train_samples=2, train_ways=2)
    dist.barrier()
    tasksets = l2l.vision.benchmarks.get_tasksets(
        "mini-imagenet",
        train_samples=2 * args.shots,
        train_ways=args.ways,
        test_samples=2 * args.shots,
        test_ways=args.ways,
        root=root,
    )

    model = l2l.vision.models.MiniImagenetCNN(args.ways).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    maml = l2l.algorithms.MAML(model, lr=args.fast_lr, first_order=args.first_order)
    opt = optim.Adam(maml.parameters(), args.meta_lr)
    loss = nn.CrossEntropyLoss(reduction="mean")

    writer = SummaryWriter(args.out) if rank == 0 else None
    best_val = 0.0
    for iteration in range(args.num_iterations):
        opt.zero_grad()
        meta_train_error = 0.0
        meta_train_accuracy = 0.0
        for task in range(args.meta_batch_size):
            learner = maml.clone()
            batch = tasksets.train.sample()
            evaluation_error, evaluation_accuracy = fast_adapt(
                batch, learner, loss, args.adaptation_steps, args.shots, args.ways, device)
            evaluation_error.backward()
            meta_train_error += evaluation_error.item()
            meta_train_accuracy += evaluation_accuracy.item()

        # average the meta-gradient over tasks and workers
        for p in maml.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad.data, op=dist.ReduceOp.SUM)
                p.grad.data.mul_(1.0 / (args.meta_batch_size * world_size))
        opt.step()

        stats = torch.tensor([meta_train_error, meta_train_accuracy]) / args.meta_batch_size
        dist.all_reduce(stats, op=dist.ReduceOp.AVG)
        if rank == 0 and iteration % 50 == 0:
            writer.add_scalar("meta_train/error", stats[0].item(), iteration)
            writer.add_scalar("meta_train/accuracy", stats[1].item(), iteration)

        if (iteration + 1) % args.eval_every == 0:
            val_acc = torch.zeros(2, device=device)
            for task in range(args.meta_batch_size):
                learner = maml.clone()
                batch = tasksets.validation.sample()
                _, acc = fast_adapt(batch, learner, loss, args.adaptation_steps,
                                    args.shots, args.ways, device)
                val_acc[0] += acc.detach()
                val_acc[1] += 1
            dist.all_reduce(val_acc)
            val = (val_acc[0] / val_acc[1]).item()
            if rank == 0:
                writer.add_scalar("meta_val/accuracy", val, iteration + 1)
                print(f"iter {iteration + 1}: train acc {stats[1].item():.3f} val acc {val:.3f}")
                if val > best_val:
                    best_val = val
                    torch.save({"model": model.state_dict(), "iteration": iteration + 1,
                                "val_acc": val, "args": vars(args)},
                               os.path.join(args.out, "maml_best.pt"))

    # meta-test: each worker adapts on its share of the 600 tasks
    test_acc = torch.zeros(2, device=device)
    n_test = 600 // world_size
    for _ in range(n_test):
        learner = maml.clone()
        _, acc = fast_adapt(tasksets.test.sample(), learner, loss, args.adaptation_steps,
                            args.shots, args.ways, device)
        test_acc[0] += acc.detach()
        test_acc[1] += 1
    dist.all_reduce(test_acc)
    if rank == 0:
        print(f"meta-test accuracy over {int(test_acc[1].item())} tasks: "
              f"{(test_acc[0] / test_acc[1]).item():.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
