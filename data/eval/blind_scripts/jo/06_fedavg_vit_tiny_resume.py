"""FedAvgM (server momentum) with a ViT-Tiny on Tiny-ImageNet, simulated clients.

Long runs get pre-empted, so the server state (global weights, server optimizer,
round counter, RNG state) is checkpointed and the job can be resumed with --resume.

    torchrun --nproc_per_node=4 06_fedavg_vit_tiny_resume.py --resume /ckpt/vit_fedavgm/latest.pth
"""
import argparse
import logging
import math
import os
import sys

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

logger = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser(description="FedAvgM ViT-Tiny")
    p.add_argument("--train-dir", default="/data/tiny-imagenet-200/train")
    p.add_argument("--val-dir", default="/data/tiny-imagenet-200/val_sorted")
    p.add_argument("--ckpt-dir", default="/ckpt/vit_fedavgm")
    p.add_argument("--resume", default="")
    p.add_argument("--num-clients", type=int, default=500)
    p.add_argument("--clients-per-round", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4000)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--client-lr", type=float, default=3e-4)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--server-momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--eval-every", type=int, default=100)
    return p.parse_args()


def iid_partition(n, num_clients, seed):
    perm = np.random.default_rng(seed).permutation(n)
    # unequal sizes: log-normal client sizes, renormalised to n
    sizes = np.random.default_rng(seed + 1).lognormal(0, 0.7, num_clients)
    cuts = (np.cumsum(sizes / sizes.sum())[:-1] * n).astype(int)
    return [c.tolist() for c in np.split(perm, cuts)]


def client_update(model, loader, steps, lr, device):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    it = iter(loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(-1)
        tot[0] += (pred == y).sum()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tf_train = transforms.Compose([
        transforms.RandomResizedCrop(64, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282)),
    ])
    tf_val = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282)),
    ])
    train_set = datasets.ImageFolder(args.train_dir, tf_train)
    val_set = datasets.ImageFolder(args.val_dir, tf_val)
    clients = iid_partition(len(train_set), args.num_clients, args.seed)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=256,
                            num_workers=6, pin_memory=True)

    def make_model():
        return timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8,
                                 num_classes=200, drop_path_rate=0.1).to(device)

    global_model = make_model()
    local_model = make_model()
    for t in global_model.state_dict().values():
        dist.broadcast(t, 0)
    server_opt = torch.optim.SGD(global_model.parameters(), lr=args.server_lr,
                                 momentum=args.server_momentum, nesterov=True)

    start_round, best = 0, 0.0
    if args.resume:
        state = torch.load(args.resume)
        global_model.load_state_dict(state["model"])
        server_opt.load_state_dict(state["server_opt"])
        start_round, best = state["round"], state["best"]
        logger.info("resumed from %s at round %d (best %.4f)", args.resume, start_round, best)

    for rnd in range(start_round, args.rounds):
        rng = np.random.default_rng((args.seed, rnd))
        sampled = rng.choice(args.num_clients, args.clients_per_round, replace=False)
        delta = [torch.zeros_like(p) for p in global_model.parameters()]
        n_tot = torch.zeros((), device=device)

        for cid in sampled[rank::world]:
            local_model.load_state_dict(global_model.state_dict())
            loader = DataLoader(Subset(train_set, clients[cid]), batch_size=args.batch_size,
                                shuffle=True, num_workers=6, pin_memory=True, drop_last=False)
            client_update(local_model, loader, args.local_steps, args.client_lr, device)
            n_k = len(clients[cid])
            for d, g, l in zip(delta, global_model.parameters(), local_model.parameters()):
                d.add_(g.detach() - l.detach(), alpha=n_k)
            n_tot += n_k

        dist.all_reduce(n_tot)
        for d in delta:
            dist.all_reduce(d)

        # pseudo-gradient step on the server
        server_opt.zero_grad(set_to_none=True)
        for p, d in zip(global_model.parameters(), delta):
            p.grad = d / n_tot
        server_opt.step()

        if rnd % 20 == 0:
            norm = math.sqrt(sum(float((d / n_tot).pow(2).sum()) for d in delta))
            logger.info("round %d  |delta| %.4f", rnd, norm)

        if (rnd + 1) % args.eval_every == 0:
            acc = validate(global_model, val_loader, device)
            best = max(best, acc)
            logger.info("round %d  val_acc %.4f  best %.4f", rnd + 1, acc, best)
            if rank == 0:
                os.makedirs(args.ckpt_dir, exist_ok=True)
                torch.save({"model": global_model.state_dict(), "server_opt": server_opt.state_dict(),
                            "round": rnd + 1, "best": best, "args": vars(args)},
                           os.path.join(args.ckpt_dir, "latest.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
