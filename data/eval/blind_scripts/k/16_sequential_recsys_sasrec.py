"""SASRec next-item recommendation on app session logs, with sampled-softmax training and HR/NDCG@10 eval.

    torchrun --standalone --nproc_per_node=4 16_sequential_recsys_sasrec.py --config configs/sasrec.yaml
"""
import argparse
import logging
import math
import os
import pickle
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("sasrec")


@dataclass
class Config:
    sessions_pkl: str = "data/sessions/user_sequences.pkl"
    max_len: int = 50
    hidden: int = 128
    n_blocks: int = 2
    n_heads: int = 2
    dropout: float = 0.2
    batch_size: int = 512
    n_negatives: int = 128
    lr: float = 1e-3
    epochs: int = 200
    eval_every: int = 5
    patience: int = 6
    seed: int = 2024
    ckpt: str = "checkpoints/sasrec/best.pt"


class TrainSequences(Dataset):
    def __init__(self, seqs, max_len):
        self.seqs, self.max_len = seqs, max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        seq = self.seqs[i][:-2][-(self.max_len + 1):]  # last two items held out (valid, test)
        inp = np.zeros(self.max_len, dtype=np.int64)
        tgt = np.zeros(self.max_len, dtype=np.int64)
        inp[-(len(seq) - 1):] = seq[:-1]
        tgt[-(len(seq) - 1):] = seq[1:]
        return torch.from_numpy(inp), torch.from_numpy(tgt)


class SASRec(nn.Module):
    def __init__(self, n_items, cfg: Config):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, cfg.hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.hidden)
        layer = nn.TransformerEncoderLayer(cfg.hidden, cfg.n_heads, cfg.hidden * 4, cfg.dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_blocks)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        causal = torch.triu(torch.ones(cfg.max_len, cfg.max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, seq):
        pos = torch.arange(seq.size(1), device=seq.device)
        h = self.drop(self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim) + self.pos_emb(pos))
        h = self.encoder(h * (seq > 0).unsqueeze(-1), mask=self.causal[: seq.size(1), : seq.size(1)])
        return self.norm(h)


def sampled_softmax_loss(model: SASRec, hidden, targets, n_items, n_neg):
    mask = targets > 0
    h, pos = hidden[mask], targets[mask]
    neg = torch.randint(1, n_items + 1, (n_neg,), device=h.device)
    pos_logit = (h * model.item_emb(pos)).sum(-1, keepdim=True)
    neg_logit = h @ model.item_emb(neg).T
    logits = torch.cat([pos_logit, neg_logit], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(h), dtype=torch.long, device=h.device))


@torch.no_grad()
def full_rank_eval(model: SASRec, seqs, max_len, device, held_out_offset=2, k=10, bs=1024):
    """Runs on rank 0 only, on the bare module: no collectives in here."""
    model.eval()
    hr, ndcg, n = 0.0, 0.0, 0
    all_items = model.item_emb.weight[1:]
    for start in range(0, len(seqs), bs):
        batch = seqs[start:start + bs]
        inp = np.zeros((len(batch), max_len), dtype=np.int64)
        for j, s in enumerate(batch):
            hist = s[:-held_out_offset][-max_len:]
            inp[j, -len(hist):] = hist
        target = torch.tensor([s[-held_out_offset] for s in batch], device=device) - 1
        h = model(torch.from_numpy(inp).to(device))[:, -1]
        scores = h @ all_items.T
        rank = (scores > scores.gather(1, target[:, None])).sum(1)
        hit = rank < k
        hr += hit.sum().item()
        ndcg += (hit.float() / torch.log2(rank.float() + 2)).sum().item()
        n += len(batch)
    model.train()
    return hr / n, ndcg / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = Config(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local_rank}"))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    # different negatives per rank; the weights themselves are broadcast from rank 0 by DDP
    torch.manual_seed(cfg.seed + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    with open(cfg.sessions_pkl, "rb") as f:
        data = pickle.load(f)
    seqs, n_items = [s for s in data["sequences"] if len(s) >= 4], data["n_items"]
    train_ds = TrainSequences(seqs, cfg.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=4, pin_memory=True)

    model = DDP(SASRec(n_items, cfg).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98))

    best_ndcg, bad_evals = -1.0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for inp, tgt in loader:
            inp, tgt = inp.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            hidden = model(inp)
            loss = sampled_softmax_loss(model.module, hidden, tgt, n_items, cfg.n_negatives)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"rank": rank, "batches": int(loss_sum[1].item())})
        dist.all_reduce(loss_sum)

        if (epoch + 1) % cfg.eval_every != 0:
            continue
        stop = torch.zeros(1, device=device)
        if rank == 0:
            hr, ndcg = full_rank_eval(model.module, seqs, cfg.max_len, device)
            logger.info("epoch %d loss %.4f HR@10 %.4f NDCG@10 %.4f batches/rank %s", epoch,
                        (loss_sum[0] / loss_sum[1]).item(), hr, ndcg, [p["batches"] for p in per_rank])
            if ndcg > best_ndcg:
                best_ndcg, bad_evals = ndcg, 0
                os.makedirs(os.path.dirname(cfg.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg), "epoch": epoch}, cfg.ckpt)
            else:
                bad_evals += 1
            stop[0] = float(bad_evals >= cfg.patience)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            logger.info("early stop at epoch %d (best NDCG@10 %.4f)", epoch, best_ndcg)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
