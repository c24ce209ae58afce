"""A-GEM on CORe50 (NC scenario: 50 objects, 10 + 8 x 5 new classes), multi-GPU.

Images are decoded from the 128x128 PNG release once, resized to 64x64 and kept in a .npz
next to the data, so later runs start immediately.

    torchrun --nproc_per_node=4 12_agem_core50_nc.py --root /data/core50 --out runs/agem_core50
"""
import argparse
import glob
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import mobilenet_v2

TEST_SESSIONS = {3, 7, 10}
PAT = re.compile(r"s(\d+)/o(\d+)/")


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/core50")
    p.add_argument("--out", default="runs/agem_core50")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--mem-per-task", type=int, default=500)
    p.add_argument("--ref-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_arrays(root, size):
    files = sorted(glob.glob(os.path.join(root, "core50_128x128", "s*", "o*", "*.png")))
    x = np.empty((len(files), size, size, 3), dtype=np.uint8)
    obj = np.empty(len(files), dtype=np.int64)
    sess = np.empty(len(files), dtype=np.int64)
    for i, f in enumerate(files):
        m = PAT.search(f.replace(os.sep, "/"))
        sess[i], obj[i] = int(m.group(1)), int(m.group(2)) - 1
        x[i] = np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR))
    return x, obj, sess


def load_core50(root, size):
    cache = os.path.join(root, f"core50_{size}px.npz")
    if not os.path.isfile(cache):
        x, obj, sess = build_arrays(root, size)
        np.savez(cache, x=x, obj=obj, sess=sess)
    d = np.load(cache)
    return d["x"], d["obj"], d["sess"]


def to_tensor(x):
    x = torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255)
    return (x - 0.5) / 0.25


def flat_grad(params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def assign_grad(params, flat):
    off = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


@torch.no_grad()
def accuracy(net, x, y, device, rank, world):
    net.eval()
    xs, ys = x[rank::world], y[rank::world]
    c = torch.zeros(2, device=device)
    for i in range(0, len(xs), 512):
        xb, yb = xs[i:i + 512].to(device), ys[i:i + 512].to(device)
        c[0] += (net(xb).argmax(1) == yb).sum()
        c[1] += len(yb)
    dist.all_reduce(c)
    net.train()
    return 100 * (c[0] / c[1]).item()


def main():
    args = options()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    x, obj, sess = load_core50(args.root, args.size)
    is_test = np.isin(sess, list(TEST_SESSIONS))
    order = np.random.RandomState(args.seed).permutation(50)
    label = np.argsort(order)[obj]
    tasks = [order[:10]] + [order[10 + 5 * i:15 + 5 * i] for i in range(8)]
    bounds = np.cumsum([0] + [len(t) for t in tasks])
    X_test, Y_test = to_tensor(x[is_test]), torch.from_numpy(label[is_test])

    net = mobilenet_v2(num_classes=50).to(device)
    model = DDP(net, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.0)
    mem_x, mem_y = [], []
    mem_rng = np.random.RandomState(args.seed)
    batch_rng = torch.Generator().manual_seed(args.seed + rank)
    acc = np.zeros((len(tasks), len(tasks)))

    for t, cls in enumerate(tasks):
        sel = np.flatnonzero(~is_test & np.isin(obj, cls))
        ds = TensorDataset(to_tensor(x[sel]), torch.from_numpy(label[sel]))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                            num_workers=2, pin_memory=True)
        have_mem = len(mem_x) > 0
        if have_mem:
            MX, MY = torch.cat(mem_x), torch.cat(mem_y)

        tic = time.time()
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            for xb, yb in loader:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                if have_mem:
                    j = torch.randint(len(MX), (args.ref_batch,), generator=batch_rng)
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(MX[j].to(device)), MY[j].to(device)).backward()
                    g_ref = flat_grad(params).clone()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                if have_mem:
                    g = flat_grad(params)
                    dot = torch.dot(g, g_ref)
                    if dot < 0:
                        assign_grad(params, g - dot / torch.dot(g_ref, g_ref) * g_ref)
                opt.step()
        if rank == 0:
            print(f"task {t}: {len(ds)} train images, last loss {loss.item():.3f}, "
                  f"{time.time() - tic:.0f}s", flush=True)

        keep = mem_rng.choice(sel, min(args.mem_per_task, len(sel)), replace=False)
        mem_x.append(to_tensor(x[keep]))
        mem_y.append(torch.from_numpy(label[keep]))

        for j in range(t + 1):
            m = (Y_test >= int(bounds[j])) & (Y_test < int(bounds[j + 1]))
            acc[t, j] = accuracy(net, X_test[m], Y_test[m], device, rank, world)
        seen = Y_test < int(bounds[t + 1])
        overall = accuracy(net, X_test[seen], Y_test[seen], device, rank, world)
        if rank == 0:
            print(f"after task {t}: accuracy on seen classes {overall:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            np.save(os.path.join(args.out, "acc_matrix.npy"), acc)
            torch.save(net.state_dict(), os.path.join(args.out, f"agem_t{t}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
