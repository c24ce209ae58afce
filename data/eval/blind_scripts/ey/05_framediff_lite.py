"""FrameDiff-lite: SE(3) diffusion over residue frames (R3 translations + SO(3) rotations).

Backbones are stored as preprocessed .npz files (N, CA, C coordinates per residue).
    torchrun --nproc_per_node=4 05_framediff_lite.py --data_dir /data/pdb_monomers --exp framediff_lite_v3
"""
import argparse
import glob
import logging
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def frames_from_backbone(n, ca, c):
    e1 = F.normalize(c - ca, dim=-1)
    u = n - ca
    e2 = F.normalize(u - (u * e1).sum(-1, keepdim=True) * e1, dim=-1)
    e3 = torch.cross(e1, e2, dim=-1)
    return torch.stack([e1, e2, e3], dim=-1), ca


def axis_angle_to_matrix(v):
    theta = v.norm(dim=-1, keepdim=True).clamp(min=1e-8)
    k = v / theta
    K = torch.zeros(*v.shape[:-1], 3, 3, device=v.device, dtype=v.dtype)
    K[..., 0, 1], K[..., 0, 2], K[..., 1, 2] = -k[..., 2], k[..., 1], -k[..., 0]
    K = K - K.transpose(-1, -2)
    th = theta.unsqueeze(-1)
    eye = torch.eye(3, device=v.device, dtype=v.dtype)
    return eye + th.sin() * K + (1 - th.cos()) * K @ K


class BackboneSet(Dataset):
    def __init__(self, files, max_len=256):
        self.files = files
        self.max_len = max_len

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        bb = torch.from_numpy(d["backbone"]).float()  # [L, 3, 3] (N, CA, C)
        L = min(bb.shape[0], self.max_len)
        start = np.random.randint(0, bb.shape[0] - L + 1)
        bb = bb[start:start + L]
        bb = bb - bb[:, 1].mean(0)
        R, t = frames_from_backbone(bb[:, 0], bb[:, 1], bb[:, 2])
        out_R = torch.eye(3).repeat(self.max_len, 1, 1)
        out_t = torch.zeros(self.max_len, 3)
        mask = torch.zeros(self.max_len)
        out_R[:L], out_t[:L], mask[:L] = R, t / 10.0, 1.0
        return out_R, out_t, mask


