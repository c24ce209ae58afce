"""LECR (Learning Equality curriculum recommendations) - stage 1 bi-encoder retriever.

In-batch negatives gathered across GPUs (bigger effective negative pool), recall@50 eval.
    torchrun --nproc_per_node=4 20_lecr_retriever_contrastive.py --model sentence-transformers/paraphrase-multilingual-mpnet-base-v2
"""
import argparse
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="sentence-transformers/paraphrase-multilingual-mpnet-base-v2")
    p.add_argument("--pairs", default="data/train_pairs.csv")          # topic_text, content_text
    p.add_argument("--val_topics", default="data/val_topics.csv")      # topic_id, topic_text, content_ids
    p.add_argument("--content", default="data/content.csv")            # content_id, content_text
    p.add_argument("--max_len", type=int, default=128)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--topk", type=int, default=50)
    p.add_argument("--out", default="retriever_out")
    return p.parse_args()


class PairDS(Dataset):
    def __init__(self, df):
        self.q, self.d = df.topic_text.tolist(), df.content_text.tolist()

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.q[i], self.d[i]


class Encoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)

    def forward(self, ids, mask):
        h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-6), dim=-1)


class Tok:
    def __init__(self, tokenizer, max_len):
        self.t, self.max_len = tokenizer, max_len

    def __call__(self, texts):
        enc = self.t(list(texts), max_length=self.max_len, truncation=True, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def encode_texts(net, texts, tok, device, bs=256):
    net.eval()
    out = []
    for i in range(0, len(texts), bs):
        ids, mask = tok(texts[i:i + bs])
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(net(ids.to(device), mask.to(device)).float())
    return torch.cat(out) if out else torch.zeros(0, net.bert.config.hidden_size, device=device)


def evaluate(net, content, val, tok, rank, world, device, topk):
    # every rank embeds a strided slice of the content corpus, then everything is gathered
    my_content = content.iloc[rank::world]
    emb = encode_texts(net, my_content.content_text.tolist(), tok, device)
    gathered = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(gathered, emb)
    corpus = torch.cat(gathered)
    ids = []
    for r in range(world):
        ids.extend(content.content_id.iloc[r::world].tolist())

    my_val = val.iloc[rank::world]
    q = encode_texts(net, my_val.topic_text.tolist(), tok, device)
    top = (q @ corpus.T).topk(topk, dim=1).indices.cpu()
    hit, tot = 0.0, 0.0
    for row, gold in zip(top.tolist(), my_val.content_ids.tolist()):
        gold = set(gold.split())
        cand = {ids[j] for j in row}
        hit += len(gold & cand)
        tot += len(gold)
    stats = torch.tensor([hit, tot], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tok = Tok(tokenizer, args.max_len)
    pairs = pd.read_csv(args.pairs).fillna("")
    content = pd.read_csv(args.content).fillna("")
    val = pd.read_csv(args.val_topics).fillna("")

    ds = PairDS(pairs)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True)

    model = DDP(Encoder(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = len(dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * steps), steps)
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (qs, ds_) in enumerate(dl):
            # queries and docs in one forward pass (one DDP forward per backward)
            ids, mask = tok(list(qs) + list(ds_))
            with torch.autocast("cuda", dtype=torch.float16):
                q, d = model(ids.to(device), mask.to(device)).chunk(2)
            # gather docs from all ranks with autograd support -> world*bs negatives per query
            all_d = torch.cat(dist_fn.all_gather(d.float().contiguous()))
            logits = q.float() @ all_d.T / args.temp
            labels = torch.arange(q.size(0), device=device) + rank * q.size(0)
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(dl)} loss {loss.item():.4f}", flush=True)

        recall = evaluate(model.module, content, val, tok, rank, world, device, args.topk)
        if rank == 0:
            print(f"epoch {epoch} recall@{args.topk} {recall:.4f}", flush=True)
            if recall > best:
                best = recall
                os.makedirs(args.out, exist_ok=True)
                model.module.bert.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
