#!/usr/bin/env python
"""Covenant-type classification of credit-agreement sections with Longformer-large.

Jobs on the shared cluster are pre-empted every few hours, so the script writes
`last.pt` at the end of each epoch and resumes from it automatically.

    torchrun --nproc_per_node=8 16_resume_covenant_cls.py --data_dir /lustre/fin/covenants \
        --ckpt_dir /lustre/runs/covenants_lf_large
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LongformerForSequenceClassification, get_linear_schedule_with_warmup

log = logging.getLogger("covenants")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--model", default="allenai/longformer-large-4096")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--warmup_ratio", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


class SectionDataset(Dataset):
    def __init__(self, path, tok, label2id, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.label2id, self.max_len = tok, label2id, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        text = r["heading"] + self.tok.sep_token + r["body"]
        enc = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length")
        g = [0] * len(enc["input_ids"])
        g[0] = 1
        return (torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]), torch.tensor(g),
                self.label2id[r["covenant_type"]], i)


@torch.no_grad()
def evaluate(model, loader, device, num_labels, world):
    model.eval()
    rows = []
    for ids, att, g, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids.to(device), attention_mask=att.to(device),
                           global_attention_mask=g.to(device)).logits
        rows.extend(zip(idx.tolist(), logits.argmax(-1).tolist(), y.tolist()))
    parts = [None] * world
    dist.all_gather_object(parts, rows)
    uniq = {i: (p, t) for part in parts for i, p, t in part}
    conf = torch.zeros(num_labels, num_labels)
    for p, t in uniq.values():
        conf[t, p] += 1
    tp = conf.diag()
    prec = tp / conf.sum(0).clamp(min=1)
    rec = tp / conf.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-9)
    model.train()
    return {"accuracy": (tp.sum() / conf.sum()).item(), "macro_f1": f1.mean().item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data_dir, "covenant_types.json")) as f:
        types = json.load(f)
    label2id = {t: i for i, t in enumerate(types)}
    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = SectionDataset(os.path.join(args.data_dir, "train.jsonl"), tok, label2id, args.max_len)
    dev_ds = SectionDataset(os.path.join(args.data_dir, "dev.jsonl"), tok, label2id, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=8, sampler=DistributedSampler(dev_ds, shuffle=False), num_workers=4)

    model = LongformerForSequenceClassification.from_pretrained(args.model, num_labels=len(types))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    last_path = os.path.join(args.ckpt_dir, "last.pt")
    start_epoch, best = 0, 0.0
    if os.path.exists(last_path):
        state = torch.load(last_path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        del state
        log.info("resuming at epoch %d (best macro-F1 so far %.4f)", start_epoch, best)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (ids, att, g, y, _) in enumerate(train_dl):
            ids, att, g, y = (t.to(device, non_blocking=True) for t in (ids, att, g, y))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=att, global_attention_mask=g).logits
            loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f %.1fs", epoch, step, len(train_dl), loss.item(),
                         time.time() - t0)

        metrics = evaluate(model.module, dev_dl, device, len(types), world)
        log.info("epoch %d dev %s", epoch, metrics)
        if rank == 0:
            if metrics["macro_f1"] > best:
                best = metrics["macro_f1"]
                model.module.save_pretrained(os.path.join(args.ckpt_dir, "best"))
                tok.save_pretrained(os.path.join(args.ckpt_dir, "best"))
            tmp = last_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, tmp)
            os.replace(tmp, last_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
