"""Support-ticket priority classifier (bert-base) with step-based checkpoint rotation.

torchrun --nnodes=1 --nproc_per_node=4 --max-restarts=5 03_support_ticket_bert_rotation.py \
    --train /data/tickets/train.parquet --valid /data/tickets/valid.parquet
"""
import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = ["P0", "P1", "P2", "P3"]
CKPT_RE = re.compile(r"checkpoint-(\d+)$")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--model-name", default="bert-base-uncased")
    ap.add_argument("--out", default="/shared/experiments/ticket_prio")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--bsz", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--save-steps", type=int, default=500)
    ap.add_argument("--save-total-limit", type=int, default=3)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class TicketDataset(Dataset):
    def __init__(self, df, tok, max_len):
        self.text = (df["subject"].fillna("") + " [SEP] " + df["body"].fillna("")).tolist()
        self.label = df["priority"].map({l: i for i, l in enumerate(LABELS)}).tolist()
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        enc = self.tok(self.text[i], truncation=True, max_length=self.max_len,
                       padding="max_length", return_tensors="pt")
        item = {k: v.squeeze(0) for k, v in enc.items()}
        item["labels"] = torch.tensor(self.label[i])
        return item


def sorted_checkpoints(out_dir: Path):
    found = []
    for p in out_dir.glob("checkpoint-*"):
        m = CKPT_RE.search(p.name)
        if m and (p / "trainer_state.json").exists():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def save_checkpoint(out_dir: Path, step, epoch, model, optimizer, scheduler, limit):
    ckpt = out_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    model.module.save_pretrained(ckpt, safe_serialization=True)
    torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
    torch.save(scheduler.state_dict(), ckpt / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}, ckpt / "rng.pt")
    with open(ckpt / "trainer_state.json", "w") as f:
        json.dump({"global_step": step, "epoch": epoch}, f)

    ckpts = sorted_checkpoints(out_dir)
    for stale in ckpts[:-limit]:
        shutil.rmtree(stale)


def load_checkpoint(out_dir: Path, model, optimizer, scheduler, device):
    ckpts = sorted_checkpoints(out_dir)
    if not ckpts:
        return 0, 0
    last = ckpts[-1]
    from safetensors.torch import load_file
    model.module.load_state_dict(load_file(last / "model.safetensors", device="cpu"))
    optimizer.load_state_dict(torch.load(last / "optimizer.pt", map_location=device))
    scheduler.load_state_dict(torch.load(last / "scheduler.pt", map_location="cpu"))
    rng = torch.load(last / "rng.pt", map_location="cpu")
    torch.set_rng_state(rng["cpu"])
    torch.cuda.set_rng_state(rng["cuda"])
    state = json.loads((last / "trainer_state.json").read_text())
    return state["global_step"], state["epoch"]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(len(LABELS), len(LABELS), device=device, dtype=torch.long)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model.module(**{k: v for k, v in batch.items() if k != "labels"}).logits
        pred = logits.argmax(-1)
        idx = batch["labels"] * len(LABELS) + pred
        conf += torch.bincount(idx, minlength=len(LABELS) ** 2).view(len(LABELS), len(LABELS))
    dist.all_reduce(conf)
    model.train()
    tp = conf.diag().float()
    prec = tp / conf.sum(0).clamp(min=1)
    rec = tp / conf.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    return (tp.sum() / conf.sum()).item(), f1.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    train_df = pd.read_parquet(args.train)
    valid_df = pd.read_parquet(args.valid)
    train_ds = TicketDataset(train_df, tok, args.max_len)
    valid_ds = TicketDataset(valid_df, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=64, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=len(LABELS))
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    global_step, start_epoch = load_checkpoint(out_dir, model, optimizer, scheduler, device)
    steps_done_in_epoch = global_step - start_epoch * len(train_dl)
    if rank == 0 and global_step:
        print(f"resuming at step {global_step} (epoch {start_epoch}, +{steps_done_in_epoch})")

    best_f1 = -1.0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            if epoch == start_epoch and i < steps_done_in_epoch:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if rank == 0 and global_step % 50 == 0:
                print(f"ep {epoch} step {global_step} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
            if global_step % args.save_steps == 0:
                save_checkpoint(out_dir, global_step, epoch, model, optimizer, scheduler,
                                args.save_total_limit)
                dist.barrier()

        acc, macro_f1 = evaluate(model, valid_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: acc={acc:.4f} macro_f1={macro_f1:.4f}", flush=True)
            if macro_f1 > best_f1:
                best_f1 = macro_f1
                model.module.save_pretrained(out_dir / "best", safe_serialization=True)
                tok.save_pretrained(out_dir / "best")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
