"""Train a TIGER-style generative retriever (T5 encoder-decoder over semantic IDs).

The item tokenizer (RQ-VAE) has already been trained and frozen; its output is a
(num_items, num_levels) array of codes, the last level being the collision suffix.

Launch:
    torchrun --standalone --nproc_per_node=8 01_tiger_seq2seq_ddp.py --data_dir data/beauty
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration, get_cosine_schedule_with_warmup

PAD, EOS, SEP = 0, 1, 2
NUM_SPECIAL = 3


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", type=str, required=True)
    p.add_argument("--sem_ids", type=str, default="sem_ids.npy")
    p.add_argument("--codebook_size", type=int, default=256)
    p.add_argument("--max_items", type=int, default=20)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--num_heads", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.035)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--warmup_steps", type=int, default=10000)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--beams", type=int, default=20)
    p.add_argument("--output_dir", type=str, default="runs/tiger")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class SemanticIdSeqDataset(Dataset):
    """Each sample: flattened semantic IDs of the history -> semantic ID of the target item."""

    def __init__(self, sequences, sem_ids, codebook_size, max_items, mode):
        self.sem_ids = sem_ids
        self.codebook_size = codebook_size
        self.max_items = max_items
        self.samples = []
        for seq in sequences:
            if mode == "train":
                # leave the last two items for validation / test
                for t in range(1, len(seq) - 2):
                    self.samples.append((seq[max(0, t - max_items):t], seq[t]))
            elif mode == "valid":
                self.samples.append((seq[-2 - max_items:-2], seq[-2]))
            else:
                self.samples.append((seq[-1 - max_items:-1], seq[-1]))

    def item_tokens(self, item):
        codes = self.sem_ids[item]
        return [NUM_SPECIAL + lvl * self.codebook_size + int(c) for lvl, c in enumerate(codes)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        history, target = self.samples[idx]
        src = []
        for it in history:
            src.extend(self.item_tokens(it))
        tgt = self.item_tokens(target) + [EOS]
        return torch.tensor(src, dtype=torch.long), torch.tensor(tgt, dtype=torch.long)


def collate(batch):
    srcs, tgts = zip(*batch)
    max_len = max(len(s) for s in srcs)
    input_ids = torch.full((len(srcs), max_len), PAD, dtype=torch.long)
    attn = torch.zeros((len(srcs), max_len), dtype=torch.long)
    for i, s in enumerate(srcs):
        input_ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
    labels = torch.stack(tgts)
    return input_ids, attn, labels


def load_sequences(path):
    with open(path) as f:
        return [json.loads(line)["items"] for line in f]


@torch.no_grad()
def evaluate(model, loader, device, beams, num_levels):
    model.eval()
    hits = {5: 0.0, 10: 0.0}
    ndcg = {5: 0.0, 10: 0.0}
    count = 0.0
    for input_ids, attn, labels in loader:
        input_ids, attn, labels = input_ids.to(device), attn.to(device), labels.to(device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=num_levels + 1,
            num_beams=beams,
            num_return_sequences=beams,
            early_stopping=True,
        )
        # drop decoder start token, keep the code tokens
        preds = out[:, 1 : num_levels + 1].reshape(input_ids.size(0), beams, num_levels)
        target = labels[:, :num_levels].unsqueeze(1)
        match = (preds == target).all(-1)  # B x beams
        for k in hits:
            m = match[:, :k]
            found = m.any(-1)
            rank = m.float().argmax(-1)
            hits[k] += found.float().sum().item()
            ndcg[k] += (found.float() / torch.log2(rank.float() + 2)).sum().item()
        count += input_ids.size(0)
    stats = torch.tensor([hits[5], hits[10], ndcg[5], ndcg[10], count], device=device, dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    n = stats[4].item()
    return {
        "recall@5": stats[0].item() / n,
        "recall@10": stats[1].item() / n,
        "ndcg@5": stats[2].item() / n,
        "ndcg@10": stats[3].item() / n,
    }


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    sem_ids = np.load(os.path.join(args.data_dir, args.sem_ids))
    num_levels = sem_ids.shape[1]
    sequences = load_sequences(os.path.join(args.data_dir, "sequences.jsonl"))

    train_ds = SemanticIdSeqDataset(sequences, sem_ids, args.codebook_size, args.max_items, "train")
    valid_ds = SemanticIdSeqDataset(sequences, sem_ids, args.codebook_size, args.max_items, "valid")
    # strided shard of the validation users, no padding duplicates
    valid_shard = Subset(valid_ds, list(range(rank, len(valid_ds), world_size)))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_shard, batch_size=64, shuffle=False, collate_fn=collate, num_workers=2)

    config = T5Config(
        vocab_size=NUM_SPECIAL + num_levels * args.codebook_size,
        d_model=args.d_model,
        d_ff=args.d_model * 8,
        d_kv=64,
        num_layers=args.num_layers,
        num_decoder_layers=args.num_layers,
        num_heads=args.num_heads,
        dropout_rate=0.1,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    model = T5ForConditionalGeneration(config).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world_size} train={len(train_ds)} valid={len(valid_ds)} steps={total_steps}")

    best = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for input_ids, attn, labels in train_loader:
            input_ids = input_ids.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
            step += 1

        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch} loss {running[0].item() / running[1].item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} time {time.time() - t0:.1f}s")

        if (epoch + 1) % args.eval_every == 0:
            metrics = evaluate(model, valid_loader, device, args.beams, num_levels)
            if rank == 0:
                print(f"epoch {epoch} valid " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                if metrics["recall@10"] > best:
                    best = metrics["recall@10"]
                    torch.save({"model": model.module.state_dict(), "config": config.to_dict(),
                                "epoch": epoch, "metrics": metrics},
                               os.path.join(args.output_dir, "best.pt"))
            dist.barrier()

    if rank == 0:
        print(f"best recall@10 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
