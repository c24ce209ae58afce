#!/usr/bin/env python
"""LightXML-style tagger: transformer text encoder, cluster (meta) classifier and a
label ranker over the labels of the top clusters.

    torchrun --nproc_per_node=8 04_lightxml_style.py --config configs/lightxml_wiki500k.json
"""
import argparse
import json
import logging
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)

DEFAULTS = {
    "model_path": "/mnt/shared/models/roberta-base",
    "data_dir": "/mnt/shared/xmc/wiki500k",
    "output_dir": "/mnt/shared/xmc/runs/lightxml",
    "max_len": 128,
    "hidden_layers": 5,
    "label_dim": 300,
    "top_clusters": 10,
    "global_batch_size": 256,
    "epochs": 20,
    "meta_warmup_epochs": 2,
    "lr": 1e-4,
    "seed": 2021,
}


class JsonlDocs(Dataset):
    def __init__(self, path):
        self.text, self.labels = [], []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                self.text.append(rec["text"])
                self.labels.append(rec["labels"])

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return self.text[i], self.labels[i], i


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def __call__(self, batch):
        texts, labels, rows = zip(*batch)
        enc = self.tok(list(texts), max_length=self.max_len, truncation=True,
                       padding=True, return_tensors="pt")
        width = max(len(l) for l in labels)
        pos = torch.full((len(labels), width), -1, dtype=torch.long)
        for i, l in enumerate(labels):
            pos[i, : len(l)] = torch.tensor(l, dtype=torch.long)
        return enc["input_ids"], enc["attention_mask"], pos, torch.tensor(rows)


class LightXML(nn.Module):
    def __init__(self, cfg, num_clusters, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(cfg["model_path"], add_pooling_layer=False)
        hid = self.encoder.config.hidden_size * cfg["hidden_layers"]
        self.n_layers = cfg["hidden_layers"]
        self.drop = nn.Dropout(0.2)
        self.meta = nn.Linear(hid, num_clusters)
        self.rank_proj = nn.Linear(hid, cfg["label_dim"])
        self.label_emb = nn.Embedding(num_labels, cfg["label_dim"])
        nn.init.xavier_uniform_(self.label_emb.weight)

    def features(self, ids, mask):
        hs = self.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        return self.drop(torch.cat([h[:, 0] for h in hs[-self.n_layers:]], dim=-1))

    def forward(self, ids, mask, cand=None):
        x = self.features(ids, mask)
        meta_logits = self.meta(x)
        if cand is None:
            return meta_logits, None
        r = self.rank_proj(x)
        rank_logits = torch.bmm(self.label_emb(cand), r.unsqueeze(-1)).squeeze(-1)
        return meta_logits, rank_logits


def candidates(meta_logits, k, cluster_labels, extra=None):
    score = meta_logits.detach()
    if extra is not None:
        score = score + extra
    top = score.topk(k, dim=1).indices
    return cluster_labels[top].flatten(1)          # [B, k * max_cluster_size], -1 padded


def multi_hot(num, pos, width, device):
    t = torch.zeros(pos.size(0), width, device=device)
    t.scatter_add_(1, pos.clamp(min=0), (pos >= 0).float())
    return t.clamp_(max=1.0)


@torch.no_grad()
def evaluate(net, loader, cluster_labels, cfg, device, k=5):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)   # P@1, P@5 sums, n_docs
    for ids, mask, pos, _ in loader:
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            meta_logits, _ = net(ids, mask)
            cand = candidates(meta_logits, cfg["top_clusters"], cluster_labels)
            _, rank_logits = net(ids, mask, cand.clamp(min=0))
        scores = torch.sigmoid(rank_logits.float()) * torch.sigmoid(
            meta_logits.float().topk(cfg["top_clusters"], 1).values).repeat_interleave(
            cluster_labels.size(1), dim=1)
        scores = scores.masked_fill(cand < 0, -1.0)
        top = cand.gather(1, scores.topk(k, dim=1).indices)
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += hit[:, 0].sum()
        acc[1] += hit.sum() / k
        acc[2] += ids.size(0)
    dist.all_reduce(acc)
    net.train()
    return {"P@1": (acc[0] / acc[2]).item(), "P@5": (acc[1] / acc[2]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = dict(DEFAULTS)
    cli = ap.parse_args()
    if cli.config:
        with open(cli.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(cfg["seed"])

    cluster_labels = torch.from_numpy(
        np.load(os.path.join(cfg["data_dir"], "cluster_labels.npy"))).long().to(device)
    label_cluster = torch.from_numpy(
        np.load(os.path.join(cfg["data_dir"], "label_cluster.npy"))).long().to(device)
    num_clusters = cluster_labels.size(0)
    num_labels = label_cluster.size(0)

    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    collate = Collator(tokenizer, cfg["max_len"])
    train_ds = JsonlDocs(os.path.join(cfg["data_dir"], "train.jsonl"))
    test_ds = JsonlDocs(os.path.join(cfg["data_dir"], "test.jsonl"))
    test_ds = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["global_batch_size"] // world,
                              sampler=sampler, collate_fn=collate, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=128, collate_fn=collate, num_workers=4)

    net = LightXML(cfg, num_clusters, num_labels).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        warmup = epoch < cfg["meta_warmup_epochs"]
        t0 = time.time()
        for step, (ids, mask, pos, _) in enumerate(train_loader):
            ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
            pos_c = torch.where(pos >= 0, label_cluster[pos.clamp(min=0)], pos)
            meta_t = multi_hot(num_clusters, pos_c, num_clusters, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if warmup:
                    meta_logits, _ = model(ids, mask)
                    loss = F.binary_cross_entropy_with_logits(meta_logits.float(), meta_t)
                else:
                    with torch.no_grad():
                        x = net.features(ids, mask)
                        cand = candidates(net.meta(x), cfg["top_clusters"], cluster_labels,
                                          extra=1e4 * meta_t)
                    meta_logits, rank_logits = model(ids, mask, cand.clamp(min=0))
                    rank_t = (cand.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).float()
                    valid = (cand >= 0).float()
                    loss = F.binary_cross_entropy_with_logits(meta_logits.float(), meta_t) + (
                        F.binary_cross_entropy_with_logits(rank_logits.float(), rank_t,
                                                           reduction="none") * valid
                    ).sum() / valid.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 200 == 0:
                log.info("ep %d step %d warmup=%s loss %.4f (%.0fs)", epoch, step, warmup,
                         loss.item(), time.time() - t0)

        if not warmup:
            res = evaluate(net, test_loader, cluster_labels, cfg, device)
            log.info("epoch %d P@1 %.4f P@5 %.4f", epoch, res["P@1"], res["P@5"])
            if rank == 0 and res["P@5"] > best:
                best = res["P@5"]
                os.makedirs(cfg["output_dir"], exist_ok=True)
                torch.save(net.state_dict(), os.path.join(cfg["output_dir"], "model_best.bin"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
