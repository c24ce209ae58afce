"""Learning to Prompt (L2P, Wang et al. CVPR 2022) on Split CIFAR-100, multi-GPU.

Frozen ViT-B/16 (ImageNet-21k pretrained); only the prompt pool, its keys and
the classifier are trained. Class-incremental, 10 tasks of 10 classes.

    torchrun --nproc_per_node=8 20_l2p_prompt_vit.py --data-path /datasets/cifar100
"""
import argparse
import collections
import datetime
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args_parser():
    parser = argparse.ArgumentParser("L2P training", add_help=True)
    parser.add_argument("--data-path", default="/datasets/cifar100")
    parser.add_argument("--output-dir", default="./output/l2p_cifar100")
    parser.add_argument("--model", default="vit_base_patch16_224.augreg_in21k")
    parser.add_argument("--num-tasks", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.03, help="base lr, scaled by global batch / 256")
    parser.add_argument("--pool-size", type=int, default=10)
    parser.add_argument("--prompt-length", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--pull-constraint-coeff", type=float, default=0.1)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    return parser


class L2P(nn.Module):
    def __init__(self, vit, n_classes, pool_size, length, top_k):
        super().__init__()
        self.vit = vit
        for p in self.vit.parameters():
            p.requires_grad = False
        d = vit.embed_dim
        self.top_k = top_k
        self.prompt = nn.Parameter(torch.empty(pool_size, length, d).uniform_(-1, 1))
        self.prompt_key = nn.Parameter(torch.empty(pool_size, d).uniform_(-1, 1))
        self.head = nn.Linear(d, n_classes)

    def _tokens(self, x):
        x = self.vit.patch_embed(x)
        return self.vit._pos_embed(x)

    def forward(self, x):
        with torch.no_grad():
            q = self.vit.forward_features(x)[:, 0]  # frozen [CLS] query
        sim = F.normalize(q, dim=1) @ F.normalize(self.prompt_key, dim=1).T
        idx = sim.topk(self.top_k, dim=1).indices  # B, k
        prompts = self.prompt[idx].flatten(1, 2)  # B, k*L, D
        tok = self._tokens(x)
        tok = torch.cat([tok[:, :1], prompts, tok[:, 1:]], dim=1)
        tok = self.vit.norm(self.vit.blocks(self.vit.norm_pre(tok)))
        feat = tok[:, 1:1 + prompts.size(1)].mean(1)
        pull = (1.0 - sim.gather(1, idx)).sum() / x.size(0)
        return self.head(feat), pull, idx


def build_vit(name, rank):
    # download / cache the pretrained weights once, then let the other ranks read the cache
    if rank == 0:
        timm.create_model(name, pretrained=True, num_classes=0)
    dist.barrier()
    return timm.create_model(name, pretrained=True, num_classes=0)


@torch.no_grad()
def evaluate(net, test_set, y_test, classes, n_seen, device, rank, world):
    net.eval()
    idx = np.where(np.isin(y_test, classes))[0][rank::world]
    s = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, idx), batch_size=64, num_workers=4, pin_memory=True):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _, _ = net(x)
        s[0] += (logits[:, :n_seen].argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return 100.0 * (s[0] / s[1]).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed)

    tf_train = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor()])
    tf_test = transforms.Compose([transforms.Resize(224), transforms.ToTensor()])
    train_set = datasets.CIFAR100(args.data_path, train=True, transform=tf_train)
    test_set = datasets.CIFAR100(args.data_path, train=False, transform=tf_test)
    y_train, y_test = np.array(train_set.targets), np.array(test_set.targets)
    # the class order is drawn from the shared-seed global numpy RNG: identical on all ranks
    class_order = np.random.permutation(100)
    remap = np.argsort(class_order)  # original label -> incremental label
    train_set.targets = remap[y_train].tolist()
    test_set.targets = remap[y_test].tolist()
    y_train, y_test = remap[y_train], remap[y_test]
    cpt = 100 // args.num_tasks

    net = L2P(build_vit(args.model, rank), 100, args.pool_size, args.prompt_length, args.top_k).to(device)
    model = DDP(net, device_ids=[local_rank])
    n_trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    lr = args.lr * args.batch_size * world / 256.0
    acc_matrix = np.zeros((args.num_tasks, args.num_tasks))
    if rank == 0:
        print(f"trainable params: {n_trainable / 1e3:.1f}K, lr {lr:.5f}, world {world}", flush=True)
        os.makedirs(args.output_dir, exist_ok=True)

    for t in range(args.num_tasks):
        classes = list(range(t * cpt, (t + 1) * cpt))
        ds = Subset(train_set, np.where(np.isin(y_train, classes))[0].tolist())
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.999))
        scaler = torch.cuda.amp.GradScaler()
        not_mask = torch.ones(100, dtype=torch.bool, device=device)
        not_mask[classes] = False
        usage = collections.Counter()

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, pull, idx = model(x)
                    # train mask: only the current task's classes compete
                    logits = logits.masked_fill(not_mask, float("-inf"))
                    loss = F.cross_entropy(logits.float(), y) + args.pull_constraint_coeff * pull
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                usage.update(idx.flatten().tolist())
            if rank == 0:
                print(f"task {t + 1} epoch {ep + 1}: loss {loss.item():.4f} ({time.time() - tic:.0f}s)", flush=True)

        all_usage = [None] * world
        dist.all_gather_object(all_usage, dict(usage))
        for j in range(t + 1):
            acc_matrix[t, j] = evaluate(net, test_set, y_test, list(range(j * cpt, (j + 1) * cpt)),
                                        (t + 1) * cpt, device, rank, world)
        if rank == 0:
            total = collections.Counter()
            for u in all_usage:
                total.update(u)
            print(f"prompt usage after task {t + 1}: {dict(sorted(total.items()))}")
            print(f"== task {t + 1}: avg acc {acc_matrix[t, :t + 1].mean():.2f}", flush=True)
            trainable = {k: v for k, v in net.state_dict().items() if not k.startswith("vit.")}
            torch.save({"trainable": trainable, "class_order": class_order, "task": t,
                        "acc_matrix": acc_matrix}, os.path.join(args.output_dir, f"task{t + 1}.pth"))
        dist.barrier()

    if rank == 0:
        n = args.num_tasks
        fgt = np.mean([acc_matrix[j:n - 1, j].max() - acc_matrix[n - 1, j] for j in range(n - 1)])
        print(f"final average accuracy {acc_matrix[-1].mean():.2f}, forgetting {fgt:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
