"""Multi-task contract understanding: provision classification (LEDGAR) and
ContractNLI (entailment / contradiction / not-mentioned) share one encoder.
Each optimisation step samples one task (same task on every rank), so the other
task's head gets no gradient in that step.

Started with torch.multiprocessing (no torchrun on the lab workstations):
    python 18_multitask_contract_spawn.py --gpus 4 --ledgar_dir data/ledgar --cnli_dir data/contract_nli
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

NLI_LABELS = {"Entailment": 0, "Contradiction": 1, "NotMentioned": 2}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--ledgar_dir", required=True)
    ap.add_argument("--cnli_dir", required=True)
    ap.add_argument("--encoder", default="nlpaueb/legal-bert-base-uncased")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--steps_per_epoch", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--p_nli", type=float, default=0.4, help="probability of sampling the NLI task")
    ap.add_argument("--out_dir", default="runs/multitask_contracts")
    ap.add_argument("--port", default="29533")
    ap.add_argument("--seed", type=int, default=21)
    return ap.parse_args()


class LedgarDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.enc = [tok(r["provision"], truncation=True, max_length=max_len) for r in rows]
        self.labels = [r["label"] for r in rows]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {**self.enc[i], "labels": self.labels[i]}


class ContractNLIDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.enc = [tok(r["hypothesis"], r["premise"], truncation="only_second", max_length=max_len)
                    for r in rows]
        self.labels = [NLI_LABELS[r["label"]] for r in rows]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {**self.enc[i], "labels": self.labels[i]}


class StridedEvalSampler(Sampler):
    def __init__(self, n, rank, world):
        self.ix = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ix)

    def __len__(self):
        return len(self.ix)


class MultiTaskModel(nn.Module):
    def __init__(self, encoder, n_provisions):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder)
        d = self.encoder.config.hidden_size
        self.heads = nn.ModuleDict({
            "ledgar": nn.Sequential(nn.Dropout(0.1), nn.Linear(d, n_provisions)),
            "nli": nn.Sequential(nn.Dropout(0.1), nn.Linear(d, len(NLI_LABELS))),
        })

    def forward(self, task, input_ids, attention_mask, token_type_ids=None):
        pooled = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).pooler_output
        return self.heads[task](pooled)


def forever(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def accuracy(model, task, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        logits = model(task, b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
        s[0] += (logits.argmax(-1) == b["labels"]).sum()
        s[1] += b["labels"].numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    with open(os.path.join(args.ledgar_dir, "labels.json")) as f:
        n_provisions = len(json.load(f))

    train = {"ledgar": LedgarDataset(os.path.join(args.ledgar_dir, "train.jsonl"), tok, args.max_len),
             "nli": ContractNLIDataset(os.path.join(args.cnli_dir, "train.jsonl"), tok, args.max_len)}
    dev = {"ledgar": LedgarDataset(os.path.join(args.ledgar_dir, "dev.jsonl"), tok, args.max_len),
           "nli": ContractNLIDataset(os.path.join(args.cnli_dir, "dev.jsonl"), tok, args.max_len)}
    streams, dev_loaders = {}, {}
    for task, ds in train.items():
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                            num_workers=2, pin_memory=True, drop_last=True)
        streams[task] = forever(loader, sampler)
        dev_loaders[task] = DataLoader(dev[task], batch_size=64, collate_fn=collator, num_workers=2,
                                       sampler=StridedEvalSampler(len(dev[task]), rank, world_size))

    model = MultiTaskModel(args.encoder, n_provisions).to(device)
    # only one head is used per step
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, total // 10, total)

    # identical seed on every rank -> identical task sequence
    task_rng = random.Random(args.seed)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step in range(args.steps_per_epoch):
            task = "nli" if task_rng.random() < args.p_nli else "ledgar"
            b = {k: v.to(device, non_blocking=True) for k, v in next(streams[task]).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(task, b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
            loss = F.cross_entropy(logits.float(), b["labels"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} task {task} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        acc = {task: accuracy(model.module, task, loader, device) for task, loader in dev_loaders.items()}
        if rank == 0:
            print(f"epoch {epoch} dev {acc}", flush=True)
            score = (acc["ledgar"] + acc["nli"]) / 2
            if score > best:
                best = score
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "dev": acc},
                           os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