class FrameBlock(nn.Module):
    def __init__(self, d, heads=8, n_rbf=16):
        super().__init__()
        self.heads, self.n_rbf = heads, n_rbf
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.pair_bias = nn.Linear(n_rbf + 3, heads)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, s, R, t, mask):
        B, L, D = s.shape
        H = self.heads
        dist_ = torch.cdist(t, t)
        centers = torch.linspace(0, 2.0, self.n_rbf, device=s.device)
        rbf = torch.exp(-((dist_[..., None] - centers) ** 2) / 0.02)
        local = torch.einsum("bixy,bijx->bijy", R, t[:, None] - t[:, :, None])  # j in frame of i
        bias = self.pair_bias(torch.cat([rbf, local], -1)).permute(0, 3, 1, 2)
        q, k, v = self.qkv(self.ln1(s)).view(B, L, 3, H, D // H).unbind(2)
        att = torch.einsum("bihd,bjhd->bhij", q, k) / (D // H) ** 0.5 + bias
        att = att.masked_fill(mask[:, None, None, :] == 0, -1e9).softmax(-1)
        o = torch.einsum("bhij,bjhd->bihd", att, v).reshape(B, L, D)
        s = s + self.proj(o)
        return s + self.ff(self.ln2(s))


class ScoreNet(nn.Module):
    def __init__(self, d=256, depth=8, max_len=256):
        super().__init__()
        self.pos = nn.Embedding(max_len, d)
        self.t_mlp = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(FrameBlock(d) for _ in range(depth))
        self.trans_out = nn.Linear(d, 3)
        self.rot_out = nn.Linear(d, 3)

    def forward(self, R, t, time, mask):
        B, L = mask.shape
        s = self.pos(torch.arange(L, device=mask.device))[None] + self.t_mlp(time[:, None])[:, None]
        for blk in self.blocks:
            s = blk(s, R, t, mask)
        # predictions in the local frame, rotated back to global
        eps_t = torch.einsum("bixy,biy->bix", R, self.trans_out(s))
        rot_v = torch.einsum("bixy,biy->bix", R, self.rot_out(s))
        return eps_t * mask[..., None], rot_v * mask[..., None]


def noise_frames(R0, t0, mask, time, beta_min=0.1, beta_max=20.0, sigma_rot_max=1.5):
    log_a = -0.25 * time ** 2 * (beta_max - beta_min) - 0.5 * time * beta_min
    a = log_a.exp()[:, None, None]
    eps = torch.randn_like(t0) * mask[..., None]
    com = (eps * mask[..., None]).sum(1, keepdim=True) / mask.sum(1)[:, None, None]
    eps = (eps - com) * mask[..., None]
    t_noisy = a * t0 + (1 - a ** 2).sqrt() * eps
    sigma = (time * sigma_rot_max)[:, None, None]
    rot_noise = torch.randn_like(t0) * sigma * mask[..., None]
    R_noisy = axis_angle_to_matrix(rot_noise) @ R0
    return R_noisy, t_noisy, eps, rot_noise / sigma.clamp(min=1e-3)


def compute_loss(model, R0, t0, mask):
    B = R0.shape[0]
    time = torch.rand(B, device=R0.device) * 0.99 + 0.01
    Rn, tn, eps, rot_target = noise_frames(R0, t0, mask, time)
    eps_hat, rot_hat = model(Rn, tn, time, mask)
    n = mask.sum() * 3
    return ((eps_hat - eps) ** 2).sum() / n + 0.5 * ((rot_hat - rot_target) ** 2).sum() / n


def kabsch_rmsd(P, Q, mask):
    m = mask.bool()
    P, Q = P[m], Q[m]
    P, Q = P - P.mean(0), Q - Q.mean(0)
    U, S, Vt = torch.linalg.svd(P.T @ Q)
    d = torch.sign(torch.det(U @ Vt))
    D = torch.diag(torch.tensor([1.0, 1.0, d.item()], device=P.device))
    Rm = U @ D @ Vt
    return ((P @ Rm - Q) ** 2).sum(-1).mean().sqrt()


@torch.no_grad()
def denoise_rmsd(net, loader, device, time_level=0.3):
    net.eval()
    acc = torch.zeros(2, device=device)
    for R0, t0, mask in loader:
        R0, t0, mask = R0.to(device), t0.to(device), mask.to(device)
        time = torch.full((R0.shape[0],), time_level, device=device)
        Rn, tn, _, _ = noise_frames(R0, t0, mask, time)
        eps_hat, _ = net(Rn, tn, time, mask)
        log_a = -0.25 * time ** 2 * 19.9 - 0.5 * time * 0.1
        a = log_a.exp()[:, None, None]
        t_hat = (tn - (1 - a ** 2).sqrt() * eps_hat) / a
        for b in range(R0.shape[0]):
            acc[0] += kabsch_rmsd(t_hat[b] * 10.0, t0[b] * 10.0, mask[b])
            acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--exp", default="framediff_lite")
    p.add_argument("--ckpt_root", default="/shared/experiments")
    p.add_argument("--num_epoch", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--ema", type=float, default=0.999)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")

    files = sorted(glob.glob(os.path.join(args.data_dir, "*.npz")))
    n_val = 256
    train_ds = BackboneSet(files[n_val:], args.max_len)
    val_ds = BackboneSet(files[:n_val], args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, n_val, world)), batch_size=args.batch_size,
                            num_workers=2)

    net = ScoreNet(max_len=args.max_len).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = ScoreNet(max_len=args.max_len).to(device).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt_dir = os.path.join(args.ckpt_root, args.exp)
    ckpt_file = os.path.join(ckpt_dir, "latest.pt")
    first_epoch = 0
    if os.path.isfile(ckpt_file):
        state = torch.load(ckpt_file, map_location=device)
        net.load_state_dict(state["net"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        first_epoch = state["epoch"] + 1
        logger.info("resumed from epoch %d", state["epoch"])

    for epoch in range(first_epoch, args.num_epoch):
        running = torch.zeros(2, device=device)
        for R0, t0, mask in train_loader:
            R0, t0, mask = R0.to(device), t0.to(device), mask.to(device)
            loss = compute_loss(model, R0, t0, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(pm, 1.0 - args.ema)
            running[0] += loss.detach()
            running[1] += 1
        dist.all_reduce(running)
        logger.info("epoch %d train loss %.4f", epoch, (running[0] / running[1]).item())

        rmsd = denoise_rmsd(ema, val_loader, device)
        logger.info("epoch %d EMA denoising RMSD@t=0.3: %.3f A", epoch, rmsd)

        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "args": vars(args)}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
