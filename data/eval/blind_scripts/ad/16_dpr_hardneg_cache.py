"""Bi-encoder retriever with mined hard negatives (BM25 / previous-round retriever), multi-GPU.

Passages and queries are tokenized once and cached next to the data as torch files.

    torchrun --nproc_per_node=8 16_dpr_hardneg_cache.py \
        --corpus /data/msmarco/collection.tsv --queries /data/msmarco/queries.train.tsv \
        --train-groups /data/msmarco/train.bm25.negs.jsonl --output-dir runs/biencoder_round1
"""
import argparse
import json
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("biencoder")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--train-groups", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--cache-dir", default=None, help="defaults to the corpus directory")
    ap.add_argument("--overwrite-cache", action="store_true")
    ap.add_argument("--p-max-len", type=int, default=160)
    ap.add_argument("--q-max-len", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8, help="1 positive + (group_size - 1) negatives")
    ap.add_argument("--batch-size", type=int, default=16, help="queries per GPU")
    ap.add_argument("--lr", type=float, default=5e-6, help="for the global batch of 128 queries")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-ratio", type=float, default=0.1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def read_tsv(path):
    out = {}
    with open(path) as f:
        for line in f:
            k, v = line.rstrip("\n").split("\t", 1)
            out[k] = v
    return out


def tokenize_to_cache(path, tokenizer, max_len, cache_dir, overwrite):
    """id -> token id list for every line of a tsv file, cached as <name>.<tokenizer>.<len>.pt"""
    name = os.path.basename(path)
    tok_name = tokenizer.name_or_path.replace("/", "_")
    cache_file = os.path.join(cache_dir, f"{name}.{tok_name}.{max_len}.pt")
    if os.path.exists(cache_file) and not overwrite:
        logger.info("loading cached tokens from %s", cache_file)
        return torch.load(cache_file)
    texts = read_tsv(path)
    ids, encoded = list(texts.keys()), {}
    for i in tqdm(range(0, len(ids), 10000), desc=f"tokenizing {name}", disable=dist.get_rank() != 0):
        chunk = ids[i:i + 10000]
        enc = tokenizer([texts[k] for k in chunk], max_length=max_len, truncation=True,
                        add_special_tokens=False)["input_ids"]
        encoded.update(zip(chunk, enc))
    torch.save(encoded, cache_file)
    return encoded


class TrainGroups(Dataset):
    def __init__(self, path, q_tokens, p_tokens, group_size):
        with open(path) as f:
            self.groups = [json.loads(l) for l in f]
        self.q_tokens, self.p_tokens, self.group_size = q_tokens, p_tokens, group_size
        self.epoch = 0

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        g = self.groups[i]
        rng = random.Random(hash((i, self.epoch)))
        pos = rng.choice(g["pos"])
        negs = g["neg"]
        negs = rng.sample(negs, self.group_size - 1) if len(negs) >= self.group_size - 1 \
            else rng.choices(negs, k=self.group_size - 1)
        return self.q_tokens[g["qid"]], [self.p_tokens[pid] for pid in [pos] + negs]


class Collate:
    def __init__(self, tokenizer, q_len, p_len):
        self.tok, self.q_len, self.p_len = tokenizer, q_len, p_len

    def _pad(self, seqs, max_len):
        feats = [{"input_ids": self.tok.build_inputs_with_special_tokens(s)[:max_len]} for s in seqs]
        return self.tok.pad(feats, padding=True, return_tensors="pt")

    def __call__(self, batch):
        qs = [q for q, _ in batch]
        ps = [p for _, group in batch for p in group]
        return self._pad(qs, self.q_len + 2), self._pad(ps, self.p_len + 2)


class BiEncoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, batch):
        return self.encoder(**batch).last_hidden_state[:, 0]

    def forward(self, q, p):
        return self.encode(q), self.encode(p)


def dist_gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    parts[dist.get_rank()] = t
    return torch.cat(parts)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cache_dir = args.cache_dir or os.path.dirname(args.corpus)
    os.makedirs(cache_dir, exist_ok=True)
    p_tokens = tokenize_to_cache(args.corpus, tokenizer, args.p_max_len, cache_dir, args.overwrite_cache)
    q_tokens = tokenize_to_cache(args.queries, tokenizer, args.q_max_len, cache_dir, args.overwrite_cache)

    dataset = TrainGroups(args.train_groups, q_tokens, p_tokens, args.group_size)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4, drop_last=True,
                        collate_fn=Collate(tokenizer, args.q_max_len, args.p_max_len), pin_memory=True)

    model = DDP(BiEncoder(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * args.warmup_ratio), total)
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dataset.epoch = epoch
        model.train()
        for q, p in loader:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                q_reps, p_reps = model(q, p)
            all_q, all_p = dist_gather(q_reps.float()), dist_gather(p_reps.float())
            scores = all_q @ all_p.t() / args.temperature
            target = torch.arange(all_q.size(0), device=device) * args.group_size
            # every rank computes the same global loss; scale so DDP's average gives the global gradient
            loss = F.cross_entropy(scores, target) * world
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, total, loss.item() / world,
                            scheduler.get_last_lr()[0])

        if rank == 0:
            out = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.encoder.save_pretrained(out)
            tokenizer.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
