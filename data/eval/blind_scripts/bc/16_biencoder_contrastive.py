"""Bi-encoder (query/passage) contrastive training with cross-GPU in-batch negatives.

    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID train_biencoder.py \
        --config conf/e5_base.yaml train.temperature=0.02
"""
import argparse
import math
import os
import random
import time

import mlflow
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

from retrieval.eval import recall_at_k


def get_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    return OmegaConf.merge(OmegaConf.load(a.config), OmegaConf.from_dotlist(a.overrides))


class PairDataset(Dataset):
    def __init__(self, path):
        import pyarrow.parquet as pq
        t = pq.read_table(path, columns=["query", "positive"])
        self.q = t["query"].to_pylist()
        self.p = t["positive"].to_pylist()

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return "query: " + self.q[i], "passage: " + self.p[i]


class BiEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)

    def embed(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    def forward(self, q, p):
        return self.embed(**q), self.embed(**p)


def make_collate(tokenizer, max_q, max_p):
    def collate(batch):
        qs, ps = zip(*batch)
        q = tokenizer(list(qs), max_length=max_q, truncation=True, padding=True, return_tensors="pt")
        p = tokenizer(list(ps), max_length=max_p, truncation=True, padding=True, return_tensors="pt")
        return dict(q), dict(p)
    return collate


def contrastive_loss(q, p, temperature, rank):
    # gather passages from every GPU so each query sees world*B negatives; the
    # autograd-aware all_gather sends gradients back to the rank that produced them
    all_p = torch.cat(dist_fn.all_gather(p), dim=0)
    logits = q @ all_p.T / temperature
    targets = torch.arange(q.size(0), device=q.device) + rank * q.size(0)
    return F.cross_entropy(logits, targets)


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    ds = PairDataset(cfg.data.train)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=make_collate(tokenizer, cfg.data.max_q, cfg.data.max_p),
                        num_workers=4, pin_memory=True)

    model = BiEncoder(cfg.model.name)
    if cfg.train.grad_ckpt:
        model.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer_steps = cfg.train.epochs * len(loader)
    ckpt_path = os.path.join(cfg.out_dir, "last.pt")
    resume = torch.load(ckpt_path, map_location="cpu") if os.path.exists(ckpt_path) else None
    if resume is not None:
        model.load_state_dict(resume["model"])
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.01)
    warm = int(cfg.train.warmup_ratio * optimizer_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, max(0.0, (optimizer_steps - s) / (optimizer_steps - warm))))
    start_epoch, step, best_r10, run_id = 0, 0, 0.0, None
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        start_epoch, step, best_r10, run_id = resume["epoch"] + 1, resume["step"], resume["best_r10"], resume["run_id"]
        del resume

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        mlflow.set_tracking_uri(cfg.mlflow.uri)
        mlflow.set_experiment(cfg.mlflow.experiment)
        run_id = mlflow.start_run(run_id=run_id, run_name=cfg.name).info.run_id
        mlflow.log_params({"global_batch": cfg.train.batch_size * world, "lr": cfg.train.lr,
                           "temperature": cfg.train.temperature})

    for epoch in range(start_epoch, cfg.train.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for q, p in loader:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qe, pe = model(q, p)
            loss = contrastive_loss(qe.float(), pe.float(), cfg.train.temperature, rank)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metrics({"loss": l.item(), "lr": scheduler.get_last_lr()[0],
                                        "pairs_per_s": 100 * cfg.train.batch_size * world / (time.time() - t0)},
                                       step=step)
                    t0 = time.time()

        if rank == 0:
            # the dev corpus is small (20k passages), scoring it on one GPU takes ~1 min
            metrics = recall_at_k(model.module, tokenizer, cfg.data.dev_queries, cfg.data.dev_corpus,
                                  device=device, ks=(1, 10, 100))
            mlflow.log_metrics({f"dev_{k}": v for k, v in metrics.items()}, step=step)
            if metrics["R@10"] > best_r10:
                best_r10 = metrics["R@10"]
                model.module.encoder.save_pretrained(os.path.join(cfg.out_dir, "best"))
                tokenizer.save_pretrained(os.path.join(cfg.out_dir, "best"))
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                        "best_r10": best_r10, "run_id": run_id}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
