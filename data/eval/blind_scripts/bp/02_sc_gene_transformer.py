"""Rank-value-encoding pretraining (Geneformer-style) over several h5ad atlases.

Each cell becomes the sequence of its expressed genes ordered by normalised
expression; 15% of gene tokens are masked and predicted.

torchrun --nnodes=1 --nproc_per_node=4 02_sc_gene_transformer.py --config configs/sc_pretrain.yaml
"""
import argparse
import json
import os
import time

import anndata as ad
import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import BertConfig, BertForMaskedLM, get_cosine_schedule_with_warmup

PAD, MASK, CLS = 0, 1, 2
N_SPECIAL = 3


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as fh:
        cfg = yaml.safe_load(fh)
    cfg["resume"] = a.resume
    return cfg


def gene_medians(X):
    """Non-zero median per gene, used to normalise before ranking (as in Geneformer)."""
    X = X.tocsc()
    med = np.ones(X.shape[1], dtype=np.float32)
    for j in range(X.shape[1]):
        col = X.data[X.indptr[j]:X.indptr[j + 1]]
        if col.size:
            med[j] = np.median(col)
    return med


class RankValueDataset(Dataset):
    def __init__(self, adatas, vocab, max_genes):
        self.max_genes = max_genes
        self.blocks = []
        self.offsets = [0]
        for a in adatas:
            X = a.X if sp.issparse(a.X) else sp.csr_matrix(a.X)
            X = X.tocsr().astype(np.float32)
            totals = np.asarray(X.sum(axis=1)).ravel()
            X = sp.diags(1e4 / np.maximum(totals, 1.0)) @ X
            med = gene_medians(X)
            tok = np.array([vocab[g] for g in a.var_names], dtype=np.int64)
            self.blocks.append((X.tocsr(), med, tok))
            self.offsets.append(self.offsets[-1] + X.shape[0])

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, i):
        b = np.searchsorted(self.offsets, i, side="right") - 1
        X, med, tok = self.blocks[b]
        row = X[i - self.offsets[b]]
        genes, vals = row.indices, row.data / med[row.indices]
        order = np.argsort(-vals, kind="stable")[: self.max_genes - 1]
        ids = np.concatenate([[CLS], tok[genes[order]]])
        return torch.from_numpy(ids)


def mask_collate(batch, mask_prob=0.15):
    L = max(len(x) for x in batch)
    ids = torch.full((len(batch), L), PAD, dtype=torch.long)
    for k, x in enumerate(batch):
        ids[k, : len(x)] = x
    labels = ids.clone()
    cand = ids >= N_SPECIAL
    m = (torch.rand(ids.shape) < mask_prob) & cand
    labels[~m] = -100
    ids[m] = MASK
    return ids, (ids != PAD).long(), labels


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 0))

    adatas = [ad.read_h5ad(p) for p in cfg["h5ad_files"]]
    for a in adatas:
        a.var_names = a.var["ensembl_id"].astype(str).values
        a.var_names_make_unique()
    all_genes = set()
    for a in adatas:
        all_genes |= set(a.var_names)
    vocab = {g: i + N_SPECIAL for i, g in enumerate(all_genes)}
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "gene_vocab.json"), "w") as fh:
            json.dump(vocab, fh)
        print(f"{len(vocab)} genes, {sum(a.n_obs for a in adatas)} cells", flush=True)

    full = RankValueDataset(adatas, vocab, cfg["max_genes"])
    g = torch.Generator().manual_seed(1234)
    n_val = int(0.01 * len(full))
    train_ds, val_ds = torch.utils.data.random_split(full, [len(full) - n_val, n_val], generator=g)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0), drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              collate_fn=mask_collate, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                            collate_fn=mask_collate, num_workers=4)

    bert_cfg = BertConfig(vocab_size=len(vocab) + N_SPECIAL, hidden_size=cfg["d_model"],
                          num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"],
                          intermediate_size=2 * cfg["d_model"], max_position_embeddings=cfg["max_genes"],
                          hidden_act="relu", pad_token_id=PAD, attention_probs_dropout_prob=0.02,
                          hidden_dropout_prob=0.02)
    model = BertForMaskedLM(bert_cfg).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.001)
    steps = cfg["epochs"] * len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, cfg["warmup_steps"], steps)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    step = 0
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, attn, labels in train_loader:
            ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} ({time.time() - t0:.1f}s)", flush=True)
                t0 = time.time()

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for ids, attn, labels in val_loader:
                ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
                with torch.autocast("cuda", dtype=torch.float16):
                    out = model(input_ids=ids, attention_mask=attn, labels=labels)
                m = labels != -100
                n = m.sum()
                tot[0] += out.loss.float() * n
                tot[1] += (out.logits.argmax(-1)[m] == labels[m]).sum()
                tot[2] += n
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch}: val loss {tot[0] / tot[2]:.4f} masked-gene acc {tot[1] / tot[2]:.4f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"ckpt_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
