"""TAPE remote homology (fold-level, 1195 classes) with ProtBert.

Data: TAPE remote_homology lmdb exported to json lines
({"primary": seq, "fold_label": int}). Test sets: fold / superfamily / family holdout.

    torchrun --nproc_per_node=8 15_remote_homology_protbert.py --data_dir data/remote_homology
"""
import argparse
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertModel, BertTokenizer, get_linear_schedule_with_warmup

N_FOLDS = 1195


def parse_args():
    parser = argparse.ArgumentParser(description="ProtBert remote homology fine-tuning")
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--model_name", type=str, default="Rostlab/prot_bert_bfd")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--output_dir", type=str, default="runs/protbert_rh")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def load_split(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class RemoteHomology(Dataset):
    def __init__(self, records):
        # ProtBert expects space separated residues, rare amino acids mapped to X
        self.seqs = [" ".join(re.sub(r"[UZOB]", "X", r["primary"])) for r in records]
        self.labels = [r["fold_label"] for r in records]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.labels[i]


class Collator:
    def __init__(self, tokenizer, max_length):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch):
        seqs, labels = zip(*batch)
        enc = self.tokenizer(list(seqs), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


class ProtBertFold(nn.Module):
    def __init__(self, model_name, n_classes):
        super().__init__()
        self.bert = BertModel.from_pretrained(model_name, add_pooling_layer=False)
        hidden = self.bert.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, n_classes)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).type_as(h)
        pooled = (h * m).sum(1) / m.sum(1)
        return self.classifier(self.dropout(pooled))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)   # top1 hits, top5 hits, n
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**batch)
        top5 = logits.topk(5, dim=-1).indices
        stats[0] += (top5[:, 0] == labels).sum()
        stats[1] += (top5 == labels[:, None]).any(-1).sum()
        stats[2] += labels.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tokenizer = BertTokenizer.from_pretrained(args.model_name, do_lower_case=False)
    collate = Collator(tokenizer, args.max_length)
    train_set = RemoteHomology(load_split(os.path.join(args.data_dir, "remote_homology_train.jsonl")))
    valid_set = RemoteHomology(load_split(os.path.join(args.data_dir, "remote_homology_valid.jsonl")))
    test_sets = {name: RemoteHomology(load_split(os.path.join(args.data_dir, f"remote_homology_test_{name}_holdout.jsonl")))
                 for name in ("fold", "superfamily", "family")}

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)

    def eval_loader(ds):
        s = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
        return DataLoader(ds, batch_size=64, sampler=s, collate_fn=collate, num_workers=2)

    model = ProtBertFold(args.model_name, N_FOLDS).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs // args.grad_accum
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            sync_now = (step + 1) % args.grad_accum == 0
            with model.no_sync() if not sync_now else torch.enable_grad():
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(**batch)
                    loss = F.cross_entropy(logits.float(), labels) / args.grad_accum
                scaler.scale(loss).backward()
            if sync_now:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item() * args.grad_accum:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        acc, top5 = evaluate(model, eval_loader(valid_set), device)
        if rank == 0:
            print(f"epoch {epoch}: valid top1 {acc:.4f} top5 {top5:.4f}", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    state = torch.load(os.path.join(args.output_dir, "best.pt"), map_location="cpu")
    model.module.load_state_dict(state)
    for name, ds in test_sets.items():
        acc, top5 = evaluate(model, eval_loader(ds), device)
        if rank == 0:
            print(f"test {name} holdout: top1 {acc:.4f} top5 {top5:.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
