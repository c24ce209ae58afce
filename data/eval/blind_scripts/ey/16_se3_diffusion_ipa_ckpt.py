"""SE(3) backbone diffusion with an IPA-style trunk (FrameDiff-lite), long chains.

Memory: pair representation is L x L x c_z, so trunk blocks are wrapped in
activation checkpointing for crops up to 512 residues. A psi-torsion head is
trained only after --psi_start_epoch (helps the early phase, as in FrameDiff).

    torchrun --nnodes=1 --nproc_per_node=8 16_se3_diffusion_ipa_ckpt.py \
        --manifest /shared/pdb/metadata_len512.csv --out /shared/runs/se3diff_l512
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class PdbFrames(Dataset):
    def __init__(self, manifest, crop):
        with open(manifest) as f:
            self.rows = [r for r in csv.DictReader(f) if int(r["modeled_seq_len"]) >= 60]
        self.crop = crop

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        feats = np.load(self.rows[i]["processed_path"])
        rots = torch.from_numpy(feats["rigids_rot"]).float()
        trans = torch.from_numpy(feats["rigids_trans"]).float() / 10.0
        psi = torch.from_numpy(feats["psi_sincos"]).float()
        L = rots.shape[0]
        if L > self.crop:
            s = np.random.randint(0, L - self.crop + 1)
            rots, trans, psi, L = rots[s:s + self.crop], trans[s:s + self.crop], psi[s:s + self.crop], self.crop
        out_r = torch.eye(3).repeat(self.crop, 1, 1)
        out_t, out_p, m = torch.zeros(self.crop, 3), torch.zeros(self.crop, 2), torch.zeros(self.crop)
        out_r[:L], out_t[:L], out_p[:L], m[:L] = rots, trans - trans.mean(0), psi, 1
        return out_r, out_t, out_p, m


class TrunkBlock(nn.Module):
    def __init__(self, c_s, c_z, heads=8):
        super().__init__()
        self.heads = heads
        self.ln_s = nn.LayerNorm(c_s)
        self.qkv = nn.Linear(c_s, 3 * c_s)
        self.z_bias = nn.Linear(c_z, heads)
        self.pts = nn.Linear(c_s, heads * 3)
        self.o = nn.Linear(c_s, c_s)
        self.trans = nn.Sequential(nn.LayerNorm(c_s), nn.Linear(c_s, 2 * c_s), nn.ReLU(), nn.Linear(2 * c_s, c_s))
        self.z_upd = nn.Sequential(nn.LayerNorm(c_z), nn.Linear(c_z, c_z), nn.ReLU(), nn.Linear(c_z, c_z))
        self.outer = nn.Linear(c_s, c_z)

    def forward(self, s, z, rots, trans, mask):
        B, L, C = s.shape
        H = self.heads
        q, k, v = self.qkv(self.ln_s(s)).view(B, L, 3, H, C // H).unbind(2)
        # point term: head points expressed in the global frame
        p = torch.einsum("blij,blhj->blhi", rots, self.pts(s).view(B, L, H, 3)) + trans[:, :, None]
        pd = ((p[:, :, None] - p[:, None]) ** 2).sum(-1).permute(0, 3, 1, 2)
        a = torch.einsum("bihc,bjhc->bhij", q, k) / (C // H) ** 0.5 + self.z_bias(z).permute(0, 3, 1, 2) - 0.5 * pd
        a = a.masked_fill(mask[:, None, None, :] == 0, -1e4).softmax(-1)
        s = s + self.o(torch.einsum("bhij,bjhc->bihc", a, v).reshape(B, L, C))
        s = s + self.trans(s)
        o = self.outer(s)
        z = z + self.z_upd(z + o[:, :, None] * o[:, None])
        return s, z


class SE3Denoiser(nn.Module):
    def __init__(self, c_s=256, c_z=64, n_blocks=8):
        super().__init__()
        self.s_in = nn.Linear(32 + 1, c_s)
        self.z_in = nn.Linear(65 + 22, c_z)
        self.blocks = nn.ModuleList(TrunkBlock(c_s, c_z) for _ in range(n_blocks))
        self.trans_out = nn.Linear(c_s, 3)
        self.rot_out = nn.Linear(c_s, 3)
        self.psi_head = nn.Sequential(nn.Linear(c_s, c_s), nn.ReLU(), nn.Linear(c_s, 2))

    def forward(self, rots, trans, t, mask, need_psi=True):
        B, L = mask.shape
        idx = torch.arange(L, device=mask.device)
        freqs = torch.exp(-torch.arange(16, device=mask.device) * 0.5)
        pe = torch.cat([(idx[:, None] * freqs).sin(), (idx[:, None] * freqs).cos()], -1)
        s = self.s_in(torch.cat([pe[None].expand(B, -1, -1), t[:, None, None].expand(B, L, 1)], -1))
        rel = F.one_hot((idx[None] - idx[:, None]).clamp(-32, 32) + 32, 65).float()
        d = torch.cdist(trans, trans)
        rbf = torch.exp(-((d[..., None] - torch.linspace(0, 2.0, 22, device=d.device)) ** 2) / 0.01)
        z = self.z_in(torch.cat([rel[None].expand(B, -1, -1, -1), rbf], -1))
        for blk in self.blocks:
            if self.training:
                s, z = checkpoint(blk, s, z, rots, trans, mask, use_reentrant=True)
            else:
                s, z = blk(s, z, rots, trans, mask)
        tr = torch.einsum("blij,blj->bli", rots, self.trans_out(s))
        rv = torch.einsum("blij,blj->bli", rots, self.rot_out(s))
        psi = F.normalize(self.psi_head(s), dim=-1) if need_psi else None
        return tr, rv, psi


def rotvec_to_mat(v):
    th = v.norm(dim=-1, keepdim=True).clamp(min=1e-7)[..., None]
    k = v / th[..., 0]
    K = torch.zeros(*v.shape[:-1], 3, 3, device=v.device)
    K[..., 0, 1], K[..., 0, 2], K[..., 1, 0] = -k[..., 2], k[..., 1], k[..., 2]
    K[..., 1, 2], K[..., 2, 0], K[..., 2, 1] = -k[..., 0], -k[..., 1], k[..., 0]
    return torch.eye(3, device=v.device) + th.sin() * K + (1 - th.cos()) * K @ K


def diffusion_loss(model, rots0, trans0, psi0, mask, use_psi):
    B = mask.shape[0]
    t = torch.rand(B, device=mask.device) * (1 - 1e-3) + 1e-3
    ab = torch.exp(-0.5 * (0.1 * t + 9.95 * t ** 2))[:, None, None]
    eps = torch.randn_like(trans0) * mask[..., None]
    eps = eps - eps.sum(1, keepdim=True) / mask.sum(1)[:, None, None]
    trans_t = (ab.sqrt() * trans0 + (1 - ab).sqrt() * eps) * mask[..., None]
    sig = (1.5 * t)[:, None, None]
    rv_noise = torch.randn_like(trans0) * sig * mask[..., None]
    rots_t = rotvec_to_mat(rv_noise) @ rots0
    tr_hat, rv_hat, psi_hat = model(rots_t, trans_t, t, mask, need_psi=use_psi)
    n = mask.sum() * 3
    loss = ((tr_hat - eps) ** 2 * mask[..., None]).sum() / n
    loss = loss + ((rv_hat * sig + rv_noise) ** 2 * mask[..., None]).sum() / n
    if use_psi:
        loss = loss + ((psi_hat - psi0) ** 2 * mask[..., None]).sum() / (mask.sum() * 2)
    return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--val_manifest", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--psi_start_epoch", type=int, default=5)
    ap.add_argument("--ema", type=float, default=0.999)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    ds = PdbFrames(args.manifest, args.crop)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = None
    if args.val_manifest:
        val_ds = PdbFrames(args.val_manifest, args.crop)
        val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs, num_workers=2)

    net = SE3Denoiser().to(dev)
    ema_net = SE3Denoiser().to(dev).eval().requires_grad_(False)
    ema_net.load_state_dict(net.state_dict())
    # psi head sits idle until psi_start_epoch
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ck_path = os.path.join(args.out, "latest.pt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location=dev)
        net.load_state_dict(ck["model"])
        ema_net.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_psi = epoch >= args.psi_start_epoch
        stats = torch.zeros(2, device=dev)
        val_acc = torch.zeros(2, device=dev)
        tic = time.time()
        for rots, trans, psi, mask in dl:
            rots, trans, psi, mask = rots.to(dev), trans.to(dev), psi.to(dev), mask.to(dev)
            loss = diffusion_loss(model, rots, trans, psi, mask, use_psi)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema_net.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)
            stats += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(stats)
        if val_dl is not None:
            with torch.no_grad():
                for rots, trans, psi, mask in val_dl:
                    rots, trans, psi, mask = rots.to(dev), trans.to(dev), psi.to(dev), mask.to(dev)
                    vl = diffusion_loss(ema_net, rots, trans, psi, mask, use_psi=True)
                    val_acc = val_acc + torch.stack([vl * len(mask), torch.tensor(float(len(mask)), device=dev)])
            dist.all_reduce(val_acc)
        if rank == 0:
            msg = f"epoch {epoch} loss {(stats[0] / stats[1]).item():.4f} psi={use_psi}"
            if val_dl is not None:
                msg += f" val(ema) {(val_acc[0] / val_acc[1]).item():.4f}"
            print(msg + f" {(time.time() - tic) / 60:.1f} min", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "ema": ema_net.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
