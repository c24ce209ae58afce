"""Fine-tune a 1D FNO on viscous Burgers (nu = 1e-3) starting from weights
pretrained at nu = 1e-2.  Single node, one process per visible GPU, started with
torch.multiprocessing:

    python 17_fno1d_burgers_spawn.py --pretrained /work/sciml/ckpt/fno1d_burgers_nu1e-2.pt
"""
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class SpectralConv1d(nn.Module):
    def __init__(self, cin, cout, modes):
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.rand(cin, cout, modes, dtype=torch.cfloat) / (cin * cout))

    def forward(self, x):
        xf = torch.fft.rfft(x)
        out = torch.zeros(x.shape[0], self.weight.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[..., : self.modes] = torch.einsum("bix,iox->box", xf[..., : self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


class FNO1d(nn.Module):
    def __init__(self, modes=16, width=64, layers=4):
        super().__init__()
        self.lift = nn.Linear(2, width)
        self.spec = nn.ModuleList([SpectralConv1d(width, width, modes) for _ in range(layers)])
        self.skip = nn.ModuleList([nn.Conv1d(width, width, 1) for _ in range(layers)])
        self.proj = nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Linear(128, 1))

    def forward(self, u0):
        grid = torch.linspace(0, 1, u0.shape[-1], device=u0.device).expand_as(u0)
        x = self.lift(torch.stack([u0, grid], -1)).transpose(1, 2)
        for i, (s, w) in enumerate(zip(self.spec, self.skip)):
            x = s(x) + w(x)
            if i < len(self.spec) - 1:
                x = F.gelu(x)
        return self.proj(x.transpose(1, 2)).squeeze(-1)


def load_burgers(path, sub, ntrain, ntest):
    d = scipy.io.loadmat(path)
    a = torch.from_numpy(d["a"][:, ::sub].astype(np.float32))
    u = torch.from_numpy(d["u"][:, ::sub].astype(np.float32))
    return (TensorDataset(a[:ntrain], u[:ntrain]),
            TensorDataset(a[-ntest:], u[-ntest:]))


def relative_l2(pred, y):
    return torch.linalg.norm(pred - y, dim=-1) / torch.linalg.norm(y, dim=-1)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds, test_ds = load_burgers(args.data, args.sub, args.ntrain, args.ntest)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_idx = list(range(rank, len(test_ds), world_size))
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, test_idx), batch_size=64)

    model = FNO1d(args.modes, args.width).to(device)
    if args.pretrained:
        # the pretraining run saved the DDP-wrapped state dict; checkpoint tensors live on cuda:0
        state = torch.load(args.pretrained, map_location={"cuda:0": f"cuda:{rank}"})
        state = state.get("model", state)
        consume_prefix_in_state_dict_if_present(state, "module.")
        model.load_state_dict(state)
    ddp_model = DDP(model, device_ids=[rank])

    # fine-tuning: smaller lr on the lifting layer and spectral weights, full lr on the head
    head = list(model.proj.parameters())
    head_ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in head_ids]
    opt = torch.optim.Adam([{"params": body, "lr": args.lr * 0.1}, {"params": head, "lr": args.lr}],
                           weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for a, u in loader:
            a, u = a.to(device, non_blocking=True), u.to(device, non_blocking=True)
            loss = relative_l2(ddp_model(a), u).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach() * a.shape[0], torch.tensor(float(a.shape[0]), device=device)])
        sched.step()

        model.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, u in test_loader:
                a, u = a.to(device), u.to(device)
                te[0] += relative_l2(model(a), u).sum()
                te[1] += a.shape[0]
        dist.all_reduce(tr)
        dist.all_reduce(te)
        if rank == 0 and (epoch % 10 == 0 or epoch == args.epochs - 1):
            print(f"epoch {epoch:4d} train {tr[0] / tr[1]:.5f} test {te[0] / te[1]:.5f} "
                  f"({time.time() - t0:.2f}s)", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.save), exist_ok=True)
        torch.save({"model": model.state_dict(), "args": vars(args)}, args.save)
    dist.barrier()
    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/work/sciml/data/burgers_data_R10_nu1e-3.mat")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--save", default="/work/sciml/ckpt/fno1d_burgers_nu1e-3_ft.pt")
    p.add_argument("--sub", type=int, default=8)
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=200)
    p.add_argument("--modes", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + (os.getpid() % 1000)))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
