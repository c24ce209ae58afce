"""Worst-case robust accuracy of a trained checkpoint (PGD-CE and PGD-CW with
restarts), evaluated on all GPUs of a node. The test set is split across ranks;
per-example results are written so that different attacks/models can be
compared point by point later.

    torchrun --nproc_per_node=8 20_robust_eval_gather.py --ckpt runs/trades_wrn34/best.pt \
        --arch wrn34_10 --eps 8 --restarts 5 --out results/trades_wrn34_eval.pt
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models import get_model


class IndexedDataset(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


def cw_loss(logits, y, kappa=50.0):
    onehot = F.one_hot(y, logits.size(1)).bool()
    correct = logits[onehot]
    other = logits.masked_fill(onehot, -1e4).max(1).values
    return -torch.clamp(correct - other, min=-kappa)


def pgd(model, x, y, eps, alpha, steps, loss_type="ce"):
    delta = torch.empty_like(x).uniform_(-eps, eps)
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        logits = model(x + delta)
        if loss_type == "ce":
            loss = F.cross_entropy(logits, y)
        else:
            loss = cw_loss(logits, y).sum()
        g, = torch.autograd.grad(loss, delta)
        delta = (delta.detach() + alpha * g.sign()).clamp(-eps, eps)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


@torch.no_grad()
def predict(model, x):
    return model(x).argmax(1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--arch", default="wrn34_10")
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
    p.add_argument("--data", default="./data")
    p.add_argument("--eps", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--n-ex", type=int, default=10000)
    p.add_argument("--out", required=True)
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)

    num_classes = 10 if args.dataset == "cifar10" else 100
    model = get_model(args.arch, num_classes=num_classes)
    state = torch.load(args.ckpt, map_location="cpu")
    state = state.get("state_dict", state.get("model", state))
    state = {k.replace("module.", "", 1): v for k, v in state.items()}
    model.load_state_dict(state)
    model.to(device).eval()

    ds_cls = datasets.CIFAR10 if args.dataset == "cifar10" else datasets.CIFAR100
    test_set = ds_cls(args.data, train=False, transform=transforms.ToTensor())
    if args.n_ex < len(test_set):
        test_set = torch.utils.data.Subset(test_set, range(args.n_ex))
    test_set = IndexedDataset(test_set)
    sampler = DistributedSampler(test_set, shuffle=False)
    loader = DataLoader(test_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True)

    eps = args.eps / 255.0
    alpha = eps / 4
    t0 = time.time()
    all_idx, all_clean, all_robust = [], [], []
    for x, y, idx in loader:
        x, y = x.to(device), y.to(device)
        clean_ok = predict(model, x) == y
        robust = clean_ok.clone()
        for loss_type in ("ce", "cw"):
            for _ in range(args.restarts):
                if not robust.any():
                    break
                sel = robust.nonzero().squeeze(1)
                x_adv = pgd(model, x[sel], y[sel], eps, alpha, args.steps, loss_type)
                still = predict(model, x_adv) == y[sel]
                robust[sel] = still
        all_idx.append(idx.to(device))
        all_clean.append(clean_ok)
        all_robust.append(robust)
        if rank == 0:
            done = sum(len(i) for i in all_idx)
            print(f"[rank0] {done}/{len(sampler)}  robust so far "
                  f"{torch.cat(all_robust).float().mean().item():.4f}  ({time.time() - t0:.0f}s)",
                  flush=True)

    idx_local = torch.cat(all_idx)
    clean_local = torch.cat(all_clean)
    robust_local = torch.cat(all_robust)

    counts = torch.stack([clean_local.sum(), robust_local.sum(),
                          torch.tensor(len(idx_local), device=device)]).float()
    dist.all_reduce(counts)

    # indices of test points broken by the attacks (correct before, wrong after)
    broken_local = idx_local[clean_local & ~robust_local]
    gathered = [torch.zeros_like(broken_local) for _ in range(world)]
    dist.all_gather(gathered, broken_local)

    if rank == 0:
        broken = torch.cat(gathered).unique().cpu()
        clean_acc = (counts[0] / counts[2]).item()
        robust_acc = (counts[1] / counts[2]).item()
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        torch.save({"broken_idx": broken, "clean_acc": clean_acc, "robust_acc": robust_acc,
                    "eps": args.eps, "steps": args.steps, "restarts": args.restarts,
                    "ckpt": args.ckpt}, args.out)
        summary = {"ckpt": args.ckpt, "clean": clean_acc, "robust": robust_acc,
                   "n_broken": int(broken.numel()), "n": int(counts[2].item()),
                   "minutes": (time.time() - t0) / 60}
        print(json.dumps(summary, indent=2))
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(summary, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
