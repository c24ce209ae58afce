"""
Train the RQ-VAE item tokenizer with DDP, freeze it, then assign semantic IDs to the
whole catalogue. Encoding is sharded over ranks; the codes are gathered on every rank
and collisions are resolved by appending an extra disambiguation level.

torchrun --nproc_per_node=4 03_semantic_id_collisions.py --config configs/rqvae_sports.yaml
"""
import argparse
import logging
import os
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("rqvae")


DEFAULTS = dict(
    emb_path="data/sports/item_emb.npy",
    out_dir="artifacts/sports",
    latent_dim=32,
    hidden_dims=[512, 256, 128],
    num_levels=3,
    codebook_size=256,
    beta=0.25,
    lr=1e-3,
    batch_size=2048,
    epochs=150,
    encode_batch_size=8192,
    seed=2024,
)


class ResidualVQ(nn.Module):
    def __init__(self, num_levels, codebook_size, dim, beta):
        super().__init__()
        self.books = nn.ModuleList(nn.Embedding(codebook_size, dim) for _ in range(num_levels))
        for b in self.books:
            nn.init.uniform_(b.weight, -1.0 / codebook_size, 1.0 / codebook_size)
        self.beta = beta

    def forward(self, z):
        res, out, loss, ids = z, torch.zeros_like(z), 0.0, []
        for book in self.books:
            dist_ = torch.cdist(res, book.weight)
            idx = dist_.argmin(-1)
            q = book(idx)
            loss = loss + F.mse_loss(q, res.detach()) + self.beta * F.mse_loss(res, q.detach())
            out = out + q
            res = res - q.detach()
            ids.append(idx)
        return z + (out - z).detach(), torch.stack(ids, -1), loss


class RQVAE(nn.Module):
    def __init__(self, in_dim, hidden_dims, latent_dim, num_levels, codebook_size, beta):
        super().__init__()
        enc, d = [], in_dim
        for h in hidden_dims:
            enc += [nn.Linear(d, h), nn.ReLU()]
            d = h
        enc.append(nn.Linear(d, latent_dim))
        self.encoder = nn.Sequential(*enc)
        dec, d = [], latent_dim
        for h in reversed(hidden_dims):
            dec += [nn.Linear(d, h), nn.ReLU()]
            d = h
        dec.append(nn.Linear(d, in_dim))
        self.decoder = nn.Sequential(*dec)
        self.rq = ResidualVQ(num_levels, codebook_size, latent_dim, beta)

    def forward(self, x):
        zq, ids, vq_loss = self.rq(self.encoder(x))
        return self.decoder(zq), ids, vq_loss

    @torch.no_grad()
    def encode(self, x):
        return self.rq(self.encoder(x))[1]


def resolve_collisions(codes):
    """Append a suffix level so every item gets a unique tuple (TIGER, sec. 3.1)."""
    seen = defaultdict(int)
    suffix = np.zeros((codes.shape[0], 1), dtype=codes.dtype)
    for i, row in enumerate(map(tuple, codes)):
        suffix[i, 0] = seen[row]
        seen[row] += 1
    return np.concatenate([codes, suffix], axis=1), max(seen.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(cfg["seed"])

    emb = torch.from_numpy(np.load(cfg["emb_path"]).astype(np.float32))
    emb = (emb - emb.mean(0)) / (emb.std(0) + 1e-6)
    num_items, in_dim = emb.shape
    ds = TensorDataset(emb)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=2, pin_memory=True)

    model = RQVAE(in_dim, cfg["hidden_dims"], cfg["latent_dim"], cfg["num_levels"],
                  cfg["codebook_size"], cfg["beta"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adagrad(model.parameters(), lr=cfg["lr"])

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        agg = torch.zeros(3, device=device)
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            x_hat, _, vq_loss = model(x)
            rec = F.mse_loss(x_hat, x)
            loss = rec + vq_loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            agg += torch.stack([rec.detach(), vq_loss.detach(), torch.tensor(1.0, device=device)])
        dist.all_reduce(agg)
        if epoch % 10 == 0 or epoch == cfg["epochs"] - 1:
            logger.info("epoch %d rec %.5f vq %.5f", epoch, (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item())

    # ---- freeze the tokenizer and encode the catalogue, one contiguous shard per rank ----
    tokenizer = model.module.eval()
    for p in tokenizer.parameters():
        p.requires_grad_(False)

    shards = np.array_split(np.arange(num_items), world)
    my_idx = torch.from_numpy(shards[rank])
    local_codes = []
    for start in range(0, len(my_idx), cfg["encode_batch_size"]):
        idx = my_idx[start:start + cfg["encode_batch_size"]]
        local_codes.append(tokenizer.encode(emb[idx].to(device)))
    local_codes = torch.cat(local_codes).contiguous()

    gathered = [torch.empty_like(local_codes) for _ in range(world)]
    dist.all_gather(gathered, local_codes)
    codes = torch.cat(gathered).cpu().numpy()
    logger.info("gathered %d codes for %d items", codes.shape[0], num_items)

    sem_ids, max_dup = resolve_collisions(codes)
    n_unique_prefix = len({tuple(r) for r in codes})
    logger.info("unique prefixes %d / %d, largest collision group %d", n_unique_prefix, num_items, max_dup)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        np.save(os.path.join(cfg["out_dir"], "sem_ids.npy"), sem_ids)
        torch.save({"state_dict": tokenizer.state_dict(), "cfg": cfg},
                   os.path.join(cfg["out_dir"], "rqvae.pt"))
        logger.info("wrote %s", os.path.join(cfg["out_dir"], "sem_ids.npy"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
