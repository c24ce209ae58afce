"""Pocket-conditioned ligand diffusion (DiffSBDD-style) trained with DeepSpeed ZeRO-3.

    deepspeed --num_gpus=8 06_pocket_diffusion_zero3.py --data data/crossdocked_pocket10.pt --save_dir ckpts/sbdd_z3
"""
import argparse
import copy
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_LIG, N_POCKET = 48, 192
LIG_TYPES, POCKET_TYPES = 10, 20


class PocketLigandSet(Dataset):
    """Pre-padded complexes: ligand coords/types/mask and pocket (CA + residue type) coords/types/mask."""

    def __init__(self, path, split):
        blob = torch.load(path)[split]
        self.lig_x, self.lig_h, self.lig_m = blob["lig_x"], blob["lig_h"], blob["lig_m"]
        self.poc_x, self.poc_h, self.poc_m = blob["poc_x"], blob["poc_h"], blob["poc_m"]

    def __len__(self):
        return self.lig_x.shape[0]

    def __getitem__(self, i):
        return (self.lig_x[i], self.lig_h[i], self.lig_m[i],
                self.poc_x[i], self.poc_h[i], self.poc_m[i])


class JointEGNNLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.e = nn.Sequential(nn.Linear(2 * d + 1, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.n = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.c = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 1, bias=False))
        self.norm = nn.LayerNorm(d)

    def forward(self, h, x, node_m, move_m):
        diff = x[:, :, None] - x[:, None]
        d2 = diff.pow(2).sum(-1, keepdim=True)
        B, N, D = h.shape
        pair = torch.cat([h[:, :, None].expand(B, N, N, D), h[:, None].expand(B, N, N, D), d2], -1)
        em = (node_m[:, :, None] * node_m[:, None]).unsqueeze(-1)
        m = self.e(pair) * em
        h = self.norm(h + self.n(torch.cat([h, m.sum(2) / 50.0], -1))) * node_m[..., None]
        upd = (diff / (d2.sqrt() + 1) * self.c(m) * em).sum(2) / 50.0
        x = x + upd * move_m[..., None]  # pocket atoms stay fixed
        return h, x


class PocketDenoiser(nn.Module):
    def __init__(self, d=256, layers=6):
        super().__init__()
        self.lig_in = nn.Linear(LIG_TYPES + 1, d)
        self.poc_in = nn.Embedding(POCKET_TYPES, d)
        self.layers = nn.ModuleList(JointEGNNLayer(d) for _ in range(layers))
        self.lig_out = nn.Linear(d, LIG_TYPES)

    def forward(self, lx, lh, lm, px, ph, pm, t):
        h = torch.cat([self.lig_in(torch.cat([lh, t[:, None, None].expand(-1, lh.shape[1], 1)], -1)),
                       self.poc_in(ph)], 1)
        x = torch.cat([lx, px], 1)
        node_m = torch.cat([lm, pm], 1)
        move_m = torch.cat([lm, torch.zeros_like(pm)], 1)
        x_in = x
        for layer in self.layers:
            h, x = layer(h, x, node_m, move_m)
        eps_x = (x - x_in)[:, :N_LIG]
        return eps_x, self.lig_out(h[:, :N_LIG]) * lm[..., None]


def pocket_center(px, pm):
    return (px * pm[..., None]).sum(1, keepdim=True) / pm.sum(1)[:, None, None]


def diffusion_step_loss(engine, batch, ab, T, dtype):
    lx, lh, lm, px, ph, pm = batch
    c = pocket_center(px, pm)
    lx, px = (lx - c) * lm[..., None], (px - c) * pm[..., None]
    h0 = nn.functional.one_hot(lh, LIG_TYPES).float() * lm[..., None]
    B = lx.shape[0]
    t = torch.randint(1, T + 1, (B,), device=lx.device)
    a = ab[t][:, None, None]
    ex, eh = torch.randn_like(lx) * lm[..., None], torch.randn_like(h0) * lm[..., None]
    xt, ht = a.sqrt() * lx + (1 - a).sqrt() * ex, a.sqrt() * h0 + (1 - a).sqrt() * eh
    pex, peh = engine(xt.to(dtype), ht.to(dtype), lm.to(dtype), px.to(dtype), ph, pm.to(dtype),
                      (t.float() / T).to(dtype))
    n = lm.sum() * (3 + LIG_TYPES)
    return (((pex.float() - ex) ** 2).sum() + ((peh.float() - eh) ** 2).sum()) / n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--save_dir", default="ckpts/sbdd_z3")
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--micro_bs", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--T", type=int, default=500)
    parser.add_argument("--ema_decay", type=float, default=0.999)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-12}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 500,
    }

    train_set = PocketLigandSet(args.data, "train")
    val_set = PocketLigandSet(args.data, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=args.micro_bs, sampler=val_sampler, num_workers=2)

    model = PocketDenoiser()
    ema_model = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    ab = torch.cos(torch.linspace(0, 1, args.T + 1, device=device) * torch.pi / 2).pow(2).clamp(1e-5, 1 - 1e-5)
    dtype = torch.bfloat16

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for step, batch in enumerate(loader):
            batch = [b.to(device, non_blocking=True) for b in batch]
            loss = diffusion_step_loss(engine, batch, ab, args.T, dtype)
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary():
                with torch.no_grad():
                    for p_ema, p in zip(ema_model.parameters(), engine.module.parameters()):
                        p_ema.mul_(args.ema_decay).add_(p.detach().float(), alpha=1 - args.ema_decay)

        engine.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = [b.to(device) for b in batch]
                tot[0] += diffusion_step_loss(engine, batch, ab, args.T, dtype) * batch[0].shape[0]
                tot[1] += batch[0].shape[0]
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} val_loss {(tot[0] / tot[1]).item():.4f}", flush=True)

        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if rank == 0:
            torch.save(ema_model.state_dict(), os.path.join(args.save_dir, "ema_latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
