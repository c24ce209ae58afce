"""
Generative retrieval with a t5-small-shaped model over semantic IDs (P5-CID / TIGER setup).
Items are tokenised as <a_12><b_201><c_7><d_0> with the RQ-VAE codes (last level = collision id).

Run:
    torchrun --nproc_per_node=4 18_tiger_t5_small.py --dataset toys --epochs 100
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration, get_linear_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser(description="TIGER t5-small")
    parser.add_argument("--dataset", type=str, default="toys")
    parser.add_argument("--data_root", type=str, default="./data")
    parser.add_argument("--codebook_size", type=int, default=256)
    parser.add_argument("--max_his", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--warmup_ratio", type=float, default=0.05)
    parser.add_argument("--beam_size", type=int, default=20)
    parser.add_argument("--logging_step", type=int, default=200)
    parser.add_argument("--output_dir", type=str, default="./output")
    parser.add_argument("--seed", type=int, default=2023)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class SeqRecDataset(Dataset):
    def __init__(self, root, dataset, K, max_his, mode):
        self.K = K
        self.sem = np.load(os.path.join(root, dataset, f"{dataset}.sem_ids.npy"))
        with open(os.path.join(root, dataset, f"{dataset}.inter.json")) as f:
            inters = json.load(f)
        self.data = []
        for uid, items in inters.items():
            if mode == "train":
                for i in range(1, len(items) - 2):
                    self.data.append((items[max(0, i - max_his):i], items[i]))
            elif mode == "valid":
                self.data.append((items[-2 - max_his:-2], items[-2]))
            else:
                self.data.append((items[-1 - max_his:-1], items[-1]))

    def encode(self, item):
        return [2 + lvl * self.K + int(c) for lvl, c in enumerate(self.sem[item])]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        his, tgt = self.data[idx]
        return sum((self.encode(i) for i in his), []), self.encode(tgt) + [1]


class Collator:
    def __init__(self, pad_id=0):
        self.pad_id = pad_id

    def __call__(self, batch):
        max_len = max(len(x) for x, _ in batch)
        input_ids = torch.full((len(batch), max_len), self.pad_id, dtype=torch.long)
        for i, (x, _) in enumerate(batch):
            input_ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        labels = torch.tensor([y for _, y in batch], dtype=torch.long)
        return input_ids, input_ids.ne(self.pad_id).long(), labels


@torch.no_grad()
def test(model, loader, device, beam_size, n_levels):
    model.eval()
    metrics = torch.zeros(5, device=device)
    for input_ids, attention_mask, labels in loader:
        input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n_levels + 1,
                                num_beams=beam_size, num_return_sequences=beam_size)
        preds = output[:, 1:n_levels + 1].view(input_ids.size(0), beam_size, n_levels)
        match = (preds == labels[:, None, :n_levels]).all(-1)
        pos = match.float().argmax(-1)
        for j, k in enumerate((5, 10)):
            hit = match[:, :k].any(-1).float()
            metrics[j] += hit.sum()
            metrics[2 + j] += (hit / torch.log2(pos.float() + 2)).sum()
        metrics[4] += input_ids.size(0)
    dist.all_reduce(metrics)
    model.train()
    m = (metrics[:4] / metrics[4]).tolist()
    return {"recall@5": m[0], "recall@10": m[1], "ndcg@5": m[2], "ndcg@10": m[3]}


def main():
    args = parse_args()
    seed_everything(args.seed)

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_data = SeqRecDataset(args.data_root, args.dataset, args.codebook_size, args.max_his, "train")
    valid_data = SeqRecDataset(args.data_root, args.dataset, args.codebook_size, args.max_his, "valid")
    n_levels = train_data.sem.shape[1]
    collator = Collator()
    train_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_data, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, drop_last=True)
    valid_loader = DataLoader(Subset(valid_data, range(rank, len(valid_data), world_size)),
                              batch_size=64, collate_fn=collator, num_workers=2)

    config = T5Config(vocab_size=2 + n_levels * args.codebook_size, d_model=512, d_ff=2048, d_kv=64,
                      num_layers=6, num_heads=8, dropout_rate=0.1, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"train: {len(train_data)}  valid: {len(valid_data)}  world size: {world_size}")

    best_ndcg = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for input_ids, attention_mask, labels in train_loader:
            input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} | loss {(loss_sum[0] / loss_sum[1]).item():.4f} | {time.time() - t0:.0f}s",
                  flush=True)

        if (epoch + 1) % 5 == 0:
            res = test(model.module, valid_loader, device, args.beam_size, n_levels)
            if rank == 0:
                print(f"valid epoch {epoch}: {res}", flush=True)
                if res["ndcg@10"] > best_ndcg:
                    best_ndcg = res["ndcg@10"]
                    model.module.save_pretrained(os.path.join(args.output_dir, f"{args.dataset}_best"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
