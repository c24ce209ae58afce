"""PairRE (Chao et al., ACL 2021) on ogbl-wikikg2-style id files, multi-GPU.

Usage:
    torchrun --nproc_per_node=8 08_pairre_omegaconf.py config=configs/pairre.yaml train.lr=5e-4
"""
import logging
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

DEFAULT_CFG = """
data:
  root: data/wikikg2
  num_workers: 8
model:
  dim: 200
  gamma: 8.0
train:
  batch_size: 512
  num_neg: 128
  adv_temp: 1.0
  lr: 5e-4
  weight_decay: 0.0
  epochs: 20
  grad_clip: 1.0
  log_every: 200
eval:
  num_candidates: 500
  batch_size: 64
out_dir: runs/pairre
"""

logger = logging.getLogger("pairre")


def load_cfg():
    cfg = OmegaConf.create(DEFAULT_CFG)
    cli = OmegaConf.from_cli(sys.argv[1:])
    if "config" in cli:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(cli.pop("config")))
    return OmegaConf.merge(cfg, cli)


class TripleSet(Dataset):
    def __init__(self, triples, num_entities, num_neg):
        self.triples = torch.from_numpy(triples)
        self.num_entities = num_entities
        self.num_neg = num_neg

    def __len__(self):
        return self.triples.shape[0]

    def __getitem__(self, i):
        neg = torch.randint(self.num_entities, (self.num_neg,))
        corrupt_head = torch.rand(()) < 0.5
        return self.triples[i], neg, corrupt_head


class PairRE(nn.Module):
    def __init__(self, num_entities, num_relations, dim, gamma):
        super().__init__()
        self.gamma = gamma
        self.entity = nn.Embedding(num_entities, dim)
        self.rel_head = nn.Embedding(num_relations, dim)
        self.rel_tail = nn.Embedding(num_relations, dim)
        rng = (gamma + 2.0) / dim
        for emb in (self.entity, self.rel_head, self.rel_tail):
            nn.init.uniform_(emb.weight, -rng, rng)

    def _score(self, h, rh, rt, t):
        h, t = F.normalize(h, p=2, dim=-1), F.normalize(t, p=2, dim=-1)
        return self.gamma - torch.norm(h * rh - t * rt, p=1, dim=-1)

    def forward(self, pos, neg, corrupt_head):
        h = self.entity(pos[:, 0]).unsqueeze(1)
        t = self.entity(pos[:, 2]).unsqueeze(1)
        rh = self.rel_head(pos[:, 1]).unsqueeze(1)
        rt = self.rel_tail(pos[:, 1]).unsqueeze(1)
        n = self.entity(neg)
        ch = corrupt_head.view(-1, 1, 1)
        nh = torch.where(ch, n, h)
        nt = torch.where(ch, t, n)
        return self._score(h, rh, rt, t).squeeze(1), self._score(nh, rh, rt, nt)


def self_adversarial_loss(pos, neg, temp):
    w = torch.softmax(neg * temp, dim=-1).detach()
    return (-F.logsigmoid(pos).mean() - (w * F.logsigmoid(-neg)).sum(-1).mean()) / 2


@torch.no_grad()
def eval_candidates(model, triples, cand_heads, cand_tails, device, rank, world, bs):
    """OGB wikikg2 protocol: rank the true entity among 500 given negatives (per direction)."""
    model.eval()
    idx = np.arange(rank, len(triples), world)
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # mrr, hits@10, count
    for s in range(0, len(idx), bs):
        sel = idx[s:s + bs]
        b = torch.from_numpy(triples[sel]).to(device)
        for cands, side in ((cand_tails, 2), (cand_heads, 0)):
            c = torch.from_numpy(cands[sel]).to(device)                 # B x C
            ents = torch.cat([b[:, side:side + 1], c], dim=1)            # true first
            rh = model.rel_head(b[:, 1]).unsqueeze(1)
            rt = model.rel_tail(b[:, 1]).unsqueeze(1)
            if side == 2:
                scores = model._score(model.entity(b[:, 0]).unsqueeze(1), rh, rt, model.entity(ents))
            else:
                scores = model._score(model.entity(ents), rh, rt, model.entity(b[:, 2]).unsqueeze(1))
            ranks = 1 + (scores[:, 1:] >= scores[:, :1]).sum(1).double()
            sums[0] += (1.0 / ranks).sum()
            sums[1] += (ranks <= 10).sum()
            sums[2] += ranks.numel()
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    cfg = load_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out_dir, "config.yaml"))

    root = cfg.data.root
    train = np.load(os.path.join(root, "train.npy"))
    valid = np.load(os.path.join(root, "valid.npy"))
    valid_h = np.load(os.path.join(root, "valid_head_neg.npy"))[:, :cfg.eval.num_candidates]
    valid_t = np.load(os.path.join(root, "valid_tail_neg.npy"))[:, :cfg.eval.num_candidates]
    meta = np.load(os.path.join(root, "meta.npy"))
    num_entities, num_relations = int(meta[0]), int(meta[1])
    logger.info("entities %d relations %d train %d", num_entities, num_relations, len(train))

    dataset = TripleSet(train, num_entities, cfg.train.num_neg)
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
                        num_workers=cfg.data.num_workers, pin_memory=True, persistent_workers=True)

    model = PairRE(num_entities, num_relations, cfg.model.dim, cfg.model.gamma).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=cfg.train.lr,
                                 weight_decay=cfg.train.weight_decay)
    total_steps = cfg.train.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    best, step = 0.0, 0
    for epoch in range(cfg.train.epochs):
        t0 = time.time()
        for pos, neg, ch in loader:
            pos, neg, ch = pos.to(device), neg.to(device), ch.to(device)
            pos_s, neg_s = ddp_model(pos, neg, ch)
            loss = self_adversarial_loss(pos_s, neg_s, cfg.train.adv_temp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.train.log_every == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0])

        mrr, h10 = eval_candidates(model, valid, valid_h, valid_t, device, rank, world, cfg.eval.batch_size)
        logger.info("epoch %d done in %.0fs  valid MRR %.4f  H@10 %.4f", epoch, time.time() - t0, mrr, h10)
        if rank == 0:
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "mrr": mrr}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if mrr > best:
                best = mrr
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    logger.info("best valid MRR %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
