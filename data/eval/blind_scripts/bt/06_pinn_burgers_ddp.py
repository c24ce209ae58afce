"""Physics-informed network for the viscous Burgers equation, data-parallel over GPUs.

    u_t + u u_x = (0.01 / pi) u_xx,   x in [-1, 1], t in [0, 1]
    u(0, x) = -sin(pi x),  u(t, -1) = u(t, 1) = 0

Every rank draws its own collocation points each step, so with N GPUs the residual is
enforced on N x n_colloc points per step.  The reference solution (Raissi et al.,
burgers_shock.mat) is only used for the error reported during training.

    torchrun --standalone --nproc_per_node=8 06_pinn_burgers_ddp.py --ref data/burgers_shock.mat
"""
import argparse
import math
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

NU = 0.01 / math.pi


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True)
    ap.add_argument("--out", default="runs/pinn_burgers")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--n-colloc", type=int, default=8192, help="residual points per rank per step")
    ap.add_argument("--n-bc", type=int, default=512)
    ap.add_argument("--n-ic", type=int, default=512)
    ap.add_argument("--w-ic", type=float, default=10.0)
    ap.add_argument("--w-bc", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=40000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class MLP(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        layers = [nn.Linear(2, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        # inputs are scaled from [0,1]x[-1,1] to [-1,1]^2
        self.register_buffer("lb", torch.tensor([0.0, -1.0]))
        self.register_buffer("ub", torch.tensor([1.0, 1.0]))
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, tx):
        return self.net(2.0 * (tx - self.lb) / (self.ub - self.lb) - 1.0)


def sample_points(args, gen, device):
    t_r = torch.rand(args.n_colloc, 1, generator=gen, device=device)
    x_r = 2 * torch.rand(args.n_colloc, 1, generator=gen, device=device) - 1
    t_b = torch.rand(args.n_bc, 1, generator=gen, device=device)
    x_b = (torch.rand(args.n_bc, 1, generator=gen, device=device) < 0.5).float() * 2.0 - 1.0
    x_i = 2 * torch.rand(args.n_ic, 1, generator=gen, device=device) - 1
    t_i = torch.zeros_like(x_i)
    return torch.cat([t_r, x_r], 1), torch.cat([t_b, x_b], 1), torch.cat([t_i, x_i], 1)


def pinn_loss(model, tx_r, tx_b, tx_i, args):
    tx_r = tx_r.requires_grad_(True)
    n_r, n_b = tx_r.shape[0], tx_b.shape[0]
    # one forward over all points so every parameter is used exactly once per step
    out = model(torch.cat([tx_r, tx_b, tx_i], 0))
    u_r, u_b, u_i = out[:n_r], out[n_r:n_r + n_b], out[n_r + n_b:]

    grads = torch.autograd.grad(u_r, tx_r, torch.ones_like(u_r), create_graph=True)[0]
    u_t, u_x = grads[:, :1], grads[:, 1:]
    u_xx = torch.autograd.grad(u_x, tx_r, torch.ones_like(u_x), create_graph=True)[0][:, 1:]
    residual = u_t + u_r * u_x - NU * u_xx

    loss_r = residual.pow(2).mean()
    loss_b = u_b.pow(2).mean()
    loss_i = (u_i + torch.sin(math.pi * tx_i[:, 1:])).pow(2).mean()
    total = loss_r + args.w_bc * loss_b + args.w_ic * loss_i
    return total, torch.stack([loss_r.detach(), loss_b.detach(), loss_i.detach()])


@torch.no_grad()
def reference_error(net, ref, device):
    t, x, u = ref["t"].ravel(), ref["x"].ravel(), np.real(ref["usol"])  # usol: (x, t)
    T, X = np.meshgrid(t, x)
    tx = torch.tensor(np.stack([T.ravel(), X.ravel()], 1), dtype=torch.float32, device=device)
    pred = torch.cat([net(chunk) for chunk in tx.split(65536)]).cpu().numpy().reshape(u.shape)
    return np.linalg.norm(pred - u) / np.linalg.norm(u)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)
    net = MLP(args.width, args.depth).to(device)
    model = DDP(net, device_ids=[local_rank])
    # collocation points: an independent stream per rank
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000 + rank)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    def lr_lambda(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ref = scipy.io.loadmat(args.ref) if rank == 0 else None

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "pinn.pt")
    step0 = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        if rank < len(ck["gen_states"]):
            gen.set_state(ck["gen_states"][rank].cpu())
        step0 = ck["step"] + 1

    parts = torch.zeros(3, device=device)
    tic = time.time()
    for step in range(step0, args.steps):
        model.train()
        tx_r, tx_b, tx_i = sample_points(args, gen, device)
        loss, comp = pinn_loss(model, tx_r, tx_b, tx_i, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        parts += comp

        if (step + 1) % args.eval_every == 0:
            dist.all_reduce(parts)
            parts /= world * args.eval_every
            states = [None] * world
            dist.all_gather_object(states, gen.get_state())
            if rank == 0:
                err = reference_error(net, ref, device)
                print(f"step {step + 1:6d} | res {parts[0]:.3e} bc {parts[1]:.3e} ic {parts[2]:.3e} "
                      f"| rel L2 {err:.3e} | lr {sched.get_last_lr()[0]:.2e} | {time.time() - tic:.0f}s",
                      flush=True)
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step, "gen_states": states}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            parts.zero_()
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
