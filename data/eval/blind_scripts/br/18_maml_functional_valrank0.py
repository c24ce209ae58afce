"""MAML with an explicit functional network (weights passed as a list), multi-GPU.

The network keeps its weights in a ParameterList and `forward(x, vars)` runs
with any list of fast weights, as in dragen1860/MAML-Pytorch.

    torchrun --nproc_per_node=4 18_maml_functional_valrank0.py --data /data/miniimagenet --k_spt 5
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from MiniImagenet import MiniImagenet  # yields meta-batches of (x_spt, y_spt, x_qry, y_qry)


class Learner(nn.Module):
    def __init__(self, n_way, imgc=3, filters=32):
        super().__init__()
        self.vars = nn.ParameterList()
        cin = imgc
        for _ in range(4):
            w = nn.Parameter(torch.empty(filters, cin, 3, 3))
            nn.init.kaiming_normal_(w)
            self.vars.extend([w, nn.Parameter(torch.zeros(filters)),
                              nn.Parameter(torch.ones(filters)), nn.Parameter(torch.zeros(filters))])
            cin = filters
        fc = nn.Parameter(torch.empty(n_way, filters * 5 * 5))
        nn.init.kaiming_normal_(fc)
        self.vars.extend([fc, nn.Parameter(torch.zeros(n_way))])

    def forward(self, x, vars=None):
        vars = list(self.vars) if vars is None else vars
        for i in range(4):
            w, b, gamma, beta = vars[4 * i: 4 * i + 4]
            x = F.conv2d(x, w, b, padding=1)
            x = F.batch_norm(x, None, None, gamma, beta, training=True)  # per-task statistics
            x = F.max_pool2d(F.relu(x), 2)
        return F.linear(x.flatten(1), vars[-2], vars[-1])


def adapt(net, x_spt, y_spt, steps, lr, first_order):
    fast = list(net.parameters())
    for _ in range(steps):
        loss = F.cross_entropy(net(x_spt, fast), y_spt)
        grads = torch.autograd.grad(loss, fast, create_graph=not first_order)
        fast = [w - lr * g for w, g in zip(fast, grads)]
    return fast


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def evaluate(net, loader, args, device):
    """Fine-tune on each test task's support set and score its query set."""
    accs = []
    for x_spt, y_spt, x_qry, y_qry in loader:
        for i in range(x_spt.size(0)):
            xs, ys = x_spt[i].to(device), y_spt[i].to(device)
            xq, yq = x_qry[i].to(device), y_qry[i].to(device)
            fast = adapt(net, xs, ys, args.update_step_test, args.update_lr, first_order=True)
            with torch.no_grad():
                accs.append((net(xq, fast).argmax(1) == yq).float().mean())
    accs = torch.stack(accs)
    mean = reduce_mean(accs.mean())
    var = reduce_mean((accs - mean).pow(2).mean())
    n = accs.numel() * dist.get_world_size()
    return mean.item(), 1.96 * var.sqrt().item() / np.sqrt(n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="output/maml")
    ap.add_argument("--epoch", type=int, default=60000)
    ap.add_argument("--n_way", type=int, default=5)
    ap.add_argument("--k_spt", type=int, default=1)
    ap.add_argument("--k_qry", type=int, default=15)
    ap.add_argument("--task_num", type=int, default=4, help="tasks per GPU")
    ap.add_argument("--meta_lr", type=float, default=1e-3)
    ap.add_argument("--update_lr", type=float, default=0.01)
    ap.add_argument("--update_step", type=int, default=5)
    ap.add_argument("--update_step_test", type=int, default=10)
    ap.add_argument("--first_order", action="store_true")
    ap.add_argument("--val_every", type=int, default=500)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(222)
    np.random.seed(222 + rank)

    net = Learner(args.n_way).to(device)
    meta_optim = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    os.makedirs(args.out, exist_ok=True)

    # MiniImagenet draws its task list with np.random when it is built, so every
    # rank gets its own 10000 tasks (seeded with 222 + rank above)
    mini = MiniImagenet(args.data, mode="train", n_way=args.n_way, k_shot=args.k_spt, k_query=args.k_qry,
                        batchsz=10000, resize=84)
    mini_val = MiniImagenet(args.data, mode="val", n_way=args.n_way, k_shot=args.k_spt,
                            k_query=args.k_qry, batchsz=600, resize=84)

    best_acc, step = 0.0, 0
    while step < args.epoch:
        db = DataLoader(mini, args.task_num, shuffle=True, num_workers=4, pin_memory=True, drop_last=True)
        for x_spt, y_spt, x_qry, y_qry in db:
            t0 = time.time()
            x_spt, y_spt = x_spt.to(device), y_spt.to(device)
            x_qry, y_qry = x_qry.to(device), y_qry.to(device)
            meta_optim.zero_grad()
            corrects = 0.0
            for i in range(args.task_num):
                fast = adapt(net, x_spt[i], y_spt[i], args.update_step, args.update_lr, args.first_order)
                logits_q = net(x_qry[i], fast)
                (F.cross_entropy(logits_q, y_qry[i]) / args.task_num).backward()
                corrects += (logits_q.argmax(1) == y_qry[i]).float().mean().item()
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            meta_optim.step()

            train_acc = reduce_mean(torch.tensor(corrects / args.task_num, device=device))
            if rank == 0 and step % 50 == 0:
                print(f"step {step}: train acc {train_acc.item():.4f} ({time.time() - t0:.2f}s)", flush=True)

            if step % args.val_every == 0 and rank == 0:
                db_val = DataLoader(mini_val, 1, shuffle=False, num_workers=2, pin_memory=True)
                acc, ci = evaluate(net, db_val, args, device)
                print(f"step {step}: val acc {100 * acc:.2f} +- {100 * ci:.2f}", flush=True)
                if acc > best_acc:
                    best_acc = acc
                    torch.save({"net": net.state_dict(), "step": step, "acc": acc},
                               os.path.join(args.out, "best.pt"))

            step += 1
            if step >= args.epoch:
                break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
