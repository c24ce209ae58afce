"""
Dense retriever for PubMed: a shared PubMedBERT encoder for questions and
abstracts, mean pooling, in-batch negatives (InfoNCE).

Long abstracts (512 tokens) did not fit at batch 32 per GPU, so gradient
checkpointing is switched on.

    torchrun --nproc_per_node=8 20_pubmed_retriever_gradckpt.py \
        --train_file data/pubmed_qa_pairs.jsonl --dev_file data/dev_pairs.jsonl
"""
import argparse
import json
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

MODEL = "microsoft/BiomedNLP-PubMedBERT-base-uncased-abstract-fulltext"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_file", required=True)
    p.add_argument("--dev_file", required=True)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--output_dir", default="checkpoints/pubmed-retriever")
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


class PairDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["question"], r["title"] + " " + r["abstract"]


class Collator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        qs, docs = zip(*batch)
        # questions and abstracts go through the encoder in one call
        enc = self.tok(list(qs) + list(docs), truncation=True, max_length=self.max_len,
                       padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]


def mean_pool(hidden, mask):
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-6)


class Encoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return F.normalize(mean_pool(out.last_hidden_state, attention_mask), dim=-1)


@torch.no_grad()
def recall_at_k(encoder, dev, tok, device, k=10, bs=128):
    encoder.eval()
    def embed(texts):
        outs = []
        for i in range(0, len(texts), bs):
            enc = tok(texts[i:i + bs], truncation=True, max_length=512, padding=True, return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs.append(encoder(enc["input_ids"], enc["attention_mask"]).float())
        return torch.cat(outs)
    q = embed([r["question"] for r in dev.rows])
    d = embed([r["title"] + " " + r["abstract"] for r in dev.rows])
    topk = (q @ d.T).topk(k, dim=1).indices
    gold = torch.arange(len(q), device=device).unsqueeze(1)
    return (topk == gold).any(1).float().mean().item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(MODEL)
    train_ds, dev_ds = PairDataset(args.train_file), PairDataset(args.dev_file)
    per_gpu = args.global_batch_size // world
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, collate_fn=Collator(tok, args.max_len),
                        num_workers=4, drop_last=True)

    encoder = Encoder(MODEL)
    encoder.bert.gradient_checkpointing_enable()
    encoder.to(device)
    # the BERT pooler is not used by mean pooling, so DDP must look for unused parameters
    model = DDP(encoder, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(loader, disable=rank != 0, desc=f"epoch {epoch}")
        for step, (ids, mask) in enumerate(pbar):
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                emb = model(ids, mask)
            q, d = emb.float().chunk(2)
            logits = q @ d.T / args.temperature
            labels = torch.arange(q.size(0), device=device)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 20 == 0:
                pbar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")

        if rank == 0:
            r10 = recall_at_k(model.module, dev_ds, tok, device)
            print(f"epoch {epoch}: dev recall@10 = {r10:.4f}")
            out = os.path.join(args.output_dir, f"epoch{epoch}")
            model.module.bert.save_pretrained(out)
            tok.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
