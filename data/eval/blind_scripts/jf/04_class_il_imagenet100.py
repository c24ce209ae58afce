"""Class-incremental ImageNet-100 with exemplar rehearsal + logit distillation.

Protocol: 50 base classes, then 5 incremental steps of 10 classes (B50-5s).
Exemplar memory: 20 images per class, picked by uniform subsampling.

Launch (2 nodes x 8 GPUs):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 04_class_il_imagenet100.py --root /shared/imagenet100
"""
import argparse
import copy
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/shared/imagenet100")
    p.add_argument("--save-dir", default="/shared/exp/cil_in100")
    p.add_argument("--base-classes", type=int, default=50)
    p.add_argument("--increment", type=int, default=10)
    p.add_argument("--mem-per-class", type=int, default=20)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr per 256 images")
    p.add_argument("--kd-weight", type=float, default=1.0)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--seed", type=int, default=1993)
    p.add_argument("--shuffle-classes", action="store_true", default=True)
    return p.parse_args()


def get_class_order(n_classes, shuffle):
    order = list(range(n_classes))
    if shuffle:
        order = np.random.permutation(n_classes).tolist()
    return order


class Remap:
    def __init__(self, mapping):
        self.mapping = mapping

    def __call__(self, y):
        return self.mapping[y]


def build_datasets(root, class_order):
    mapping = {c: i for i, c in enumerate(class_order)}
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = datasets.ImageFolder(
        os.path.join(root, "train"),
        transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                            transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), normalize]),
        target_transform=Remap(mapping))
    val = datasets.ImageFolder(
        os.path.join(root, "val"),
        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]),
        target_transform=Remap(mapping))
    # targets in incremental order, needed to build the per-step index lists
    train_y = np.array([mapping[t] for t in train.targets])
    val_y = np.array([mapping[t] for t in val.targets])
    return train, val, train_y, val_y


def select_exemplars(train_y, classes, m):
    keep = []
    for c in classes:
        idx = np.where(train_y == c)[0]
        step = max(len(idx) // m, 1)
        keep.extend(idx[::step][:m].tolist())
    return keep


def kd_loss(new_logits, old_logits, T):
    return F.kl_div(F.log_softmax(new_logits / T, 1), F.softmax(old_logits / T, 1),
                    reduction="batchmean") * (T ** 2)


@torch.no_grad()
def evaluate(net, val, val_y, n_known, device, rank, world):
    net.eval()
    idx = np.where(val_y < n_known)[0][rank::world].tolist()
    loader = DataLoader(Subset(val, idx), batch_size=128, num_workers=8, pin_memory=True)
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(x)[:, :n_known].argmax(1)
        correct += (pred == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    net.train()
    return (100 * correct / total).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation streams per process
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    class_order = get_class_order(100, args.shuffle_classes)
    train, val, train_y, val_y = build_datasets(args.root, class_order)
    if rank == 0:
        print("class order:", class_order[:10], "...", flush=True)

    steps = [list(range(args.base_classes))]
    c = args.base_classes
    while c < 100:
        steps.append(list(range(c, c + args.increment)))
        c += args.increment

    net = models.resnet18(weights=None, num_classes=100).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    memory, teacher, history = [], None, []

    for step, classes in enumerate(steps):
        n_known = classes[-1] + 1
        n_old = classes[0]
        cur_idx = np.where(np.isin(train_y, classes))[0].tolist()
        step_set = Subset(train, cur_idx + memory)
        sampler = DistributedSampler(step_set, shuffle=True, seed=args.seed)
        loader = DataLoader(step_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                            num_workers=args.workers, pin_memory=True, persistent_workers=True)
        epochs = args.epochs if step == 0 else args.epochs // 3
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader),
                                                    pct_start=0.1)

        for ep in range(epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)[:, :n_known]
                loss = F.cross_entropy(logits, y)
                if teacher is not None:
                    with torch.no_grad():
                        old = teacher(x)[:, :n_old]
                    loss = loss + args.kd_weight * kd_loss(logits[:, :n_old], old, args.T)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            if rank == 0 and (ep % 10 == 0 or ep == epochs - 1):
                print(f"step {step} ep {ep}/{epochs} loss {loss.item():.3f} "
                      f"lr {sched.get_last_lr()[0]:.4f} {time.time() - tic:.0f}s", flush=True)

        acc = evaluate(net, val, val_y, n_known, device, rank, world)
        history.append(acc)
        if rank == 0:
            print(f"==> step {step} ({n_known} classes) top-1 {acc:.2f}  avg-inc {np.mean(history):.2f}",
                  flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "step": step, "class_order": class_order,
                        "history": history}, os.path.join(args.save_dir, f"step{step}.pth"))

        memory += select_exemplars(train_y, classes, args.mem_per_class)
        teacher = copy.deepcopy(net).eval()
        for p_ in teacher.parameters():
            p_.requires_grad_(False)
        dist.barrier()

    if rank == 0:
        print("incremental accuracies:", [round(a, 2) for a in history])
        print("average incremental accuracy: %.2f" % np.mean(history))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
