"""Replay + logit distillation on top of a pretrained ViT-S/16, Split CIFAR-100 (224px).

Baseline for our prompt-based CL comparisons (L2P / DualPrompt protocol:
10 tasks of 10 classes, class-incremental, 224x224 inputs). After every task
the model is saved, and the next task reloads it from disk as the frozen
teacher for distillation.

    torchrun --nproc_per_node=4 15_vit_replay_kd.py --data ./data --mem_per_class 20
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--output_dir", default="./output/vit_replay_kd")
    p.add_argument("--model", default="vit_small_patch16_224")
    p.add_argument("--num_tasks", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch_size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--mem_per_class", type=int, default=20)
    p.add_argument("--kd_weight", type=float, default=1.0)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_model(name, num_classes, pretrained):
    return timm.create_model(name, pretrained=pretrained, num_classes=num_classes)


def save_checkpoint(model, optimizer, task, acc, path):
    torch.save({"task": task, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                "acc": acc}, path)


def load_teacher(name, num_classes, path, device):
    teacher = build_model(name, num_classes, pretrained=False)
    ckpt = torch.load(path, map_location=device, weights_only=False)
    teacher.load_state_dict(ckpt["state_dict"])
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def warmup_cosine(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(net, test_set, y_test, task_classes, seen, rank, world, device):
    net.eval()
    mask = torch.full((100,), float("-inf"), device=device)
    mask[seen] = 0.0
    hits = torch.zeros(len(task_classes), 2, device=device)
    for k, classes in enumerate(task_classes):
        idx = np.where(np.isin(y_test, classes))[0][rank::world].tolist()
        for x, y in DataLoader(Subset(test_set, idx), batch_size=256, num_workers=4, pin_memory=True):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x)
            hits[k, 0] += ((logits.float() + mask).argmax(1) == y).sum()
            hits[k, 1] += y.numel()
    dist.all_reduce(hits)
    return (100.0 * hits[:, 0] / hits[:, 1]).cpu().numpy()


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tf_train = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    tf_test = transforms.Compose([transforms.Resize(224), transforms.ToTensor(),
                                  transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    train_set = datasets.CIFAR100(args.data, train=True, transform=tf_train)
    test_set = datasets.CIFAR100(args.data, train=False, transform=tf_test)
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    order = np.random.RandomState(args.seed).permutation(100)
    cpt = 100 // args.num_tasks
    task_classes = [order[t * cpt:(t + 1) * cpt].tolist() for t in range(args.num_tasks)]

    # rank 0 fetches the pretrained weights into the hub cache first, the others then read the cache
    if rank == 0:
        net = build_model(args.model, 100, pretrained=True)
    dist.barrier()
    if rank != 0:
        net = build_model(args.model, 100, pretrained=True)
    net.to(device)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    teacher = None
    memory = []
    acc = np.zeros((args.num_tasks, args.num_tasks))
    mem_rng = np.random.RandomState(args.seed)

    for t, classes in enumerate(task_classes):
        seen = [c for cl in task_classes[:t + 1] for c in cl]
        mask = torch.full((100,), float("-inf"), device=device)
        mask[seen] = 0.0
        cur = Subset(train_set, np.where(np.isin(y_train, classes))[0].tolist())
        data = ConcatDataset([cur, Subset(train_set, memory)]) if memory else cur
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)

        model = DDP(net, device_ids=[local_rank])
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        total = args.epochs * len(loader)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, args.warmup_steps, total))
        tic = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for it, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x).float() + mask
                    loss = F.cross_entropy(logits, y)
                    if teacher is not None:
                        with torch.no_grad():
                            t_logits = teacher(x).float()
                        old = [c for cl in task_classes[:t] for c in cl]
                        kd = F.kl_div(F.log_softmax(logits[:, old] / args.T, 1), F.softmax(t_logits[:, old] / args.T, 1),
                                      reduction="batchmean") * args.T ** 2
                        loss = loss + args.kd_weight * kd
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                sched.step()
                if rank == 0 and it % 50 == 0:
                    print(f"task {t} epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        for c in classes:
            memory += mem_rng.choice(np.where(y_train == c)[0], args.mem_per_class, replace=False).tolist()

        acc[t, :t + 1] = evaluate(net, test_set, y_test, task_classes[:t + 1], seen, rank, world, device)
        ckpt_path = os.path.join(args.output_dir, f"task_{t}.pth")
        if rank == 0:
            print(f"task {t} finished in {(time.time() - tic) / 60:.1f} min | acc {np.round(acc[t, :t + 1], 1)} "
                  f"| avg {acc[t, :t + 1].mean():.2f}", flush=True)
            save_checkpoint(model, optimizer, t, acc, ckpt_path)
        dist.barrier()
        teacher = load_teacher(args.model, 100, ckpt_path, device)

    if rank == 0:
        np.savetxt(os.path.join(args.output_dir, "acc_matrix.txt"), acc, fmt="%.2f")
        print(f"final avg acc {acc[-1].mean():.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
