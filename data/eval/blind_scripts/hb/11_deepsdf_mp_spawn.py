"""Auto-decoder SDF training (DeepSDF recipe) launched with torch.multiprocessing.spawn.

    python 11_deepsdf_mp_spawn.py --config configs/sofas.yaml --gpus 4
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def list_shapes(sdf_dir, split_file):
    with open(split_file) as f:
        wanted = [l.strip() for l in f if l.strip()]
    return [s for s in wanted if os.path.isfile(os.path.join(sdf_dir, s + ".npz"))]


class SdfSamples(Dataset):
    def __init__(self, sdf_dir, shape_ids, n_samples):
        self.sdf_dir, self.shape_ids, self.n_samples = sdf_dir, shape_ids, n_samples

    def __len__(self):
        return len(self.shape_ids)

    def load(self, i):
        d = np.load(os.path.join(self.sdf_dir, self.shape_ids[i] + ".npz"))
        return torch.from_numpy(d["pos"]).float(), torch.from_numpy(d["neg"]).float()

    def __getitem__(self, i):
        pos, neg = self.load(i)
        h = self.n_samples // 2
        s = torch.cat([pos[torch.randint(len(pos), (h,))], neg[torch.randint(len(neg), (h,))]])
        return s, i


class SDFDecoder(nn.Module):
    def __init__(self, latent_dim=256, width=512, depth=8, skip=4):
        super().__init__()
        self.skip = skip
        layers = []
        for i in range(depth):
            cin = latent_dim + 3 if i == 0 else width
            cout = width - (latent_dim + 3) if i + 1 == skip else width
            layers.append(nn.utils.parametrizations.weight_norm(nn.Linear(cin, cout)))
        self.layers = nn.ModuleList(layers)
        self.out = nn.Linear(width, 1)

    def forward(self, z, xyz):
        inp = torch.cat([z, xyz], -1)
        h = inp
        for i, layer in enumerate(self.layers):
            if i == self.skip:
                h = torch.cat([h, inp], -1)
            h = F.dropout(F.relu(layer(h)), 0.2, self.training)
        return torch.tanh(self.out(h))


class ShapeCodes(nn.Module):
    def __init__(self, n_shapes, latent_dim):
        super().__init__()
        self.decoder = SDFDecoder(latent_dim)
        self.codes = nn.Embedding(n_shapes, latent_dim)
        nn.init.normal_(self.codes.weight, 0.0, 0.01)

    def forward(self, idx, xyz):
        z = self.codes(idx)
        return self.decoder(z, xyz), z


def fit_latent(decoder, pos, neg, latent_dim, device, iters=800, n=8000, clamp=0.1):
    """Test-time latent optimisation with the decoder frozen."""
    z = torch.zeros(1, latent_dim, device=device).normal_(0, 0.01).requires_grad_(True)
    opt = torch.optim.Adam([z], lr=5e-3)
    samples = torch.cat([pos, neg]).to(device)
    for _ in range(iters):
        s = samples[torch.randint(len(samples), (n,), device=device)]
        pred = decoder(z.expand(n, -1), s[:, :3])
        loss = (pred.clamp(-clamp, clamp) - s[:, 3:].clamp(-clamp, clamp)).abs().mean() + 1e-4 * z.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = decoder(z.expand(len(samples), -1), samples[:, :3])
        return (pred.clamp(-clamp, clamp) - samples[:, 3:].clamp(-clamp, clamp)).abs().mean()


def worker(rank, world_size, cfg, train_ids, val_ids):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"])

    train_set = SdfSamples(cfg["sdf_dir"], train_ids, cfg["samples_per_shape"])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["shapes_per_batch"] // world_size, sampler=sampler,
                        num_workers=cfg["workers"], pin_memory=True, drop_last=True)

    model = ShapeCodes(len(train_set), cfg["latent_dim"]).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam([
        {"params": model.module.decoder.parameters(), "lr": cfg["lr_decoder"]},
        {"params": model.module.codes.parameters(), "lr": cfg["lr_codes"]},
    ])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=500, gamma=0.5)

    out_dir = cfg["out_dir"]
    ckpt_file = os.path.join(out_dir, "latest.pt")
    start_epoch = 0
    if os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    clamp = cfg["clamp_dist"]
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for samples, idx in loader:
            samples = samples.to(device, non_blocking=True)
            B, S, _ = samples.shape
            idx = idx.to(device).repeat_interleave(S)
            samples = samples.view(-1, 4)
            pred, z = model(idx, samples[:, :3])
            l1 = (pred.clamp(-clamp, clamp) - samples[:, 3:].clamp(-clamp, clamp)).abs().mean()
            reg = cfg["code_reg"] * min(1.0, epoch / 100) * z.pow(2).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            (l1 + reg).backward()
            opt.step()
            stats += torch.stack([l1.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"[{epoch:04d}] sdf L1 {(stats[0] / stats[1]).item():.5f}  {time.time() - t0:.1f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "train_ids": train_ids}, ckpt_file)

        if (epoch + 1) % cfg["eval_every"] == 0:
            # every rank fits latents for its own slice of the validation shapes
            decoder = model.module.decoder.eval()
            decoder.requires_grad_(False)
            val_set = SdfSamples(cfg["sdf_dir"], val_ids, 0)
            err = torch.zeros(2, device=device)
            for i in range(rank, min(len(val_set), cfg["eval_shapes"]), world_size):
                pos, neg = val_set.load(i)
                err += torch.stack([fit_latent(decoder, pos, neg, cfg["latent_dim"], device, clamp=clamp),
                                    torch.ones((), device=device)])
            decoder.requires_grad_(True)
            decoder.train()
            dist.all_reduce(err)
            if rank == 0:
                print(f"  val sdf L1 after latent fit: {(err[0] / err[1].clamp(min=1)).item():.5f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29513")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)

    os.makedirs(cfg["out_dir"], exist_ok=True)
    train_ids = list_shapes(cfg["sdf_dir"], cfg["train_split"])
    val_ids = list_shapes(cfg["sdf_dir"], cfg["val_split"])
    print(f"{len(train_ids)} train / {len(val_ids)} val shapes on {a.gpus} GPUs")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", a.port)
    mp.spawn(worker, args=(a.gpus, cfg, train_ids, val_ids), nprocs=a.gpus, join=True)


if __name__ == "__main__":
    main()
